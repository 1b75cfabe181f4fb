"""RMSNorm module (Zhang & Sennrich 2019) dispatching to the fused kernel or its reference."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from megatron_lite.kernels.rmsnorm import rms_norm
from megatron_lite.layers import tags


class RMSNorm(nn.Module):
    """y = x / rms(x) * w over the last dim.

    Its weight is replicated over TP. Under sequence parallelism (`sequence_parallel`: the
    flag in effect, False at TP=1) each TP rank sees a different slice of the sequence, so the
    weight's gradient is partial and must be summed over TP after backward: its tag says so.
    The q/k norms of --qk-layernorm pass True at any TP > 1: each rank sees its own heads.
    """

    def __init__(self, hidden: int, eps: float, *, sequence_parallel: bool,
                 device: torch.device, dtype: torch.dtype = torch.float32,
                 use_triton: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.use_triton = use_triton
        self.weight = tags.mark_replicated(
            nn.Parameter(torch.ones(hidden, device=device, dtype=dtype)))
        if sequence_parallel:
            tags.mark_sequence_parallel_grad(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, use_triton=self.use_triton)
