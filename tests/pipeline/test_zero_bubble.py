"""Zero-bubble schedules (ZB-H1, ZBV) checked by the simulator, without processes."""

from __future__ import annotations

import itertools
import random

import pytest

from megatron_lite.config import (
    Config,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    validate,
)
from megatron_lite.pipeline.partition import config_partition, stage_chunks, v_partition
from megatron_lite.pipeline.schedule import (
    BackwardInput,
    BackwardWeight,
    Forward,
    Post,
    ReduceGrads,
    Wait,
    build_schedule,
    schedule_chunks,
)
from megatron_lite.pipeline.zero_bubble import timeline
from megatron_lite.planner import PRESETS, bubble_time, in_flight, pipeline_op_costs
from tests.pipeline.simulator import ScheduleError, simulate

UNIT = dict(forward_time=1.0, backward_time=2.0, weight_time=1.0)  # F = B = W = 1
GRID = [(p, m) for p in (2, 3, 4, 8) for m in range(1, 4 * p + 1)]


def _run(kind: str, pp: int, m: int, costs: tuple[float, float, float] = (1.0, 1.0, 1.0),
         schedule_costs: tuple[float, float, float] | None = None, **kwargs):
    """Simulate `kind` built for `schedule_costs` (default: the costs it runs at)."""
    chunks = schedule_chunks(kind, 1)
    schedule = build_schedule(pp, m, chunks, kind=kind, costs=schedule_costs or costs,
                              **kwargs)
    tf, tb, tw = costs
    return simulate(schedule, m, chunks, tf, tb + tw, weight_time=tw, v_shape=kind == "zbv",
                    **kwargs)


def _bubble_time(result, m: int, work_per_microbatch: float = 3.0) -> float:
    return result.makespan - m * work_per_microbatch


@pytest.mark.parametrize(("pp", "m"), GRID)
@pytest.mark.parametrize("kind", ["zb-h1", "zbv"])
def test_runs_every_action_once_and_replays_its_timeline(kind: str, pp: int, m: int) -> None:
    """No deadlock under NCCL's rules, each F, B and W once (the simulator raises otherwise),
    and with the costs it was built for the run takes exactly the timeline's time."""
    result = _run(kind, pp, m)
    planned = max(slot.end for stage in timeline(kind, pp, m) for slot in stage)
    assert result.makespan == pytest.approx(planned)
    # In-flight activations (F done, W not done), in whole-stage micro-batches: never more
    # than 1F1B's peak on its first stage, p.
    chunks = schedule_chunks(kind, 1)
    assert max(result.peak_in_flight) / chunks <= min(pp, m)


@pytest.mark.parametrize(("pp", "m"), [(p, m) for p, m in GRID if m >= p])
def test_zb_h1_keeps_1f1b_memory_and_cuts_the_bubble_to_a_third(pp: int, m: int) -> None:
    plain = simulate(build_schedule(pp, m), m, 1, **{k: UNIT[k] for k in
                                                     ("forward_time", "backward_time")})
    zb = _run("zb-h1", pp, m)
    assert max(zb.peak_in_flight) == max(plain.peak_in_flight) == pp
    # 1F1B idles (p - 1)(F + B + W); ZB-H1 (p - 1)(F + B - W), a third at unit costs.
    assert _bubble_time(plain, m) == pytest.approx(3 * (pp - 1))
    assert _bubble_time(zb, m) == pytest.approx(pp - 1)
    if m >= 2 * pp:
        assert _bubble_time(zb, m) <= _bubble_time(plain, m) / 3 + 1e-9


@pytest.mark.parametrize(("pp", "m"), [(p, m) for p in (2, 3, 4, 8) for m in (p, 2 * p, 3 * p)])
def test_zbv_bubble_below_interleaved_at_equal_microbatches(pp: int, m: int) -> None:
    interleaved = simulate(build_schedule(pp, m, 2), m, 2, 1.0, 2.0)
    zbv = _run("zbv", pp, m)
    assert zbv.bubble < interleaved.bubble
    assert _bubble_time(zbv, m) == pytest.approx((pp - 1) / 2)  # half a chunk per hop
    assert max(zbv.peak_in_flight) / 2 <= pp  # 2p chunk activations = 1F1B's p micro-batches


@pytest.mark.parametrize("kind", ["zb-h1", "zbv"])
def test_any_costs_run_without_deadlock_and_measured_costs_help(kind: str) -> None:
    """Deadlock freedom does not depend on timing: lists built for unit costs run at any
    costs. Built for the costs measured on a machine, they replay that machine's timeline."""
    rng = random.Random(0)
    for pp, m in ((2, 5), (4, 8), (4, 16), (8, 16)):
        for _ in range(3):
            costs = (rng.uniform(0.5, 1.5), rng.uniform(0.5, 2.0), rng.uniform(0.3, 1.5))
            _run(kind, pp, m, costs, schedule_costs=(1.0, 1.0, 1.0))
            tuned = _run(kind, pp, m, costs)
            planned = max(s.end for st in timeline(kind, pp, m, costs=costs) for s in st)
            assert tuned.makespan == pytest.approx(planned)


def test_w_steps_fill_the_bubble_and_reduction_follows_the_last_w() -> None:
    schedule = build_schedule(4, 8, 1, kind="zb-h1")
    last_stage = [a for a in schedule[3] if isinstance(a, Forward | BackwardInput
                                                       | BackwardWeight)]
    # The last stage defers its first W's (1F1B would run W0 right after B0) ...
    assert last_stage[:4] == [Forward(0, 0), BackwardInput(0, 0), Forward(1, 0),
                              BackwardInput(1, 0)]
    for actions in schedule:
        kinds = [type(a) for a in actions]
        assert kinds.count(BackwardWeight) == 8
        reduce = kinds.index(ReduceGrads)
        assert reduce > max(i for i, k in enumerate(kinds) if k is BackwardWeight)
    # ZBV: chunk 0's buckets hold the embedding tied to chunk 1's head, so its reduction
    # follows both chunks' last W.
    for actions in build_schedule(4, 8, 2, kind="zbv"):
        last_w = max(i for i, a in enumerate(actions) if isinstance(a, BackwardWeight))
        assert actions.index(ReduceGrads(0)) > last_w


def test_a_compute_waits_only_for_its_own_input() -> None:
    """Every transfer is posted once and waited once, before the compute that reads it."""
    for kind in ("zb-h1", "zbv"):
        for actions in build_schedule(4, 8, schedule_chunks(kind, 1), kind=kind):
            posted = [op for a in actions if isinstance(a, Post) for op in a.ops]
            assert len(posted) == len(set(posted))
            assert isinstance(actions[-1], Wait) and set(actions[-1].ops) == set(posted)


def test_simulator_catches_a_broken_zero_bubble_schedule() -> None:
    schedule = build_schedule(2, 4, 1, kind="zb-h1")
    no_w = [[a for a in actions if a != BackwardWeight(3, 0)] for actions in schedule]
    with pytest.raises(ScheduleError):
        simulate(no_w, 4, 1, weight_time=1.0)
    no_wait = [list(schedule[0]), [a for a in schedule[1] if not isinstance(a, Wait)]]
    with pytest.raises(ScheduleError):
        simulate(no_wait, 4, 1, weight_time=1.0)
    # Posting order breaking one clock: stage 1 posts its first two batches swapped.
    posts = [i for i, a in enumerate(schedule[0]) if isinstance(a, Post)]
    swapped = list(schedule[0])
    swapped[posts[0]], swapped[posts[1]] = swapped[posts[1]], swapped[posts[0]]
    with pytest.raises(ScheduleError):
        simulate([swapped, list(schedule[1])], 4, 1, weight_time=1.0)


@pytest.mark.parametrize(("kind", "pp", "m"), [("zb-h1", 4, 5), ("zbv", 2, 3), ("zbv", 4, 8)])
def test_forward_only_schedules_for_evaluation(kind: str, pp: int, m: int) -> None:
    chunks = schedule_chunks(kind, 1)
    schedule = build_schedule(pp, m, chunks, forward_only=True, kind=kind)
    result = simulate(schedule, m, chunks, forward_only=True, v_shape=kind == "zbv")
    planned = max(s.end for st in timeline(kind, pp, m, forward_only=True) for s in st)
    assert result.makespan == pytest.approx(planned)
    assert result.makespan <= m + pp - 1  # forwards stream through, as in 1F1B's evaluation


def test_v_partition_puts_both_ends_on_stage_0() -> None:
    part = v_partition(8, 2)
    assert part.layers == (((0, 1), (6, 7)), ((2, 3), (4, 5)))
    specs = [stage_chunks(part, s) for s in range(2)]
    assert [(c.pre_process, c.post_process) for c in specs[0]] == [(True, False), (False, True)]
    assert not any(c.pre_process or c.post_process for c in specs[1])
    for pp, layers in itertools.product((2, 3, 4), (24, 48)):
        part = v_partition(layers, pp)
        down = [part.layer_ids(s, 0) for s in range(pp)]
        up = [part.layer_ids(s, 1) for s in reversed(range(pp))]
        assert [i for ids in down + up for i in ids] == list(range(layers))


def _cfg(kind: str | None, layers=8, pp=2, lpv=None, first=None, compile_=False) -> Config:
    return Config(model=ModelConfig(num_layers=layers),
                  parallel=ParallelConfig(pipeline_model_parallel_size=pp, pipeline_schedule=kind,
                                          num_layers_per_virtual_pipeline_stage=lpv,
                                          decoder_first_pipeline_num_layers=first),
                  train=TrainConfig(micro_batch_size=1, global_batch_size=4 * pp,
                                    compile=compile_))


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"kind": "zb-h1", "pp": 1}, "--pipeline-model-parallel-size > 1"),
    ({"kind": "zbv", "layers": 6, "pp": 2}, "use a multiple of 4"),
    ({"kind": "zbv", "first": 1}, "drop --decoder-first/last-pipeline-num-layers"),
    ({"kind": "zb-h1", "lpv": 2}, "is for the interleaved schedule"),
    ({"kind": "interleaved"}, "needs --num-layers-per-virtual-pipeline-stage"),
    ({"kind": "zbv", "compile_": True}, "drop --compile"),
])
def test_schedule_flag_validation_names_the_flags(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match="pipeline") as err:
        validate(_cfg(**kwargs), world_size=kwargs.get("pp", 2))
    assert needle in str(err.value)


def test_default_schedule_is_todays_choice() -> None:
    assert config_partition(_cfg(None), 2).num_chunks == 1
    assert config_partition(_cfg(None, lpv=2), 2).num_chunks == 2
    assert config_partition(_cfg("zbv"), 2).v_shape
    for kind in ("zb-h1", "zbv", "1f1b"):
        validate(_cfg(kind), world_size=2)
    validate(_cfg("interleaved", lpv=2), world_size=2)


@pytest.mark.parametrize(("pp", "m"), [(p, m) for p in (2, 4, 8) for m in (1, p, 2 * p, 4 * p)])
def test_planner_in_flight_and_bubble_match_the_simulator(pp: int, m: int) -> None:
    """The planner's memory count is each stage's simulated peak; its bubble time is the
    simulated one at F = B = W, for every schedule."""
    for kind in ("zb-h1", "zbv"):
        chunks = schedule_chunks(kind, 1)
        result = _run(kind, pp, m)
        assert result.peak_in_flight == [in_flight(pp, s, chunks, m, kind) for s in range(pp)]
        if m >= pp:
            assert _bubble_time(result, m) == pytest.approx(
                bubble_time(pp, 3.0, chunks, kind, (1.0, 1.0, 1.0)))
    if m >= pp:
        plain = simulate(build_schedule(pp, m), m, 1, 1.0, 2.0)
        assert _bubble_time(plain, m) == pytest.approx(bubble_time(pp, 3.0, 1, "1f1b",
                                                                   (1.0, 1.0, 1.0)))


def test_flop_costs_put_attention_in_b_and_tuned_timelines_beat_interleaving() -> None:
    """F : B : W from FLOPs (what training builds its timelines with): W is the matmuls only,
    B also the attention backward. Built for them, ZBV stays below interleaved v = 2."""
    model = PRESETS["70B"][1]
    f, b, w = pipeline_op_costs(model, tp=8)
    assert w < f < b and b - f == pytest.approx(f - w)
    costs = (f / w, b / w, 1.0)
    for pp, m in ((4, 8), (4, 16), (8, 16)):
        interleaved = simulate(build_schedule(pp, m, 2), m, 2, costs[0], costs[1] + costs[2])
        assert _run("zbv", pp, m, costs).bubble < interleaved.bubble
        plain = simulate(build_schedule(pp, m), m, 1, costs[0], costs[1] + costs[2])
        assert _run("zb-h1", pp, m, costs).bubble < plain.bubble
