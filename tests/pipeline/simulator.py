"""Plays every stage's action list against the others, in one process, with timing.

Semantics are the strict ones of NCCL point-to-point: a transfer completes only when its
counterpart has been posted on the peer (sends do not buffer), transfers between two ranks are
matched in posting order (tags are ignored), a batch finishes when all its transfers have, and
a stage's batches finish in posting order (one stream): a transfer can start only once every
batch posted before its own, on both ends, has finished. `Communicate` posts a batch and waits
for it; `Post` only posts, and `Wait` blocks until the batches holding its transfers are done.

Each compute takes a fixed time; communication is instantaneous, so the makespan shows the
schedule's bubble alone. A full backward costs `backward_time`; split into B and W
(zero-bubble schedules) it costs `backward_time - weight_time` and `weight_time`. A
micro-batch's activations count as in flight from its F to its W (or full backward).

Any violation raises `ScheduleError`: a deadlock (with each stage's blocking action), a
mismatched transfer, a compute whose input or gradient has not arrived (or was not waited
for), a repeated or missing forward/backward/weight pass, a gradient reduction before the
chunk's last backward or W, a stage that ends with a transfer still pending.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from megatron_lite.pipeline.partition import virtual_stage
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
from megatron_lite.pipeline.zero_bubble import Slot


class ScheduleError(AssertionError):
    pass


@dataclass
class _Batch:
    ops: tuple[Send | Recv, ...]
    posted: float
    partners: dict[int, tuple[int, int]] = field(default_factory=dict)
    """id(op) -> (stage, batch index) of the matching op on the other end."""
    done: float | None = None


@dataclass
class StageState:
    pc: int = 0
    clock: float = 0.0
    busy: float = 0.0
    batches: list[_Batch] = field(default_factory=list)
    waited: int = 0
    """Batches [0, waited) have been waited for."""
    batch_of: dict[int, int] = field(default_factory=dict)
    """id(op) -> index of the batch that posted it."""
    posted_pc: int = -1
    """pc of a `Communicate` whose batch is posted but not yet waited."""
    done_forward: set = field(default_factory=set)
    done_backward: set = field(default_factory=set)
    done_weight: set = field(default_factory=set)
    received: set = field(default_factory=set)
    in_flight: int = 0
    peak_in_flight: int = 0
    reduced: list = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)
    """Every compute with its start and end, in order (what a timeline picture draws)."""


@dataclass
class Result:
    makespan: float
    busy: list[float]
    peak_in_flight: list[int]
    """Chunk activations alive at once per stage (divide by the chunks per stage to compare
    schedules in whole-stage micro-batches)."""
    reduced: list[list[int]]
    slots: list[list[Slot]]
    """Per stage, its computes as played: kind F, B (a full backward, or the input gradient
    where W is split off) or W, with start and end times."""

    @property
    def bubble(self) -> float:
        """Idle fraction of the step, averaged over stages: 1 - mean busy / makespan."""
        return 1.0 - sum(self.busy) / len(self.busy) / self.makespan


def _key(op: Send | Recv, stage: int, pp: int, v_shape: bool) -> tuple[str, int, int]:
    """What travels: (tensor, micro-batch, virtual stage that consumes it)."""
    virtual = virtual_stage(pp, stage, op.chunk, v_shape)
    if isinstance(op, Recv):
        return op.tensor, op.microbatch, virtual
    step = 1 if op.tensor == "activation" else -1
    return op.tensor, op.microbatch, virtual + step


class _Fabric:
    """Posted batches of every stage, matched channel by channel, with completion times."""

    def __init__(self, states: list[StageState], pp: int, v_shape: bool) -> None:
        self.states, self.pp, self.v_shape = states, pp, v_shape
        self.sends: dict[tuple[int, int], deque] = defaultdict(deque)  # (src, dst) -> ops
        self.recvs: dict[tuple[int, int], deque] = defaultdict(deque)
        self.posted = 0
        """Batches posted so far (a post is progress even when its stage then blocks)."""

    def post(self, stage: int, ops: tuple[Send | Recv, ...]) -> None:
        s = self.states[stage]
        for op in ops:
            _check_ready(op, s, stage)
            s.batch_of[id(op)] = len(s.batches)
            chan = (stage, op.peer) if isinstance(op, Send) else (op.peer, stage)
            queue = self.sends if isinstance(op, Send) else self.recvs
            queue[chan].append((_key(op, stage, self.pp, self.v_shape), stage, op))
        s.batches.append(_Batch(ops, s.clock))
        self.posted += 1
        for chan in list(self.sends):
            while self.sends[chan] and self.recvs[chan]:
                (skey, sst, sop), (rkey, rst, rop) = (self.sends[chan].popleft(),
                                                      self.recvs[chan].popleft())
                if skey != rkey:
                    raise ScheduleError(f"channel {chan}: send {skey} met recv {rkey}")
                sbatch = self.states[sst].batch_of[id(sop)]
                rbatch = self.states[rst].batch_of[id(rop)]
                self.states[sst].batches[sbatch].partners[id(sop)] = (rst, rbatch)
                self.states[rst].batches[rbatch].partners[id(rop)] = (sst, sbatch)

    def started(self, stage: int, index: int) -> float | None:
        """When batch `index` may progress: posted, and every earlier batch done."""
        batch = self.states[stage].batches[index]
        if index == 0:
            return batch.posted
        before = self.done(stage, index - 1)
        return None if before is None else max(batch.posted, before)

    def done(self, stage: int, index: int) -> float | None:
        """Completion time of a stage's batch, or None while some transfer is unmatched."""
        batch = self.states[stage].batches[index]
        if batch.done is not None:
            return batch.done
        start = self.started(stage, index)
        if start is None or len(batch.partners) < len(batch.ops):
            return None
        times = [start]
        for peer, peer_index in batch.partners.values():
            if (peer, peer_index) != (stage, index):
                other = self.started(peer, peer_index)
                if other is None:
                    return None
                times.append(other)
        batch.done = max(times)
        return batch.done


def simulate(schedule: list[list[Action]], num_microbatches: int, num_chunks: int,
             forward_time: float = 1.0, backward_time: float = 2.0,
             forward_only: bool = False, weight_time: float | None = None,
             v_shape: bool = False) -> Result:
    pp = len(schedule)
    last_virtual = pp * num_chunks - 1
    weight_time = backward_time / 2 if weight_time is None else weight_time
    costs = {Forward: forward_time, Backward: backward_time,
             BackwardInput: backward_time - weight_time, BackwardWeight: weight_time}
    split = any(isinstance(a, BackwardInput) for actions in schedule for a in actions)
    states = [StageState() for _ in range(pp)]
    fabric = _Fabric(states, pp, v_shape)

    def wait_for(stage: int, ops: tuple[Send | Recv, ...]) -> bool:
        s = states[stage]
        last = max(s.batch_of[id(op)] for op in ops)
        finished = fabric.done(stage, last)
        if finished is None:
            return False
        s.clock = max(s.clock, finished)
        for batch in s.batches[s.waited:last + 1]:
            s.received |= {(op.tensor, op.microbatch, op.chunk)
                           for op in batch.ops if isinstance(op, Recv)}
        s.waited = max(s.waited, last + 1)
        return True

    def step(stage: int) -> bool:
        s, action = states[stage], schedule[stage][states[stage].pc]
        if isinstance(action, Communicate):
            if s.posted_pc != s.pc:
                fabric.post(stage, action.ops)
                s.posted_pc = s.pc
            if not wait_for(stage, action.ops):
                return False
        elif isinstance(action, Post):
            fabric.post(stage, action.ops)
        elif isinstance(action, Wait):
            if not wait_for(stage, action.ops):
                return False
        elif isinstance(action, Forward | Backward | BackwardInput | BackwardWeight):
            _run_compute(action, s, virtual_stage(pp, stage, action.chunk, v_shape), stage,
                         last_virtual)
            cost = costs[type(action)] / num_chunks
            kind = "F" if isinstance(action, Forward) else \
                "W" if isinstance(action, BackwardWeight) else "B"
            s.slots.append(Slot(kind, action.microbatch, action.chunk, s.clock, s.clock + cost))
            s.clock += cost
            s.busy += cost
        elif isinstance(action, ReduceGrads):
            expected = {(mb, action.chunk) for mb in range(num_microbatches)}
            if not expected <= (s.done_weight if split else s.done_backward):
                raise ScheduleError(f"stage {stage}: {action} before all its backwards")
            s.reduced.append(action.chunk)
        s.pc += 1
        return True

    while True:
        progressed, posted = False, fabric.posted
        for stage in range(pp):
            while states[stage].pc < len(schedule[stage]) and step(stage):
                progressed = True
        if all(s.pc == len(schedule[i]) for i, s in enumerate(states)):
            break
        if not progressed and posted == fabric.posted:
            blocked = {i: schedule[i][s.pc] for i, s in enumerate(states)
                       if s.pc < len(schedule[i])}
            raise ScheduleError(f"deadlock; stages blocked at {blocked}")
    everything = {(mb, c) for mb in range(num_microbatches) for c in range(num_chunks)}
    for i, s in enumerate(states):
        if s.done_forward != everything or s.done_backward != (set() if forward_only
                                                                else everything):
            raise ScheduleError(f"stage {i}: not every (micro-batch, chunk) ran F and B once")
        if s.done_weight != (everything if split else set()):
            raise ScheduleError(f"stage {i}: not every (micro-batch, chunk) ran W once")
        if sorted(s.reduced) != ([] if forward_only else list(range(num_chunks))):
            raise ScheduleError(f"stage {i}: grads reduced for chunks {s.reduced}")
        if s.waited != len(s.batches):
            raise ScheduleError(f"stage {i}: ends with {len(s.batches) - s.waited} transfer "
                                "batches not waited for")
    return Result(max(s.clock for s in states), [s.busy for s in states],
                  [s.peak_in_flight for s in states], [s.reduced for s in states],
                  [s.slots for s in states])


def _check_ready(op: Send | Recv, s: StageState, stage: int) -> None:
    if isinstance(op, Send):
        source = s.done_forward if op.tensor == "activation" else s.done_backward
        if (op.microbatch, op.chunk) not in source:
            raise ScheduleError(f"stage {stage}: {op} before the compute that produces it")


def _run_compute(op: Forward | Backward | BackwardInput | BackwardWeight, s: StageState,
                 virtual: int, stage: int, last_virtual: int) -> None:
    key = (op.microbatch, op.chunk)
    if isinstance(op, Forward):
        if key in s.done_forward:
            raise ScheduleError(f"stage {stage}: {op} ran twice")
        if virtual > 0 and ("activation", *key) not in s.received:
            raise ScheduleError(f"stage {stage}: {op} before its input arrived")
        s.done_forward.add(key)
        s.in_flight += 1
        s.peak_in_flight = max(s.peak_in_flight, s.in_flight)
    elif isinstance(op, BackwardWeight):
        if key in s.done_weight or key not in s.done_backward:
            raise ScheduleError(f"stage {stage}: {op} repeated or before its B")
        s.done_weight.add(key)
        s.in_flight -= 1
    else:
        if key in s.done_backward or key not in s.done_forward:
            raise ScheduleError(f"stage {stage}: {op} repeated or before its forward")
        if virtual < last_virtual and ("grad", *key) not in s.received:
            raise ScheduleError(f"stage {stage}: {op} before its output grad arrived")
        s.done_backward.add(key)
        s.in_flight -= isinstance(op, Backward)
