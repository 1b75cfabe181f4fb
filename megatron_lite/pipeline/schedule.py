"""Pipeline schedules as data: each stage's ordered list of actions (pure Python).

A schedule is decided before any tensor exists, so it can be printed, diffed and checked
exhaustively by a simulator in the tests; `engine.py` only walks the list.

Without `kind` (--pipeline-schedule 1f1b / interleaved), `build_schedule` picks one of three
from (pp_size, num_chunks):
  * p = 1: no pipelining, gradient accumulation: F0 B0 F1 B1 ...
  * v = 1: 1F1B. Stage r runs p-r-1 warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards. At most p-r micro-batches are in flight.
  * v > 1: interleaved 1F1B over "virtual micro-batches" (micro-batch, chunk). Micro-batches
    are taken in groups of p; within a group, forwards run chunk 0 for the whole group, then
    chunk 1, ...; backwards visit the chunks in reverse. Warm-up is (p-r-1)*2 + (v-1)*p
    virtual micro-batches (Megatron's count), which covers the round trip through the other
    stages before chunk 1's first input and chunk v-1's first gradient arrive.
The zero-bubble schedules (kind zb-h1, zbv) split each backward into B (`BackwardInput`) and
W (`BackwardWeight`), in the order of a `zero_bubble.timeline`.

Communication: before a compute that needs a remote input the stage receives it, after a
compute whose result another stage needs it sends it. All transfers that fall between two
consecutive computes form one `Communicate` action, executed as one batched isend/irecv and
waited together, which is what keeps neighbours that send to each other at the same moment
from deadlocking. Transfers between the same two ranks are matched in posting order (NCCL
ignores tags), so every list is built so that both sides post them in the same order. The
zero-bubble lists `Post` batches ahead and `Wait` for one only before the compute reading
it (a W between a send and the next receive would otherwise hold up both neighbours); see
`_zero_bubble_schedule`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

from megatron_lite import layout, schedules
from megatron_lite.pipeline import zero_bubble
from megatron_lite.pipeline.partition import stage_and_chunk, virtual_stage

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
class BackwardInput:
    """B of a zero-bubble schedule: only the gradient w.r.t. the chunk's input (what the
    previous stage waits for); the chunk's weight-gradient GEMMs are queued for W."""

    microbatch: int
    chunk: int


@dataclass(frozen=True)
class BackwardWeight:
    """W of a zero-bubble schedule: run the weight-gradient GEMMs that B(mb, chunk) queued and
    accumulate them into the parameters' gradients (needed only by the optimizer)."""

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
class Post:
    """One batch of transfers posted without waiting (zero-bubble schedules).

    Batches complete in posting order, as on one NCCL stream; a compute waits (`Wait`) only
    for the batch holding its input, so a send never holds up the computes after it.
    """

    ops: tuple[Send | Recv, ...]


@dataclass(frozen=True)
class Wait:
    """Block until the batch holding each of `ops`, and every batch posted before it, is done."""

    ops: tuple[Send | Recv, ...]


@dataclass(frozen=True)
class ReduceGrads:
    """All backwards of `chunk` are done: its data-parallel gradient reduction may start."""

    chunk: int


Compute = Forward | Backward | BackwardInput | BackwardWeight
Action = Compute | Communicate | Post | Wait | ReduceGrads


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


def _neighbours(pp_size: int, stage: int, chunk: int, num_chunks: int, v_shape: bool = False
                ) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(stage, chunk) before and after this one in the model, or None at either end."""
    virtual = virtual_stage(pp_size, stage, chunk, v_shape)
    last = pp_size * num_chunks - 1
    prev = None if virtual == 0 else stage_and_chunk(pp_size, virtual - 1, v_shape)
    nxt = None if virtual == last else stage_and_chunk(pp_size, virtual + 1, v_shape)
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


def schedule_chunks(kind: str, num_chunks: int) -> int:
    """Chunks per stage the schedule `kind` runs: the zero-bubble ones their table's count
    (ZB-H1 one, ZBV two); 1f1b and interleaved build whatever `num_chunks` picks."""
    sched = schedules.get(kind, num_chunks)
    return sched.stage_chunks(num_chunks) if sched.split_backward else num_chunks


def stage_schedule(pp_size: int, pp_rank: int, num_microbatches: int, num_chunks: int = 1,
                   forward_only: bool = False, kind: str | None = None,
                   costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> list[Action]:
    """Full action list of one stage: computes, batched transfers and grad-reduction points.

    `kind` None (or 1f1b / interleaved) picks by `num_chunks`; zb-h1 and zbv build every
    stage's list from one timeline (timed by `costs`, see `build_schedule`) and return this
    stage's.
    """
    if kind in schedules.ZERO_BUBBLE:
        return build_schedule(pp_size, num_microbatches, num_chunks, forward_only, kind,
                              costs)[pp_rank]
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


def _zero_bubble_schedule(kind: str, pp_size: int, num_microbatches: int, forward_only: bool,
                          costs: tuple[float, float, float]) -> list[list[Action]]:
    """Every stage's actions from the `zero_bubble.timeline` of `kind`.

    Each transfer is keyed by the time its producer finishes in the timeline, and every
    stage posts its transfers in key order: a send right after its producer, a receive as
    soon as every transfer keyed before it has been posted (so it is usually waiting when
    the data is sent). Both ends of every channel then post in the same order and the
    stages' posting orders agree with one clock, which is what rules out a deadlock; a
    compute waits only for its own input. A transfer to the same stage (the V's turn on the
    last stage) is a local hand-over, posted send first. W's send nothing; a chunk's
    gradients are ready after its last W, and under ZBV chunk 0 (holding the embedding that
    chunk 1's head is tied to) after both chunks' last W.
    """
    slots = zero_bubble.timeline(kind, pp_size, num_microbatches, forward_only, costs)
    sched = schedules.get(kind)
    v_shape, num_chunks = sched.v_shape, sched.stage_chunks(1)
    index = [{(s.kind, s.microbatch, s.chunk): i for i, s in enumerate(stage_slots)}
             for stage_slots in slots]
    # per stage: (key, is_recv, index of the compute it follows or feeds, op)
    streams: list[list[tuple[tuple, bool, int, Send | Recv]]] = [[] for _ in range(pp_size)]
    for stage, stage_slots in enumerate(slots):
        for i, slot in enumerate(stage_slots):
            prev, nxt = _neighbours(pp_size, stage, slot.chunk, num_chunks, v_shape)
            target = {"F": nxt, "B": prev}.get(slot.kind)
            if target is None:
                continue
            tensor: TensorKind = "activation" if slot.kind == "F" else "grad"
            key = (slot.end, tensor != "activation", slot.microbatch)
            consumer = index[target[0]][(slot.kind, slot.microbatch, target[1])]
            streams[stage].append((key, False, i, Send(tensor, slot.microbatch, slot.chunk,
                                                       target[0])))
            streams[target[0]].append((key, True, consumer,
                                       Recv(tensor, slot.microbatch, target[1], stage)))
    return [_stage_actions(stage_slots, streams[stage], v_shape)
            for stage, stage_slots in enumerate(slots)]


def _stage_actions(slots: list[zero_bubble.Slot],
                   stream: list[tuple[tuple, bool, int, Send | Recv]],
                   v_shape: bool) -> list[Action]:
    """One stage's computes with its posts (grouped by position and key) and waits."""
    computes: list[Compute] = [
        {"F": Forward, "B": BackwardInput, "W": BackwardWeight}[s.kind](s.microbatch, s.chunk)
        for s in slots]
    # position (index of the compute it precedes) -> time -> ops, one batch per time
    posts: dict[int, dict[float, list[Send | Recv]]] = defaultdict(lambda: defaultdict(list))
    needs: dict[int, list[Recv]] = defaultdict(list)
    position = 0
    for key, is_recv, compute, op in sorted(stream, key=lambda item: item[:2]):
        if is_recv:
            needs[compute].append(op)
        else:
            position = max(position, compute + 1)
        posts[position][key[0]].append(op)
    last_weight = {op.chunk: i for i, op in enumerate(computes)
                   if isinstance(op, BackwardWeight)}
    if v_shape and len(last_weight) == 2:
        last_weight[0] = max(last_weight.values())
    actions: list[Action] = []
    for i in range(len(computes) + 1):
        actions += [Post(tuple(ops)) for _, ops in sorted(posts[i].items())]
        if i == len(computes):
            break
        if needs[i]:
            actions.append(Wait(tuple(needs[i])))
        actions.append(computes[i])
        actions += [ReduceGrads(c) for c in sorted(last_weight) if last_weight[c] == i]
    if stream:
        actions.append(Wait(tuple(op for _, _, _, op in stream)))
    return actions


def build_schedule(pp_size: int, num_microbatches: int, num_chunks: int = 1,
                   forward_only: bool = False, kind: str | None = None,
                   costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> list[list[Action]]:
    """Action lists for every stage; validates the schedule's own preconditions.

    `costs` (F, B, W of a whole stage) time the zero-bubble timeline: unit costs by default;
    the measured ones place each stage's W's where that machine's bubbles are.
    """
    sched = schedules.get(kind, num_chunks)
    errors = layout.build_errors(sched, pp_size, num_microbatches, num_chunks)
    if errors:
        raise ValueError(errors[0])
    if sched.split_backward:
        return _zero_bubble_schedule(kind, pp_size, num_microbatches, forward_only, costs)
    return [stage_schedule(pp_size, rank, num_microbatches, num_chunks, forward_only)
            for rank in range(pp_size)]
