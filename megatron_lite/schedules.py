"""The pipeline schedules as one table: what each --pipeline-schedule means (stdlib only).

Config validation, the partitioner, the schedule builder, the training loop, the memory model
and the planner all read a schedule's facts from here (chunks per stage, placement, split
backward, the head's stage, the bubble, the preconditions), so adding a schedule is one row
here plus its action lists in pipeline/. No other module spells a schedule's name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """One --pipeline-schedule."""

    name: str
    chunks: int | None
    """Model chunks per stage; None: as built (--num-layers-per-virtual-pipeline-stage)."""
    v_shape: bool
    """Chunks placed in a V (stage s holds pieces s and 2p - 1 - s), else round-robin."""
    split_backward: bool
    """Backward split into the input gradient (B) and a deferred weight gradient (W)."""
    virtual_size: bool
    """Needs --num-layers-per-virtual-pipeline-stage (and no other schedule takes it)."""
    microbatches_multiple_of_pp: bool
    """The micro-batches per step must be a multiple of the pipeline size."""

    def stage_chunks(self, built: int) -> int:
        """Chunks per stage this schedule runs, given the chunks the flags built."""
        return built if self.chunks is None else self.chunks

    def head_stage(self, pp: int) -> int:
        """The stage holding the final norm, the output layer and the loss: the V turns back
        to stage 0, round-robin ends on the last stage."""
        return 0 if self.v_shape else pp - 1

    def in_flight(self, pp: int, stage: int, chunks: int, microbatches: int) -> int:
        """Peak micro-batch chunks whose activations a stage holds at once.

        1F1B: p - stage (warm-up + 1). Interleaved 1F1B (Megatron's warm-up count):
        2·(p - stage - 1) + (v - 1)·p + 1 chunk forwards, capped by the m·v that exist.
        Zero-bubble schedules hold a micro-batch from its F to its W: p micro-batches of v
        chunks on every stage (pipeline/zero_bubble.py's priority rules stop forwards there).
        """
        chunks = self.stage_chunks(chunks)
        if self.split_backward:
            return min(microbatches * chunks, pp * chunks)
        if chunks == 1:
            return min(microbatches, pp - stage)
        return min(microbatches * chunks, 2 * (pp - stage - 1) + (chunks - 1) * pp + 1)

    def bubble(self, pp: int, stage_s: float, chunks: int,
               op_costs: tuple[float, float, float]) -> float:
        """Idle seconds per step of a stage whose micro-batch takes `stage_s` (F + B + W).

        1F1B (p - 1)(F + B + W) (Narayanan et al. 2021), interleaved the same over v; ZB-H1
        (p - 1)(F + B - W) (Qi et al. 2024: W's fill the cool-down) and ZBV half of ZB-H1 (its
        chunks are half a stage), F, B and W split `stage_s` as `op_costs`.
        """
        chunks = self.stage_chunks(chunks)
        if self.split_backward:
            f, b, w = (x / sum(op_costs) for x in op_costs)
            return (pp - 1) * stage_s * (f + b - w) / chunks
        return (pp - 1) * stage_s / chunks

    def flag_errors(self, pp: int, virtual_size: int | None, uneven: bool, num_layers: int,
                    compile_: bool) -> list[str]:
        """What this schedule, named by --pipeline-schedule, needs of the other flags."""
        flag = f"--pipeline-schedule {self.name}"
        if self.virtual_size and virtual_size is None:
            return [f"{flag} needs --num-layers-per-virtual-pipeline-stage (the chunk size)"]
        if not self.virtual_size and virtual_size is not None:
            return [f"--num-layers-per-virtual-pipeline-stage {virtual_size} is for the "
                    f"{INTERLEAVED.name} schedule, not {flag}; drop one of them"]
        if not self.split_backward:
            return []
        errors = []
        if pp == 1:
            errors.append(f"{flag} needs --pipeline-model-parallel-size > 1")
        if compile_:
            errors.append(f"{flag} queues weight gradients from Python in backward, which "
                          "torch.compile does not trace; drop --compile")
        pieces = (self.chunks or 1) * pp
        if self.v_shape and uneven:
            errors.append(f"{flag} places {self.chunks} equal chunks per stage in a V; drop "
                          "--decoder-first/last-pipeline-num-layers")
        elif self.v_shape and num_layers % pieces:
            errors.append(f"{flag} splits --num-layers {num_layers} into {self.chunks} x "
                          f"--pipeline-model-parallel-size = {pieces} equal chunks; use a "
                          f"multiple of {pieces}")
        return errors


ONE_F_ONE_B = Schedule("1f1b", 1, v_shape=False, split_backward=False, virtual_size=False,
                       microbatches_multiple_of_pp=False)
INTERLEAVED = Schedule("interleaved", None, v_shape=False, split_backward=False,
                       virtual_size=True, microbatches_multiple_of_pp=True)
ZB_H1 = Schedule("zb-h1", 1, v_shape=False, split_backward=True, virtual_size=False,
                 microbatches_multiple_of_pp=False)
ZBV = Schedule("zbv", 2, v_shape=True, split_backward=True, virtual_size=False,
               microbatches_multiple_of_pp=False)

SCHEDULES: dict[str, Schedule] = {s.name: s for s in (ONE_F_ONE_B, INTERLEAVED, ZB_H1, ZBV)}
"""--pipeline-schedule choices, by name."""

NAMES = tuple(SCHEDULES)
"""The flag's choices, in table order."""

ZERO_BUBBLE = tuple(s.name for s in SCHEDULES.values() if s.split_backward)
"""The schedules that split the backward (the `kind`s pipeline/zero_bubble.py builds)."""


def get(name: str | None, chunks: int = 1) -> Schedule:
    """The schedule `name`; None (no --pipeline-schedule): 1F1B, or interleaved when the
    flags built more than one chunk per stage."""
    if name is None:
        return INTERLEAVED if chunks > 1 else ONE_F_ONE_B
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(NAMES)}")
    return SCHEDULES[name]


def in_effect(name: str | None, virtual_size: int | None) -> Schedule:
    """The schedule a run uses: --pipeline-schedule, else what
    --num-layers-per-virtual-pipeline-stage implies (interleaved with it, 1f1b without)."""
    if name is not None:
        return get(name)
    return ONE_F_ONE_B if virtual_size is None else INTERLEAVED
