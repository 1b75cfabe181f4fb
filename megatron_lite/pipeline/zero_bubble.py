"""When each F, B and W of a zero-bubble schedule runs (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024), found by playing the pipeline forward in time (pure Python).

Splitting a backward into B (gradient w.r.t. the stage's input, which the previous stage waits
for) and W (gradient w.r.t. the weights, which only the optimizer waits for) lets a stage fill
the time it would spend waiting for a gradient with W's of earlier micro-batches.

Both schedules are list schedules: time advances, and each idle stage starts the first ready
compute in its priority order, timed by the given costs of F, B and W (unit by default).
Ready means in order (micro-batches enter each chunk in order, and W's run in the order of
their B's) and with its input produced: F after the previous virtual stage's F, B after its
own F and the next virtual stage's B, W after its own B. A micro-batch's activations stay
until its W.

  * zb-h1 (one chunk per stage): F and B in 1F1B's order (stage r runs F while fewer than
    p - r micro-batches have not run B), F only while fewer than p micro-batches hold
    activations (1F1B's peak, on its first stage), and a W whenever that next F or B cannot
    run. The bubble drops from 1F1B's (p - 1)(F + B + W) to (p - 1)(F + B - W).
  * zbv (two chunks per stage in a V: stage r holds virtual stages r and 2p - 1 - r, so the
    first stage holds the embedding and the head): B first (the earlier micro-batch), then F
    (the second chunk first, it finishes a micro-batch) while fewer than 2p chunk
    activations are held (1F1B's p full-stage micro-batches), then W.

Each timeline is built twice, with an eager W rule (a W whenever nothing else is ready) and a
patient one (no W that would still run when the input of the stage's next F or B arrives,
if that input is already being computed), and the shorter is kept: at F = B = W both give the
bubbles above; at other costs one or the other gets closer.

`schedule.py` turns the timeline into action lists, posting each transfer in the order of
the moment its producer finishes, so the lists replay this timeline under NCCL's rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_lite import schedules
from megatron_lite.pipeline.partition import virtual_stage


@dataclass(frozen=True)
class Slot:
    """One compute of the timeline: `kind` "F", "B" or "W" of `microbatch` on `chunk`."""

    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass
class _Stage:
    """One stage's progress while the timeline is built."""

    rank: int
    chunks: int
    free_at: float = 0.0
    next_forward: list[int] = field(default_factory=list)
    """Per chunk, the next micro-batch to run F on."""
    next_backward: list[int] = field(default_factory=list)
    weights: list[tuple[int, int]] = field(default_factory=list)
    """(micro-batch, chunk) whose B ran and whose W has not, oldest first."""
    slots: list[Slot] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.next_forward = [0] * self.chunks
        self.next_backward = [0] * self.chunks

    def held(self) -> int:
        """Chunk activations alive: F done, W not done."""
        return sum(self.next_forward) - sum(self.next_backward) + len(self.weights)


@dataclass
class _Run:
    """What every stage's choice reads: the schedule, the costs and the finish times so far."""

    kind: str
    pp_size: int
    num_microbatches: int
    cost: dict[str, float]
    """Per chunk compute."""
    patient: bool
    done: dict[tuple[str, int, int], float] = field(default_factory=dict)
    """(kind, micro-batch, virtual stage) -> end time, for every compute started."""

    @property
    def v_shape(self) -> bool:
        return schedules.get(self.kind).v_shape

    @property
    def last_virtual(self) -> int:
        return self.pp_size * schedules.get(self.kind).stage_chunks(1) - 1

    def virtual(self, stage: _Stage, chunk: int) -> int:
        return virtual_stage(self.pp_size, stage.rank, chunk, self.v_shape)

    def forward_input(self, stage: _Stage, chunk: int) -> float:
        """When the next F of `chunk` can start (inf: not started upstream, or none left)."""
        mb, virtual = stage.next_forward[chunk], self.virtual(stage, chunk)
        if mb >= self.num_microbatches:
            return math.inf
        return 0.0 if virtual == 0 else self.done.get(("F", mb, virtual - 1), math.inf)

    def backward_input(self, stage: _Stage, chunk: int) -> float:
        """When the next B of `chunk` can start (inf: its F or the gradient not started)."""
        mb, virtual = stage.next_backward[chunk], self.virtual(stage, chunk)
        if mb >= stage.next_forward[chunk]:
            return math.inf
        own = self.done[("F", mb, virtual)]
        if virtual == self.last_virtual:
            return own
        return max(own, self.done.get(("B", mb, virtual + 1), math.inf))


def timeline(kind: str, pp_size: int, num_microbatches: int,
             forward_only: bool = False, costs: tuple[float, float, float] = (1.0, 1.0, 1.0)
             ) -> list[list[Slot]]:
    """Every stage's computes in order with start and end times; `costs` = (F, B, W) of a
    whole stage (a chunk costs 1/v of it)."""
    if kind not in schedules.ZERO_BUBBLE:
        raise ValueError(f"unknown zero-bubble schedule {kind!r}")
    candidates = [_play(kind, pp_size, num_microbatches, forward_only, costs, patient)
                  for patient in (False, True)]
    return min(candidates, key=lambda stages: max(s.end for st in stages for s in st))


def _play(kind: str, pp_size: int, num_microbatches: int, forward_only: bool,
          costs: tuple[float, float, float], patient: bool) -> list[list[Slot]]:
    chunks = schedules.get(kind).stage_chunks(1)
    run = _Run(kind, pp_size, num_microbatches,
               {op: c / chunks for op, c in zip("FBW", costs)}, patient)
    stages = [_Stage(rank, chunks) for rank in range(pp_size)]
    total = pp_size * num_microbatches * chunks * (1 if forward_only else 3)
    now = 0.0
    tie = 1e-9 * max(costs)  # times this close are one moment (sums of costs round)
    while len(run.done) < total:
        for stage in stages:
            if stage.free_at > now + tie:
                continue
            picked = _pick_forward(run, stage, now + tie) if forward_only else \
                _pick(run, stage, now + tie)
            if picked is not None:
                _start(run, stage, *picked, max(now, stage.free_at))
        upcoming = [s.free_at for s in stages if s.free_at > now + tie]
        if not upcoming:
            raise RuntimeError(f"the {kind} timeline stalled at time {now} with every stage "
                               "idle: its priority rule left work undone")
        now = min(upcoming)
    return [s.slots for s in stages]


def _start(run: _Run, stage: _Stage, op: str, chunk: int, start: float) -> None:
    if op == "F":
        mb = stage.next_forward[chunk]
        stage.next_forward[chunk] += 1
    elif op == "B":
        mb = stage.next_backward[chunk]
        stage.next_backward[chunk] += 1
        stage.weights.append((mb, chunk))
    else:
        mb, _ = stage.weights.pop(0)
    end = start + run.cost[op]
    stage.slots.append(Slot(op, mb, chunk, start, end))
    stage.free_at = end
    run.done[(op, mb, run.virtual(stage, chunk))] = end


def _pick_forward(run: _Run, stage: _Stage, now: float) -> tuple[str, int] | None:
    """Evaluation: forwards only, the later chunk first."""
    ready = [c for c in reversed(range(stage.chunks)) if run.forward_input(stage, c) <= now]
    return ("F", ready[0]) if ready else None


def _pick(run: _Run, stage: _Stage, now: float) -> tuple[str, int] | None:
    """(kind, chunk) of the compute this idle stage starts now, or None to wait."""
    if not run.v_shape:
        # one chunk (ZB-H1): 1F1B's order of F and B, F while the warm-up depth allows
        depth = stage.next_forward[0] - stage.next_backward[0]
        if stage.next_forward[0] < run.num_microbatches and depth < run.pp_size - stage.rank:
            due, op, room = run.forward_input(stage, 0), "F", stage.held() < run.pp_size
        else:
            due, op, room = run.backward_input(stage, 0), "B", True
        if due <= now and room:
            return op, 0
    else:
        order = (1, 0)  # the later chunk first: it is nearer the loss
        backward = [c for c in order if run.backward_input(stage, c) <= now]
        if backward:
            return "B", min(backward, key=lambda c: stage.next_backward[c])
        room = stage.held() < 2 * run.pp_size
        forward = [c for c in order if room and run.forward_input(stage, c) <= now]
        if forward:
            return "F", forward[0]
        due = min([run.backward_input(stage, c) for c in order]
                  + [run.forward_input(stage, c) for c in order if room])
    if not stage.weights:
        return None
    if run.patient and room and now + run.cost["W"] > due:
        return None  # the next F or B's input is on its way: do not delay it with a W
    return "W", stage.weights[0][1]
