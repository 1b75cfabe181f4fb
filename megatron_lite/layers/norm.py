"""RMSNorm module (Zhang & Sennrich 2019) dispatching to the fused kernel or its reference."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from megatron_lite.kernels.rmsnorm import rms_norm
from megatron_lite.layers import tags
from megatron_lite.layers.context import LayerContext


class RMSNorm(nn.Module):
    """y = x / rms(x) * w over the last dim.

    Its weight is replicated over TP. Under sequence parallelism (the context's flag in
    effect, False at TP=1) each TP rank sees a different slice of the sequence, so the
    weight's gradient is partial and must be summed over TP after backward: its tag says so.
    A `per_head` norm (--qk-layernorm's q/k norms) is partial at any TP > 1: each rank sees
    its own heads.
    """

    def __init__(self, hidden: int, eps: float, ctx: LayerContext, *, per_head: bool = False
                 ) -> None:
        super().__init__()
        self.eps = eps
        self.use_triton = ctx.use_triton
        self.weight = tags.mark_replicated(
            nn.Parameter(torch.ones(hidden, device=ctx.device, dtype=ctx.dtype)))
        partial_grad = ctx.tp_size > 1 if per_head else ctx.sequence_parallel
        if partial_grad:
            tags.mark_sequence_parallel_grad(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, use_triton=self.use_triton)
