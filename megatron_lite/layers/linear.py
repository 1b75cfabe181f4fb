"""Column- and row-parallel linear layers (no bias, as in Llama).

ColumnParallelLinear: Y = X A with A split along its output columns; each rank computes its
block of Y from the full X. RowParallelLinear: Y = X A with A split along its input rows;
each rank multiplies its slice of X and the partial products are summed. A column layer
followed by a row layer needs one reduction in forward and one in backward.

With sequence parallelism the input of a column layer arrives split along the sequence and
is all-gathered first, and a row layer's output is reduce-scattered back to sequence slices
instead of all-reduced: the same bytes on the wire, but activations outside the TP region
are 1/t the size. The column layer keeps only its input shard for backward and gathers it
again there (`_SequenceGatherLinear`), so its saved input is 1/t the size too.
Layers take `sequence_parallel` as the flag in effect, already False at TP=1
(`model.llama.BuildOptions` resolves it once).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron_lite.layers import tags
from megatron_lite.layers.init import init_shard
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState


class _SequenceGatherLinear(torch.autograd.Function):
    """x_full W^T for a sequence-parallel input, saving only this rank's [s/t, b, in] shard.

    Gathering outside the matmul would make autograd save the gathered [s, b, in] input, t
    times the shard. Megatron-LM instead re-gathers in backward and hides that all-gather
    behind the input-gradient GEMM, and the input gradient's reduce-scatter behind the
    weight-gradient GEMM; so does this.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, group: comms.Group) -> Tensor:
        x = x.contiguous()
        ctx.group = group
        ctx.save_for_backward(x, weight)
        x_full, _ = comms.all_gather_dim0(x, group)
        return F.linear(x_full, weight)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight = ctx.saved_tensors
        # Dynamo cannot trace async_op=True; its functional collectives are asynchronous
        # anyway and the compiler places their waits.
        async_op = not torch.compiler.is_compiling()
        x_full, gather = comms.all_gather_dim0(x, ctx.group, async_op=async_op)
        grad_input = grad.matmul(weight)  # [s, b, in], contiguous
        if gather is not None:
            gather.wait()
        grad_x, scatter = comms.reduce_scatter_dim0(grad_input, ctx.group, async_op=async_op)
        grad_weight = grad.reshape(-1, grad.size(-1)).t().matmul(
            x_full.reshape(-1, x_full.size(-1)))
        if scatter is not None:
            scatter.wait()
        return grad_x, grad_weight, None


def column_parallel_linear(x: Tensor, weight: Tensor, group: comms.Group,
                           sequence_parallel: bool) -> Tensor:
    """x [s(/t), b, in] (sequence slices iff `sequence_parallel`) -> x W^T [s, b, out/t].

    Shared by ColumnParallelLinear and the vocab-parallel output layer. `sequence_parallel`
    must already be False at TP=1.
    """
    if sequence_parallel:
        return _SequenceGatherLinear.apply(x, weight, group)
    return F.linear(comms.copy_to_region(x, group), weight)


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
        self.sequence_parallel = sequence_parallel
        split = tags.column_split(partitions)
        self.weight = tags.mark_tp_split(nn.Parameter(init_shard(
            (sum(partitions), in_features), split, std=std, seed=seed, name=name,
            tp_size=pstate.tp_size, tp_rank=pstate.tp_rank, device=pstate.device,
            dtype=dtype)), split)

    def forward(self, x: Tensor) -> Tensor:
        return column_parallel_linear(x, self.weight, self.tp_group, self.sequence_parallel)


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
        self.sequence_parallel = sequence_parallel
        split = tags.row_split()
        self.weight = tags.mark_tp_split(nn.Parameter(init_shard(
            (out_features, in_features), split, std=std, seed=seed, name=name,
            tp_size=pstate.tp_size, tp_rank=pstate.tp_rank, device=pstate.device,
            dtype=dtype)), split)

    def forward(self, x: Tensor) -> Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            return comms.reduce_scatter_to_sequence_region(partial, self.tp_group)
        return comms.reduce_from_region(partial, self.tp_group)
