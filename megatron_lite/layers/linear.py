"""Column- and row-parallel linear layers (no bias, as in Llama; a column layer may take one).

ColumnParallelLinear: Y = X A with A split along its output columns; each rank computes its
block of Y from the full X. RowParallelLinear: Y = X A with A split along its input rows;
each rank multiplies its slice of X and the partial products are summed. A column layer
followed by a row layer needs one reduction in forward and one in backward.

With sequence parallelism the input of a column layer arrives split along the sequence and
is all-gathered first, and a row layer's output is reduce-scattered back to sequence slices
instead of all-reduced: the same bytes on the wire, but activations outside the TP region
are 1/t the size. The column layer keeps only its input shard for backward and gathers it
again there (`_SequenceGatherLinear`), so its saved input is 1/t the size too.
Layers read the TP group, the sequence-parallel flag in effect (already False at TP=1), the
seed, dtype and weight-gradient queue from their `LayerContext` (layers/context.py).

Zero-bubble pipeline schedules split each backward into B (the input gradient, which the
previous stage waits for) and W (the weight gradient). A layer given a `WeightGradQueue`
computes only the input gradient in backward and queues the weight-gradient GEMM with what
it needs (its input, its output gradient); the schedule's W step runs the queue. Without a
queue (every other schedule) the layers are plain autograd, unchanged.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron_lite.layers import tags
from megatron_lite.layers.fp8 import Fp8Groups, Fp8State, Fp8Weight, fp8_linear
from megatron_lite.layers.init import init_shard
from megatron_lite.parallel import comms

if TYPE_CHECKING:  # context.py imports this module (for WeightGradQueue)
    from megatron_lite.layers.context import LayerContext


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
        x_full, _ = comms.all_gather_dim0(x, group, kind="tp")
        return F.linear(x_full, weight)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight = ctx.saved_tensors
        # Dynamo cannot trace async_op=True; its functional collectives are asynchronous
        # anyway and the compiler places their waits.
        async_op = not torch.compiler.is_compiling()
        x_full, gather = comms.all_gather_dim0(x, ctx.group, kind="tp", async_op=async_op)
        grad_input = grad.matmul(weight)  # [s, b, in], contiguous
        if gather is not None:
            gather.wait()
        grad_x, scatter = comms.reduce_scatter_dim0(grad_input, ctx.group, kind="tp",
                                                  async_op=async_op)
        grad_weight = grad.reshape(-1, grad.size(-1)).t().matmul(
            x_full.reshape(-1, x_full.size(-1)))
        if scatter is not None:
            scatter.wait()
        return grad_x, grad_weight, None


class WeightGradQueue:
    """The weight-gradient work that B steps deferred, per micro-batch, for one model chunk.

    The engine opens `recording(mb)` around a B step; each deferring layer's backward then
    `push`es a closure computing its weight gradient. The W step `pop`s the micro-batch's
    closures and gets one gradient per parameter (a weight used twice, like a tied embedding
    inside one chunk, gets the sum). Parameters are known up front (`params`) so the engine
    can tell a weight shared by two chunks of a stage (ZBV's tied embedding and head).
    """

    def __init__(self) -> None:
        self.params: dict[int, nn.Parameter] = {}
        """id -> parameter, for every weight whose gradient comes only from W."""
        self._recording: int | None = None
        self._work: dict[int, list[tuple[nn.Parameter, Callable[[], Tensor]]]] = (
            defaultdict(list))

    def register(self, param: nn.Parameter) -> None:
        self.params[id(param)] = param

    @contextmanager
    def recording(self, microbatch: int) -> Iterator[None]:
        """Backward passes inside queue their weight gradients under `microbatch`."""
        self._recording = microbatch
        try:
            yield
        finally:
            self._recording = None

    def push(self, param: nn.Parameter, weight_grad: Callable[[], Tensor]) -> None:
        if self._recording is None:
            raise RuntimeError(
                "a layer built for a zero-bubble schedule (--pipeline-schedule zb-h1/zbv) ran "
                "backward outside the pipeline engine's B step; its weight gradient would be "
                "lost. Build the model without a WeightGradQueue for plain autograd")
        self._work[self._recording].append((param, weight_grad))

    def pop(self, microbatch: int) -> Iterator[tuple[nn.Parameter, Tensor]]:
        """Run the W work of `microbatch`: (parameter, weight gradient) once per parameter,
        in the order B queued them, one at a time: the caller accumulates each before the
        next is computed, so only one weight gradient is alive (as in autograd)."""
        by_param: dict[int, list[Callable[[], Tensor]]] = defaultdict(list)
        params: dict[int, nn.Parameter] = {}
        for param, weight_grad in self._work.pop(microbatch, []):
            by_param[id(param)].append(weight_grad)
            params[id(param)] = param
        for pid in list(by_param):
            works = by_param.pop(pid)  # dropped once used: frees what the closures hold
            with torch.no_grad():  # as inside autograd's backward
                grad = works[0]()
                for work in works[1:]:
                    grad = grad + work()
            del works
            yield params.pop(pid), grad

    def pending(self) -> list[int]:
        """Micro-batches whose W has not run (empty after every complete step)."""
        return sorted(self._work)


@dataclass(frozen=True)
class DeferredWeight:
    """What a deferring layer's autograd node needs besides its input. Not a tensor, so
    autograd adds no edge to the weight: its gradient arrives only through the W step (and
    the optimizer's gradient hooks fire there, once per micro-batch)."""

    weight: nn.Parameter
    queue: WeightGradQueue
    gather_group: comms.Group = None
    """TP group the input of a linear is sequence-sharded over (SP column); None if whole."""
    scatter_group: comms.Group = None
    """TP group the output of a linear is reduce-scattered over (SP row); None if not."""


def _gather(x: Tensor, group: comms.Group) -> Tensor:
    return x if group is None else comms.all_gather_dim0(x.contiguous(), group, kind="tp")[0]


class _DeferredWeightGradLinear(torch.autograd.Function):
    """x W^T whose backward returns the input gradient and queues the weight-gradient GEMM.

    Under SP what W keeps is sequence-sharded, as `_SequenceGatherLinear` keeps its input: a
    column layer's [s/t, b, in] input shard, and a row layer's [s/t, b, out] output-gradient
    shard (this node also does the row layer's reduce-scatter, so that it sees the shard).
    W all-gathers them again before its GEMM; every TP rank of a stage runs the same W steps
    in the same order.
    """

    @staticmethod
    def forward(ctx, x: Tensor, deferred: DeferredWeight) -> Tensor:
        ctx.deferred = deferred
        ctx.save_for_backward(x)
        out = F.linear(_gather(x, deferred.gather_group), deferred.weight)
        if deferred.scatter_group is not None:
            out = comms.reduce_scatter_dim0(out.contiguous(), deferred.scatter_group,
                                            kind="tp")[0]
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (x,) = ctx.saved_tensors
        deferred = ctx.deferred
        grad_x = _gather(grad, deferred.scatter_group).matmul(deferred.weight)

        def weight_grad() -> Tensor:
            full_grad = _gather(grad, deferred.scatter_group)
            full_x = _gather(x, deferred.gather_group)
            return full_grad.reshape(-1, full_grad.size(-1)).t().matmul(
                full_x.reshape(-1, full_x.size(-1)))

        deferred.queue.push(deferred.weight, weight_grad)
        if deferred.gather_group is not None:
            grad_x = comms.reduce_scatter_dim0(grad_x, deferred.gather_group, kind="tp")[0]
        return grad_x, None


def column_parallel_linear(x: Tensor, weight: Tensor, group: comms.Group,
                           sequence_parallel: bool,
                           weight_grads: WeightGradQueue | None = None) -> Tensor:
    """x [s(/t), b, in] (sequence slices iff `sequence_parallel`) -> x W^T [s, b, out/t].

    Shared by ColumnParallelLinear and the vocab-parallel output layer. `sequence_parallel`
    must already be False at TP=1. With `weight_grads` the weight gradient waits for W.
    """
    if weight_grads is not None:
        if sequence_parallel:
            return _DeferredWeightGradLinear.apply(x, DeferredWeight(weight, weight_grads, group))
        return _DeferredWeightGradLinear.apply(comms.copy_to_region(x, group, kind="tp"),
                                               DeferredWeight(weight, weight_grads))
    if sequence_parallel:
        return _SequenceGatherLinear.apply(x, weight, group)
    return F.linear(comms.copy_to_region(x, group, kind="tp"), weight)


def _deferred_push(queue: WeightGradQueue | None, weight: nn.Parameter
                   ) -> Callable[[Callable[[], Tensor]], None] | None:
    """Where an FP8 linear hands its weight-gradient GEMM under a zero-bubble schedule."""
    return None if queue is None else functools.partial(queue.push, weight)


class ColumnParallelLinear(nn.Module):
    """Weight [sum(partitions)/t, in]; input [s(/t), b, in] -> output [s, b, sum(partitions)/t].

    With `bias` (--add-qkv-bias) a bias [sum(partitions)/t] is added to the output: split over
    TP like the weight's rows, so each rank adds the slice of its own output columns. It
    starts at zero (Megatron's init) and, being outside the matmul, gets its gradient from
    plain autograd even when the weight's is deferred to a W step.
    """

    def __init__(self, in_features: int, partitions: Sequence[int], ctx: LayerContext, *,
                 std: float, name: str, bias: bool = False) -> None:
        super().__init__()
        for rows in partitions:
            if rows % ctx.tp_size:
                raise ValueError(f"{name}: {rows} output features not divisible by TP "
                                 f"{ctx.tp_size}")
        self.tp_group = ctx.tp_group
        self.sequence_parallel = ctx.sequence_parallel
        split = tags.column_split(partitions)
        self.weight = tags.mark_tp_split(nn.Parameter(init_shard(
            (sum(partitions), in_features), split, std=std, seed=ctx.seed, name=name,
            tp_size=ctx.tp_size, tp_rank=ctx.tp_rank, device=ctx.device,
            dtype=ctx.dtype)), split)
        self.bias = (tags.mark_tp_split(nn.Parameter(torch.zeros(
            sum(partitions) // ctx.tp_size, device=ctx.device, dtype=ctx.dtype)), split)
            if bias else None)
        self.weight_grads = ctx.weight_grads
        if self.weight_grads is not None:
            self.weight_grads.register(self.weight)
        self.fp8 = ctx.fp8
        self.fp8_state = (Fp8State(ctx.fp8, ctx.device)
                          if ctx.fp8 is not None and ctx.fp8.delayed else None)
        self.fp8_weight: Fp8Weight | None = None
        """Under --fp8-param-gather: the weight in fp8 as the optimizer gathered it."""
        if ctx.fp8 is not None:
            tags.mark_fp8_weight(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        if self.fp8 is not None:
            # The weight rows and the output gradient's columns are split: their amax spans
            # TP. A sequence-parallel input is quantized as a shard and gathered in fp8.
            sequence = self.tp_group if self.sequence_parallel else None
            if sequence is None:
                x = comms.copy_to_region(x, self.tp_group, kind="tp")
            out = fp8_linear(x, self.weight, self.fp8, Fp8Groups(
                weight=self.tp_group, grad=self.tp_group, sequence=sequence), self.fp8_state,
                self.fp8_weight, _deferred_push(self.weight_grads, self.weight))
            return out if self.bias is None else out + self.bias
        out = column_parallel_linear(x, self.weight, self.tp_group, self.sequence_parallel,
                                     self.weight_grads)
        return out if self.bias is None else out + self.bias


class RowParallelLinear(nn.Module):
    """Weight [out, in/t]; input [s, b, in/t] -> output [s(/t), b, out] summed over TP."""

    def __init__(self, in_features: int, out_features: int, ctx: LayerContext, *,
                 std: float, name: str) -> None:
        super().__init__()
        if in_features % ctx.tp_size:
            raise ValueError(f"{name}: {in_features} input features not divisible by TP "
                             f"{ctx.tp_size}")
        self.tp_group = ctx.tp_group
        self.sequence_parallel = ctx.sequence_parallel
        split = tags.row_split()
        self.weight = tags.mark_tp_split(nn.Parameter(init_shard(
            (out_features, in_features), split, std=std, seed=ctx.seed, name=name,
            tp_size=ctx.tp_size, tp_rank=ctx.tp_rank, device=ctx.device,
            dtype=ctx.dtype)), split)
        self.weight_grads = ctx.weight_grads
        if self.weight_grads is not None:
            self.weight_grads.register(self.weight)
        self.fp8 = ctx.fp8
        self.fp8_state = (Fp8State(ctx.fp8, ctx.device)
                          if ctx.fp8 is not None and ctx.fp8.delayed else None)
        self.fp8_weight: Fp8Weight | None = None
        """Under --fp8-param-gather: the weight in fp8 as the optimizer gathered it."""
        if ctx.fp8 is not None:
            tags.mark_fp8_weight(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        if self.fp8 is not None:
            # The input's and weight's columns are split over TP, their amax spans it; the
            # output gradient arrives whole on every rank.
            partial = fp8_linear(x, self.weight, self.fp8,
                                 Fp8Groups(x=self.tp_group, weight=self.tp_group), self.fp8_state,
                                 self.fp8_weight, _deferred_push(self.weight_grads, self.weight))
        elif self.weight_grads is not None:
            if self.sequence_parallel:
                return _DeferredWeightGradLinear.apply(x, DeferredWeight(
                    self.weight, self.weight_grads, scatter_group=self.tp_group))
            partial = _DeferredWeightGradLinear.apply(
                x, DeferredWeight(self.weight, self.weight_grads))
            return comms.reduce_from_region(partial, self.tp_group, kind="tp")
        else:
            partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            return comms.reduce_scatter_to_sequence_region(partial, self.tp_group, kind="tp")
        return comms.reduce_from_region(partial, self.tp_group, kind="tp")
