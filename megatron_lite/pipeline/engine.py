"""Runs one stage's schedule: forwards, backwards and transfers, in the listed order.

The training loop calls `forward_backward` once per optimizer step on every rank, with the
rank's own action list from `schedule.build_schedule` and its model chunks, then finalizes
gradients (SP norms over TP, tied embeddings over the embedding group, DP) and steps. Model
chunks are anything callable as `chunk(x, labels, batch)` (a `BatchContext`) with
`pre_process`/`post_process` flags (`model.llama.LlamaChunk`): the first chunk of the model
takes token ids [b, s], the others a hidden state [s(/t), b, h]; the last returns per-token
losses [b, s].

Memory: once a chunk's output has been sent, its storage is released (Megatron's
"deallocate output" trick); the tensor object stays as the handle for backward, whose first
node never reads it. A stage then keeps one boundary tensor per in-flight micro-batch, on the
receiving side only, and the schedule bounds how many are in flight.

Zero-bubble schedules (schedule.py) add three things. B (`BackwardInput`) is a backward with
the chunk's `weight_grads` queue recording, so it yields the input gradient and leaves the
weight GEMMs queued; W (`BackwardWeight`) runs them and accumulates through autograd
(`torch.autograd.backward` on the parameters), so the optimizer's gradient hooks fire in W,
once per micro-batch and parameter. A weight that two chunks of this stage use (ZBV's tied
embedding and head) is summed over both chunks' W's of a micro-batch first. And transfers are
posted (`Post`) ahead of the compute that waits for them (`Wait`), batches finishing in
posting order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from megatron_lite.layers.context import BatchContext
from megatron_lite.layers.linear import WeightGradQueue
from megatron_lite.pipeline.p2p import PostedBatch, StageComm
from megatron_lite.pipeline.schedule import (
    Action,
    Backward,
    BackwardInput,
    BackwardWeight,
    Communicate,
    Forward,
    Post,
    Recv,
    ReduceGrads,
    Send,
    Wait,
)


class ModelChunk(Protocol):
    pre_process: bool
    post_process: bool
    weight_grads: WeightGradQueue | None
    """Read only by zero-bubble schedules (B and W steps); None otherwise."""

    def __call__(self, x: Tensor, labels: Tensor | None = None,
                 batch: BatchContext | None = None) -> Tensor:
        ...


Batch = Mapping[str, Tensor]
"""One micro-batch on the stage's device: "tokens" [b, s] (read by the first chunk of the
model), "labels" [b, s] (read by the last), the entries of its `BatchContext` (read by every
chunk: `BatchContext.of`), plus whatever `loss_fn` needs (e.g. "loss_mask")."""

LossFn = Callable[[Tensor, Batch], Tensor]
"""(per-token losses [b, s], batch) -> this micro-batch's contribution to the step loss."""


@dataclass
class _RunState:
    """Tensors of the micro-batches in flight on this stage, keyed by (micro-batch, chunk)."""

    inputs: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    output_grads: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    input_grads: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    losses: dict[int, Tensor] = field(default_factory=dict)
    posted: list[tuple[tuple[Send | Recv, ...], PostedBatch]] = field(default_factory=list)
    """Batches posted by `Post` and not yet waited for, in posting order."""
    weight_uses: Counter = field(default_factory=Counter)
    """id(parameter) -> chunks of this stage whose W steps yield its gradient."""
    shared_grads: dict[tuple[int, int], tuple[Tensor, int]] = field(default_factory=dict)
    """(id(parameter), micro-batch) -> (gradient summed so far, chunks summed)."""


def forward_backward(
    chunks: Sequence[ModelChunk],
    actions: Sequence[Action],
    microbatches: Sequence[Batch],
    comm: StageComm | None,
    loss_fn: LossFn,
    *,
    on_grads_ready: Callable[[int], None] | None = None,
    forward_only: bool = False,
) -> list[Tensor]:
    """Run one step of this stage's schedule; return per-micro-batch losses (last stage only).

    Each micro-batch's `loss_fn` value is backpropagated as is (so it should already carry
    its share of the step's normalisation) and gradients accumulate in the parameters'
    `.grad`. `on_grads_ready(chunk)` is called once per chunk, right after the chunk's last
    backward, the point where its data-parallel reduction may start. `comm` may be None for a
    single stage. Returned losses are detached, in micro-batch order, empty off the last stage.
    """
    state = _RunState()
    queues = [q for q in (getattr(chunk, "weight_grads", None) for chunk in chunks)
              if q is not None]
    state.weight_uses.update(pid for queue in queues for pid in queue.params)
    with torch.set_grad_enabled(not forward_only):
        for action in actions:
            if isinstance(action, Forward):
                _forward(action, chunks, microbatches, state, loss_fn, forward_only)
            elif isinstance(action, Backward):
                _backward(action, chunks[action.chunk], state)
            elif isinstance(action, BackwardInput):
                with _queue(chunks[action.chunk]).recording(action.microbatch):
                    _backward(action, chunks[action.chunk], state)
            elif isinstance(action, BackwardWeight):
                _backward_weight(action, chunks[action.chunk], state)
            elif isinstance(action, Communicate):
                _finish(action.ops, _post(action.ops, _need(comm), state).wait(), comm, state)
            elif isinstance(action, Post):
                state.posted.append((action.ops, _post(action.ops, _need(comm), state)))
            elif isinstance(action, Wait):
                _wait(action, comm, state)
            elif isinstance(action, ReduceGrads) and on_grads_ready is not None:
                on_grads_ready(action.chunk)
    if (state.inputs or state.outputs or state.output_grads or state.input_grads
            or state.posted or state.shared_grads or any(q.pending() for q in queues)):
        raise RuntimeError("pipeline schedule ended with micro-batches still in flight")
    return [state.losses[i] for i in sorted(state.losses)]


def _queue(chunk: ModelChunk) -> WeightGradQueue:
    if chunk.weight_grads is None:
        raise RuntimeError("a zero-bubble schedule (B/W steps) needs model chunks built with "
                           "LayerContext(split_backward=True)")
    return chunk.weight_grads


def _need(comm: StageComm | None) -> StageComm:
    if comm is None:
        raise RuntimeError("this schedule exchanges tensors between stages but no StageComm "
                           "was given (is --pipeline-model-parallel-size > 1?)")
    return comm


def _forward(op: Forward, chunks: Sequence[ModelChunk], microbatches: Sequence[Batch],
             state: _RunState, loss_fn: LossFn, forward_only: bool) -> None:
    chunk, mb = chunks[op.chunk], microbatches[op.microbatch]
    key = (op.microbatch, op.chunk)
    if chunk.pre_process:
        x = mb["tokens"]
    else:
        x = state.inputs.pop(key)
        if not forward_only:
            x.requires_grad_()
            state.inputs[key] = x
    batch = BatchContext.of(mb)
    if chunk.post_process:
        loss = loss_fn(chunk(x, mb["labels"], batch), mb)
        state.losses[op.microbatch] = loss.detach()
        if not forward_only:
            state.outputs[key] = loss
    else:
        state.outputs[key] = chunk(x, batch=batch)


def _backward(op: Backward | BackwardInput, chunk: ModelChunk, state: _RunState) -> None:
    key = (op.microbatch, op.chunk)
    output = state.outputs.pop(key)
    if chunk.post_process:
        torch.autograd.backward(output)
    else:
        torch.autograd.backward(output, grad_tensors=state.output_grads.pop(key))
    if not chunk.pre_process:
        state.input_grads[key] = state.inputs.pop(key).grad


def _backward_weight(op: BackwardWeight, chunk: ModelChunk, state: _RunState) -> None:
    """Accumulate the weight gradients B(mb, chunk) queued, one parameter at a time, through
    autograd, so that the optimizer's hooks fire and take each before the next exists."""
    for param, grad in _queue(chunk).pop(op.microbatch):
        uses = state.weight_uses[id(param)]
        if uses > 1:  # also used by another chunk of this stage: add up both chunks' W first
            key = (id(param), op.microbatch)
            total, seen = state.shared_grads.pop(key, (None, 0))
            grad = grad if total is None else total + grad
            if seen + 1 < uses:
                state.shared_grads[key] = (grad, seen + 1)
                continue
        torch.autograd.backward(param, grad)


def _post(ops: Sequence[Send | Recv], comm: StageComm, state: _RunState) -> PostedBatch:
    outgoing: dict[Send, Tensor] = {}
    for op in ops:
        if isinstance(op, Send):
            key = (op.microbatch, op.chunk)
            if op.tensor == "activation":
                outgoing[op] = state.outputs[key].detach()
            else:
                outgoing[op] = state.input_grads.pop(key)
    return comm.post(ops, outgoing)


def _wait(action: Wait, comm: StageComm | None, state: _RunState) -> None:
    """Wait for the posted batches up to the last one holding an op of `action`."""
    wanted = {id(op) for op in action.ops}
    last = max((i for i, (ops, _) in enumerate(state.posted)
                if any(id(op) in wanted for op in ops)), default=-1)
    done, state.posted = state.posted[:last + 1], state.posted[last + 1:]
    for ops, batch in done:
        _finish(ops, batch.wait(), comm, state)


def _finish(ops: Sequence[Send | Recv], received: Mapping[Recv, Tensor],
            comm: StageComm | None, state: _RunState) -> None:
    """File a completed batch's received tensors; free the storage of sent activations."""
    for op in ops:
        key = (op.microbatch, op.chunk)
        if isinstance(op, Recv):
            target = state.inputs if op.tensor == "activation" else state.output_grads
            target[key] = received[op]
        elif op.tensor == "activation":
            sent = state.outputs.get(key)
            if sent is None:  # forward-only: nothing keeps it
                continue
            if not _need(comm).is_local(op):  # a local hand-over shares the storage
                release_storage(sent)
            if not sent.requires_grad:
                state.outputs.pop(key)


def release_storage(tensor: Tensor) -> bool:
    """Free a sent output's memory but keep the tensor as backward's handle.

    Safe only when nothing will read the data again: the tensor owns its storage (not a
    view) and its own grad_fn did not save it (e.g. the residual add's backward saves
    nothing). Returns whether the memory was freed.
    """
    if tensor._base is not None or tensor.grad_fn is None:
        return False
    ptr = tensor.untyped_storage().data_ptr()
    for name in dir(tensor.grad_fn):
        saved = getattr(tensor.grad_fn, name) if name.startswith("_saved_") else None
        if isinstance(saved, Tensor) and saved.untyped_storage().data_ptr() == ptr:
            return False
    tensor.untyped_storage().resize_(0)
    return True
