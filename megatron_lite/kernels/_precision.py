"""The dtype the reference kernels compute in: fp32 for bf16/fp16/fp32 inputs, float64 for
float64 ones (so --fp64 runs stay float64 end to end instead of rounding to fp32 here)."""

from __future__ import annotations

import torch
from torch import Tensor


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def upcast(t: Tensor) -> Tensor:
    """`t` in its math dtype (no copy when it already is)."""
    return t.to(math_dtype(t.dtype))
