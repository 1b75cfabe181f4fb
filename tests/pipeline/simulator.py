"""Plays every stage's action list against the others, in one process, with timing.

Semantics are the strict ones of NCCL point-to-point: a transfer completes only when its
counterpart has been posted on the peer (sends do not buffer), transfers between two ranks are
matched in posting order (tags are ignored), and a `Communicate` batch finishes when all its
transfers have. Each compute takes a fixed time; communication is instantaneous, so the
makespan shows the schedule's bubble alone.

Any violation raises `ScheduleError`: a deadlock (with each stage's blocking action), a
mismatched transfer, a compute whose input or gradient has not arrived, a repeated or missing
forward/backward, a gradient reduction before the chunk's last backward.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from megatron_lite.pipeline.schedule import (
    Action,
    Backward,
    Communicate,
    Forward,
    Recv,
    ReduceGrads,
    Send,
)


class ScheduleError(AssertionError):
    pass


@dataclass
class StageState:
    pc: int = 0
    clock: float = 0.0
    busy: float = 0.0
    posted: bool = False
    post_time: float = 0.0
    done_forward: set = field(default_factory=set)
    done_backward: set = field(default_factory=set)
    received: set = field(default_factory=set)
    in_flight: int = 0
    peak_in_flight: int = 0
    reduced: list = field(default_factory=list)


@dataclass
class Result:
    makespan: float
    busy: list[float]
    peak_in_flight: list[int]
    reduced: list[list[int]]


def _virtual(op: Send | Recv | Forward | Backward, stage: int, pp: int) -> int:
    return op.chunk * pp + stage


def _key(op: Send | Recv, stage: int, pp: int) -> tuple[str, int, int]:
    """What travels: (tensor, micro-batch, virtual stage that consumes it)."""
    if isinstance(op, Recv):
        return op.tensor, op.microbatch, _virtual(op, stage, pp)
    step = 1 if op.tensor == "activation" else -1
    return op.tensor, op.microbatch, _virtual(op, stage, pp) + step


def simulate(schedule: list[list[Action]], num_microbatches: int, num_chunks: int,
             forward_time: float = 1.0, backward_time: float = 2.0,
             forward_only: bool = False) -> Result:
    pp = len(schedule)
    last_virtual = pp * num_chunks - 1
    states = [StageState() for _ in range(pp)]
    sends: dict[tuple[int, int], deque] = defaultdict(deque)  # (src, dst) -> [(key, time)]
    recvs: dict[tuple[int, int], deque] = defaultdict(deque)  # (src, dst) -> [(key, time)]
    matched: dict[tuple[int, int], float] = {}  # (stage, id(op)) -> completion time

    def match_channels() -> None:
        for chan in list(sends):
            while sends[chan] and recvs[chan]:
                (skey, sop, st), (rkey, rop, rt) = sends[chan].popleft(), recvs[chan].popleft()
                if skey != rkey:
                    raise ScheduleError(f"channel {chan}: send {skey} met recv {rkey}")
                matched[(chan[0], id(sop))] = matched[(chan[1], id(rop))] = max(st, rt)

    def step(stage: int) -> bool:
        s, action = states[stage], schedule[stage][states[stage].pc]
        if isinstance(action, Communicate):
            if not s.posted:
                s.posted, s.post_time = True, s.clock
                for op in action.ops:
                    _check_ready(op, s, stage, pp)
                    chan = (stage, op.peer) if isinstance(op, Send) else (op.peer, stage)
                    queue = sends if isinstance(op, Send) else recvs
                    queue[chan].append((_key(op, stage, pp), op, s.clock))
                match_channels()
            if not all((stage, id(op)) in matched for op in action.ops):
                return False
            s.clock = max([s.clock] + [matched.pop((stage, id(op))) for op in action.ops])
            s.received |= {(op.tensor, op.microbatch, op.chunk)
                           for op in action.ops if isinstance(op, Recv)}
            s.posted = False
        elif isinstance(action, Forward | Backward):
            _run_compute(action, s, stage, pp, last_virtual)
            cost = forward_time if isinstance(action, Forward) else backward_time
            s.clock += cost / num_chunks
            s.busy += cost / num_chunks
        elif isinstance(action, ReduceGrads):
            expected = {(mb, action.chunk) for mb in range(num_microbatches)}
            if not expected <= s.done_backward:
                raise ScheduleError(f"stage {stage}: {action} before all its backwards")
            s.reduced.append(action.chunk)
        s.pc += 1
        return True

    while True:
        progressed = False
        for stage in range(pp):
            while states[stage].pc < len(schedule[stage]) and step(stage):
                progressed = True
        if all(s.pc == len(schedule[i]) for i, s in enumerate(states)):
            break
        if not progressed:
            blocked = {i: schedule[i][s.pc] for i, s in enumerate(states)
                       if s.pc < len(schedule[i])}
            raise ScheduleError(f"deadlock; stages blocked at {blocked}")
    everything = {(mb, c) for mb in range(num_microbatches) for c in range(num_chunks)}
    for i, s in enumerate(states):
        if s.done_forward != everything or s.done_backward != (set() if forward_only
                                                                else everything):
            raise ScheduleError(f"stage {i}: not every (micro-batch, chunk) ran F and B once")
        if sorted(s.reduced) != ([] if forward_only else list(range(num_chunks))):
            raise ScheduleError(f"stage {i}: grads reduced for chunks {s.reduced}")
    return Result(max(s.clock for s in states), [s.busy for s in states],
                  [s.peak_in_flight for s in states], [s.reduced for s in states])


def _check_ready(op: Send | Recv, s: StageState, stage: int, pp: int) -> None:
    if isinstance(op, Send):
        source = s.done_forward if op.tensor == "activation" else s.done_backward
        if (op.microbatch, op.chunk) not in source:
            raise ScheduleError(f"stage {stage}: {op} before the compute that produces it")


def _run_compute(op: Forward | Backward, s: StageState, stage: int, pp: int,
                 last_virtual: int) -> None:
    key = (op.microbatch, op.chunk)
    virtual = _virtual(op, stage, pp)
    if isinstance(op, Forward):
        if key in s.done_forward:
            raise ScheduleError(f"stage {stage}: {op} ran twice")
        if virtual > 0 and ("activation", *key) not in s.received:
            raise ScheduleError(f"stage {stage}: {op} before its input arrived")
        s.done_forward.add(key)
        s.in_flight += 1
        s.peak_in_flight = max(s.peak_in_flight, s.in_flight)
    else:
        if key in s.done_backward or key not in s.done_forward:
            raise ScheduleError(f"stage {stage}: {op} repeated or before its forward")
        if virtual < last_virtual and ("grad", *key) not in s.received:
            raise ScheduleError(f"stage {stage}: {op} before its output grad arrived")
        s.done_backward.add(key)
        s.in_flight -= 1
