"""Layout arithmetic: how the layer stack splits over pipeline stages and chunks, and the
rules a layout must meet (stdlib only).

Config validation (before any process group exists), the partitioner (pipeline/partition.py)
and the planner all read these, so the three cannot disagree on what splits. Errors are
returned as messages naming the flags; the callers raise them as their `ConfigError`.
"""

from __future__ import annotations

from megatron_lite.schedules import Schedule


def split_errors(num_layers: int, pp: int, virtual_size: int | None = None,
                 first: int | None = None, last: int | None = None) -> list[str]:
    """Why `num_layers` cannot be split over `pp` stages (fixed `first`/`last` stage counts,
    the rest even) into chunks of `virtual_size` layers; empty when it can."""
    if pp == 1:
        if virtual_size is not None or first is not None or last is not None:
            return ["--num-layers-per-virtual-pipeline-stage / --decoder-first-pipeline-num-"
                    "layers / --decoder-last-pipeline-num-layers need "
                    "--pipeline-model-parallel-size > 1; drop them for a single stage"]
        return []
    fixed = [n for n in (first, last) if n is not None]
    rest_stages, rest_layers = pp - len(fixed), num_layers - sum(fixed)
    if any(n < 1 for n in fixed):
        return [f"--decoder-first/last-pipeline-num-layers must be >= 1, got {fixed}"]
    if rest_stages == 0 and rest_layers != 0:
        return [f"--decoder-first-pipeline-num-layers {first} + --decoder-last-pipeline-num-"
                f"layers {last} must equal --num-layers {num_layers} with "
                f"--pipeline-model-parallel-size {pp}"]
    if rest_stages and (rest_layers < rest_stages or rest_layers % rest_stages):
        return [f"{rest_layers} layers (--num-layers {num_layers} minus uneven first/last "
                f"stages) cannot be split evenly over {rest_stages} pipeline stages "
                f"(--pipeline-model-parallel-size {pp}); use a multiple of {rest_stages} or "
                "change the uneven stage sizes"]
    if virtual_size is None:
        return []
    if virtual_size < 1 or num_layers % (pp * virtual_size):
        return [f"--num-layers {num_layers} must be divisible by --pipeline-model-parallel-size "
                f"{pp} x --num-layers-per-virtual-pipeline-stage {virtual_size} = "
                f"{pp * max(virtual_size, 1)}"]
    counts = stage_layer_counts(num_layers, pp, first, last)
    chunks = num_layers // (pp * virtual_size)
    if any(n % chunks for n in counts):
        return [f"stage layer counts {counts} must each divide into the {chunks} virtual chunks "
                "per stage (--num-layers / (--pipeline-model-parallel-size x "
                "--num-layers-per-virtual-pipeline-stage)); adjust the uneven stage sizes"]
    return []


def stage_layer_counts(num_layers: int, pp: int, first: int | None = None,
                       last: int | None = None) -> list[int]:
    """Layers per stage: the fixed first/last counts, the rest shared evenly (the split must
    pass `split_errors`)."""
    if pp == 1:
        return [num_layers]
    fixed = {stage: n for stage, n in ((0, first), (pp - 1, last)) if n is not None}
    rest_stages = pp - len(fixed)
    even = (num_layers - sum(fixed.values())) // rest_stages if rest_stages else 0
    return [fixed.get(stage, even) for stage in range(pp)]


def virtual_chunks(num_layers: int, pp: int, virtual_size: int | None) -> int:
    """Chunks per stage v = num_layers / (p x layers per virtual stage); 1 without it."""
    return 1 if virtual_size is None else num_layers // (pp * virtual_size)


def microbatch_errors(schedule: Schedule, pp: int, microbatches: int,
                      virtual_size: int | None) -> list[str]:
    """The schedule's rule on the micro-batches per step (interleaved: a multiple of p)."""
    if pp > 1 and schedule.microbatches_multiple_of_pp and microbatches % pp:
        return [f"the {schedule.name} schedule (--num-layers-per-virtual-pipeline-stage "
                f"{virtual_size}) needs the {microbatches} micro-batches per step to be a "
                f"multiple of --pipeline-model-parallel-size {pp}; adjust --global-batch-size"]
    return []


def build_errors(schedule: Schedule, pp: int, microbatches: int, chunks: int) -> list[str]:
    """What a schedule's action lists need of (stages, micro-batches, chunks built)."""
    if microbatches < 1:
        return [f"need at least one micro-batch, got {microbatches}"]
    if chunks > 1 and pp == 1:
        return ["virtual chunks need more than one pipeline stage"]
    if schedule.split_backward and pp == 1:
        return [f"the {schedule.name} schedule needs more than one pipeline stage"]
    if schedule.split_backward and chunks != schedule.stage_chunks(chunks):
        return [f"the {schedule.name} schedule runs {schedule.chunks} chunk(s) per stage, the "
                f"model was built with {chunks}"]
    return []


def overlap_param_gather_errors(overlap_param_gather: bool,
                                distributed_optimizer: bool) -> list[str]:
    """--overlap-param-gather overlaps an all-gather only the distributed optimizer does."""
    if overlap_param_gather and not distributed_optimizer:
        return ["--overlap-param-gather overlaps the distributed optimizer's parameter "
                "all-gather; add --use-distributed-optimizer or drop it"]
    return []
