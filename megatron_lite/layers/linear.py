"""Column- and row-parallel linear layers (no bias, as in Llama).

ColumnParallelLinear: Y = X A with A split along its output columns; each rank computes its
block of Y from the full X. RowParallelLinear: Y = X A with A split along its input rows;
each rank multiplies its slice of X and the partial products are summed. A column layer
followed by a row layer needs one reduction in forward and one in backward.

With sequence parallelism the input of a column layer arrives split along the sequence and
is all-gathered first, and a row layer's output is reduce-scattered back to sequence slices
instead of all-reduced: the same bytes on the wire, but activations outside the TP region
are 1/t the size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron_lite.layers.init import normal_full, shard_cols, shard_rows
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState


class ColumnParallelLinear(nn.Module):
    """Weight [sum(partitions)/t, in]; input [s(/t), b, in] -> output [s, b, sum(partitions)/t]."""

    def __init__(self, in_features: int, partitions: Sequence[int], pstate: ParallelState,
                 *, sequence_parallel: bool, std: float, seed: int, name: str,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        for rows in partitions:
            if rows % pstate.tp_size:
                raise ValueError(f"{name}: {rows} output features not divisible by TP "
                                 f"{pstate.tp_size}")
        self.tp_group = pstate.tp_group
        self.sequence_parallel = sequence_parallel and pstate.tp_size > 1
        full = normal_full((sum(partitions), in_features), std, seed, name)
        self.weight = nn.Parameter(
            shard_rows(full, partitions, pstate.tp_size, pstate.tp_rank)
            .to(device=pstate.device, dtype=dtype))
        self.weight.tp_split = ("rows", tuple(partitions))

    def forward(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:
            x = comms.gather_from_sequence_region(x, self.tp_group)
        else:
            x = comms.copy_to_region(x, self.tp_group)
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """Weight [out, in/t]; input [s, b, in/t] -> output [s(/t), b, out] summed over TP."""

    def __init__(self, in_features: int, out_features: int, pstate: ParallelState,
                 *, sequence_parallel: bool, std: float, seed: int, name: str,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if in_features % pstate.tp_size:
            raise ValueError(f"{name}: {in_features} input features not divisible by TP "
                             f"{pstate.tp_size}")
        self.tp_group = pstate.tp_group
        self.sequence_parallel = sequence_parallel and pstate.tp_size > 1
        full = normal_full((out_features, in_features), std, seed, name)
        self.weight = nn.Parameter(
            shard_cols(full, pstate.tp_size, pstate.tp_rank).to(device=pstate.device, dtype=dtype))
        self.weight.tp_split = ("cols",)

    def forward(self, x: Tensor) -> Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            return comms.reduce_scatter_to_sequence_region(partial, self.tp_group)
        return comms.reduce_from_region(partial, self.tp_group)
