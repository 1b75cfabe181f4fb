"""The SwiGLU MLP: the dense layers' MLP and a MoE layer's shared expert."""

from __future__ import annotations

import math

from torch import Tensor, nn

from megatron_lite.config import ModelConfig
from megatron_lite.kernels.swiglu import swiglu
from megatron_lite.layers.context import LayerContext
from megatron_lite.layers.linear import ColumnParallelLinear, RowParallelLinear


class SwiGLUMLP(nn.Module):
    """down(silu(x W_gate) * (x W_up)) of inner `width`, gate and up fused in one column layer;
    its weights are drawn as `{name}.gate_up` and `{name}.down`."""

    def __init__(self, cfg: ModelConfig, ctx: LayerContext, width: int, name: str) -> None:
        super().__init__()
        self.gate_up = ColumnParallelLinear(cfg.hidden_size, [width, width], ctx,
                                            std=cfg.init_method_std, name=f"{name}.gate_up")
        self.down = RowParallelLinear(width, cfg.hidden_size, ctx,
                                      std=cfg.init_method_std / math.sqrt(2 * cfg.num_layers),
                                      name=f"{name}.down")
        self.use_triton = ctx.use_triton

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(swiglu(gate, up, use_triton=self.use_triton))
