"""Pipeline schedules as data: each stage's ordered list of actions (pure Python).

A schedule is decided before any tensor exists, so it can be printed, diffed and checked
exhaustively by a simulator in the tests; `engine.py` only walks the list.

Three schedules, chosen by `build_schedule` from (pp_size, num_chunks):
  * p = 1: no pipelining, gradient accumulation: F0 B0 F1 B1 ...
  * v = 1: 1F1B. Stage r runs p-r-1 warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards. At most p-r micro-batches are in flight.
  * v > 1: interleaved 1F1B over "virtual micro-batches" (micro-batch, chunk). Micro-batches
    are taken in groups of p; within a group, forwards run chunk 0 for the whole group, then
    chunk 1, ...; backwards visit the chunks in reverse. Warm-up is (p-r-1)*2 + (v-1)*p
    virtual micro-batches (Megatron's count), which covers the round trip through the other
    stages before chunk 1's first input and chunk v-1's first gradient arrive.

Communication: before a compute that needs a remote input the stage receives it, after a
compute whose result another stage needs it sends it. All transfers that fall between two
consecutive computes form one `Communicate` action, executed as one batched isend/irecv and
waited together, which is what keeps neighbours that send to each other at the same moment
from deadlocking. Transfers between the same two ranks are matched in posting order (NCCL
ignores tags), so every list is built so that both sides post them in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TensorKind = Literal["activation", "grad"]
"""What a transfer carries: a forward activation or a backward gradient."""


@dataclass(frozen=True)
class Forward:
    """Run chunk `chunk` forward on micro-batch `microbatch`."""

    microbatch: int
    chunk: int


@dataclass(frozen=True)
class Backward:
    """Backpropagate micro-batch `microbatch` through chunk `chunk`."""

    microbatch: int
    chunk: int


@dataclass(frozen=True)
class Send:
    """Send the activation produced by F(mb, chunk), or the input grad from B(mb, chunk)."""

    tensor: TensorKind
    microbatch: int
    chunk: int
    peer: int


@dataclass(frozen=True)
class Recv:
    """Receive the input of F(mb, chunk) (activation) or the output grad of B(mb, chunk)."""

    tensor: TensorKind
    microbatch: int
    chunk: int
    peer: int


@dataclass(frozen=True)
class Communicate:
    """One batch of transfers, posted together and all waited before the next action."""

    ops: tuple[Send | Recv, ...]


@dataclass(frozen=True)
class ReduceGrads:
    """All backwards of `chunk` are done: its data-parallel gradient reduction may start."""

    chunk: int


Compute = Forward | Backward
Action = Forward | Backward | Communicate | ReduceGrads


def compute_order(pp_size: int, pp_rank: int, num_microbatches: int,
                  num_chunks: int = 1) -> list[Compute]:
    """The order in which stage `pp_rank` runs its forwards and backwards."""
    return [op for step in compute_steps(pp_size, pp_rank, num_microbatches, num_chunks)
            for op in step]


def compute_steps(pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int = 1,
                  forward_only: bool = False) -> list[tuple[Compute, ...]]:
    """Computes grouped into steps; communication happens only between steps.

    Plain 1F1B exchanges after every compute. The interleaved schedule runs each steady-state
    forward and backward back to back as one step and exchanges once after the pair, posting
    the receives for the whole next step up front (Megatron's structure): every stage then
    meets its neighbours in the same batch, which per-compute exchanges cannot guarantee
    once chunks wrap around from the last stage to the first. `forward_only` (evaluation)
    keeps just the forwards, in the same order.
    """
    table = _virtual_microbatch_table(pp_size, num_microbatches, num_chunks)
    forwards = [Forward(mb, chunk) for mb, chunk in table]
    if forward_only:
        return [(op,) for op in forwards]
    if pp_size == 1 and num_chunks == 1:
        return [(op,) for mb in range(num_microbatches) for op in (Forward(mb, 0), Backward(mb, 0))]
    backwards = [Backward(mb, num_chunks - 1 - chunk) for mb, chunk in table]
    total = len(table)
    if num_chunks == 1:
        warmup = pp_size - pp_rank - 1
    else:
        warmup = (pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * pp_size
    warmup = min(warmup, total)
    steady = [(forwards[warmup + k], backwards[k]) for k in range(total - warmup)]
    if num_chunks == 1:
        steady = [(op,) for pair in steady for op in pair]
    return ([(op,) for op in forwards[:warmup]] + steady
            + [(op,) for op in backwards[total - warmup:]])


def _virtual_microbatch_table(pp_size: int, num_microbatches: int,
                              num_chunks: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) in forward order: groups of p micro-batches, chunk-major inside."""
    table = []
    for start in range(0, num_microbatches, pp_size):
        group = range(start, min(start + pp_size, num_microbatches))
        table += [(mb, chunk) for chunk in range(num_chunks) for mb in group]
    return table


def _neighbours(pp_size: int, stage: int, chunk: int, num_chunks: int
                ) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(stage, chunk) before and after this one in the model, or None at either end."""
    virtual = chunk * pp_size + stage
    last = pp_size * num_chunks - 1
    prev = None if virtual == 0 else ((virtual - 1) % pp_size, (virtual - 1) // pp_size)
    nxt = None if virtual == last else ((virtual + 1) % pp_size, (virtual + 1) // pp_size)
    return prev, nxt


def _transfers(op: Compute, pp_size: int, stage: int, num_chunks: int
               ) -> tuple[list[Recv], list[Send]]:
    """What `op` must receive before it runs and send after it."""
    prev, nxt = _neighbours(pp_size, stage, op.chunk, num_chunks)
    mb, chunk = op.microbatch, op.chunk
    if isinstance(op, Forward):
        recvs = [Recv("activation", mb, chunk, prev[0])] if prev else []
        sends = [Send("activation", mb, chunk, nxt[0])] if nxt else []
    else:
        recvs = [Recv("grad", mb, chunk, nxt[0])] if nxt else []
        sends = [Send("grad", mb, chunk, prev[0])] if prev else []
    return recvs, sends


def stage_schedule(pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int = 1,
                   forward_only: bool = False) -> list[Action]:
    """Full action list of one stage: computes, batched transfers and grad-reduction points."""
    steps = compute_steps(pp_size, pp_rank, num_microbatches, num_chunks, forward_only)
    last_backward = {op.chunk: i for i, step in enumerate(steps) for op in step
                     if isinstance(op, Backward)}
    actions: list[Action] = []
    pending: list[Send | Recv] = []
    reduce: list[ReduceGrads] = []
    for i, step in enumerate(steps):
        for op in step:
            pending += _transfers(op, pp_size, pp_rank, num_chunks)[0]
        if pending:
            actions.append(Communicate(_posting_order(pending)))
        # Reduce only after the finished chunk's grad has been sent upstream: a blocking
        # DP all-reduce must not delay the previous stage.
        actions += reduce
        actions += step
        pending = [send for op in step for send in _transfers(op, pp_size, pp_rank, num_chunks)[1]]
        reduce = [ReduceGrads(op.chunk) for op in step
                  if isinstance(op, Backward) and last_backward[op.chunk] == i]
    if pending:
        actions.append(Communicate(_posting_order(pending)))
    return actions + reduce


def _posting_order(ops: list[Send | Recv]) -> tuple[Send | Recv, ...]:
    """Activations before grads, so two ranks exchanging both post them in the same order."""
    return tuple(sorted(ops, key=lambda op: op.tensor != "activation"))


def build_schedule(pp_size: int, num_microbatches: int, num_chunks: int = 1,
                   forward_only: bool = False) -> list[list[Action]]:
    """Action lists for every stage; validates the schedule's own preconditions."""
    if num_microbatches < 1:
        raise ValueError(f"need at least one micro-batch, got {num_microbatches}")
    if num_chunks > 1 and pp_size == 1:
        raise ValueError("virtual chunks need more than one pipeline stage")
    return [stage_schedule(pp_size, rank, num_microbatches, num_chunks, forward_only)
            for rank in range(pp_size)]
