"""SwiGLU activation (Shazeer 2020, "GLU Variants Improve Transformer"): y = silu(gate) * up.

silu(a) = a * sigmoid(a). Backward, with g = dL/dy and s = sigmoid(a):
    d_gate = g * up * s * (1 + a * (1 - s));   d_up = g * silu(a)
The Triton backward recomputes s from the saved gate instead of storing silu(gate), the same trade
Megatron-LM's fused bias-SwiGLU makes: one elementwise recompute for one activation less in memory.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """Plain-PyTorch SwiGLU in fp32, cast back to gate's dtype; autograd gives the backward."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def swiglu(gate: Tensor, up: Tensor, use_triton: bool = False) -> Tensor:
    """silu(gate) * up, elementwise; gate and up have the same shape."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    if use_triton:
        raise NotImplementedError("Triton SwiGLU lands next; use --triton-kernels off")
    return swiglu_reference(gate, up)
