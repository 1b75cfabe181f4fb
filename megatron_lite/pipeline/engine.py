"""Runs one stage's schedule: forwards, backwards and transfers, in the listed order.

The training loop calls `forward_backward` once per optimizer step on every rank, with the
rank's own action list from `schedule.build_schedule` and its model chunks, then finalizes
gradients (SP norms over TP, tied embeddings over the embedding group, DP) and steps. Model
chunks are anything callable as `chunk(x, labels)` with `pre_process`/`post_process` flags
(`model.llama.LlamaChunk`): the first chunk of the model takes token ids [b, s], the others a
hidden state [s(/t), b, h]; the last returns per-token losses [b, s].

Memory: once a chunk's output has been sent, its storage is released (Megatron's
"deallocate output" trick); the tensor object stays as the handle for backward, whose first
node never reads it. A stage then keeps one boundary tensor per in-flight micro-batch, on the
receiving side only, and the schedule bounds how many are in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from megatron_lite.pipeline.p2p import StageComm
from megatron_lite.pipeline.schedule import (
    Action,
    Backward,
    Communicate,
    Forward,
    Recv,
    ReduceGrads,
    Send,
)


class ModelChunk(Protocol):
    pre_process: bool
    post_process: bool

    def __call__(self, x: Tensor, labels: Tensor | None = None) -> Tensor: ...


Batch = Mapping[str, Tensor]
"""One micro-batch on the stage's device: "tokens" [b, s] (read by the first chunk of the
model), "labels" [b, s] (read by the last), plus whatever `loss_fn` needs (e.g. "loss_mask")."""

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
    with torch.set_grad_enabled(not forward_only):
        for action in actions:
            if isinstance(action, Forward):
                _forward(action, chunks, microbatches, state, loss_fn, forward_only)
            elif isinstance(action, Backward):
                _backward(action, chunks[action.chunk], state)
            elif isinstance(action, Communicate):
                _communicate(action, comm, state)
            elif isinstance(action, ReduceGrads) and on_grads_ready is not None:
                on_grads_ready(action.chunk)
    if state.inputs or state.outputs or state.output_grads or state.input_grads:
        raise RuntimeError("pipeline schedule ended with micro-batches still in flight")
    return [state.losses[i] for i in sorted(state.losses)]


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
    if chunk.post_process:
        loss = loss_fn(chunk(x, mb["labels"]), mb)
        state.losses[op.microbatch] = loss.detach()
        if not forward_only:
            state.outputs[key] = loss
    else:
        state.outputs[key] = chunk(x)


def _backward(op: Backward, chunk: ModelChunk, state: _RunState) -> None:
    key = (op.microbatch, op.chunk)
    output = state.outputs.pop(key)
    if chunk.post_process:
        torch.autograd.backward(output)
    else:
        torch.autograd.backward(output, grad_tensors=state.output_grads.pop(key))
    if not chunk.pre_process:
        state.input_grads[key] = state.inputs.pop(key).grad


def _communicate(action: Communicate, comm: StageComm | None, state: _RunState) -> None:
    if comm is None:
        raise RuntimeError("this schedule exchanges tensors between stages but no StageComm "
                           "was given (is --pipeline-model-parallel-size > 1?)")
    outgoing: dict[Send, Tensor] = {}
    for op in action.ops:
        if isinstance(op, Send):
            key = (op.microbatch, op.chunk)
            if op.tensor == "activation":
                outgoing[op] = state.outputs[key].detach()
            else:
                outgoing[op] = state.input_grads.pop(key)
    received = comm.exchange(action.ops, outgoing)
    for op in action.ops:
        key = (op.microbatch, op.chunk)
        if isinstance(op, Recv):
            target = state.inputs if op.tensor == "activation" else state.output_grads
            target[key] = received[op]
        elif op.tensor == "activation":
            sent = state.outputs.get(key)
            if sent is None:  # forward-only: nothing keeps it
                continue
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
