"""Schedules checked by playing every stage's action list against the others (no processes)."""

from __future__ import annotations

import pytest

from megatron_lite.pipeline.schedule import (
    Backward,
    Communicate,
    Forward,
    Recv,
    ReduceGrads,
    Send,
    build_schedule,
    compute_order,
)
from tests.pipeline.simulator import ScheduleError, simulate

GRID_1F1B = [(p, m) for p in (1, 2, 3, 4, 8) for m in range(1, 3 * p + 2)]
GRID_INTERLEAVED = [(p, v, m) for p in (2, 3, 4, 8) for v in (2, 3, 4)
                    for m in range(p, 3 * p + 1, p)]


@pytest.mark.parametrize(("pp", "m"), GRID_1F1B)
def test_1f1b_runs_and_has_the_theoretical_bubble(pp: int, m: int) -> None:
    tf, tb = 1.0, 2.0
    result = simulate(build_schedule(pp, m), m, 1, tf, tb)
    # 1F1B: the step takes (m + p - 1) slots of (t_f + t_b) (Narayanan et al. 2021, §2.2.1).
    assert result.makespan == pytest.approx((m + pp - 1) * (tf + tb))
    # At most p - r micro-batches are alive on stage r, whatever m is.
    assert result.peak_in_flight == [min(pp - r, m) for r in range(pp)]


@pytest.mark.parametrize(("pp", "v", "m"), GRID_INTERLEAVED)
def test_interleaved_runs_and_has_the_theoretical_bubble(pp: int, v: int, m: int) -> None:
    tf, tb = 1.0, 2.0
    result = simulate(build_schedule(pp, m, v), m, v, tf, tb)
    # Interleaving shrinks the bubble to (p - 1)(t_f + t_b) / v (§2.2.2); each chunk costs 1/v.
    assert result.makespan == pytest.approx(m * (tf + tb) + (pp - 1) * (tf + tb) / v)
    # Live chunk activations are bounded by the warm-up depth + 1, not by m.
    for rank, peak in enumerate(result.peak_in_flight):
        assert peak <= min((pp - rank - 1) * 2 + (v - 1) * pp + 1, m * v)


def test_interleaved_beats_1f1b_at_equal_microbatches() -> None:
    plain = simulate(build_schedule(4, 8), 8, 1).makespan
    interleaved = simulate(build_schedule(4, 8, 2), 8, 2).makespan
    assert interleaved < plain


def test_memory_bound_does_not_grow_with_microbatches() -> None:
    peaks = {m: simulate(build_schedule(4, m), m, 1).peak_in_flight[0] for m in (4, 16, 64)}
    assert peaks == {4: 4, 16: 4, 64: 4}


@pytest.mark.quick
def test_1f1b_warmup_and_steady_state_shape() -> None:
    order = compute_order(4, 1, 6)
    # Stage 1 of 4: 2 warm-up forwards, then alternate, then 2 cool-down backwards.
    assert order[:3] == [Forward(0, 0), Forward(1, 0), Forward(2, 0)]
    assert order[3:5] == [Backward(0, 0), Forward(3, 0)]
    assert order[-2:] == [Backward(4, 0), Backward(5, 0)]


def test_no_pipelining_is_gradient_accumulation() -> None:
    (actions,) = build_schedule(1, 3)
    assert actions == [Forward(0, 0), Backward(0, 0), Forward(1, 0), Backward(1, 0),
                       Forward(2, 0), Backward(2, 0), ReduceGrads(0)]


def test_grad_reduction_once_per_chunk_after_its_last_backward() -> None:
    for actions in build_schedule(4, 8, 2):
        reduces = [i for i, a in enumerate(actions) if isinstance(a, ReduceGrads)]
        assert len(reduces) == 2
        for i in reduces:
            chunk = actions[i].chunk
            last_b = max(j for j, a in enumerate(actions)
                         if isinstance(a, Backward) and a.chunk == chunk)
            assert last_b < i


def test_transfers_go_to_the_neighbouring_stage_and_wrap_between_chunks() -> None:
    schedule = build_schedule(3, 3, 2)
    ops = [op for a in schedule[2] if isinstance(a, Communicate) for op in a.ops]
    # Stage 2's chunk 0 feeds stage 0's chunk 1 (the wrap-around); chunk 1 is the last one.
    assert Send("activation", 0, 0, peer=0) in ops
    assert Recv("activation", 0, 1, peer=1) in ops
    assert not any(isinstance(op, Send) and op.tensor == "activation" and op.chunk == 1
                   for op in ops)


@pytest.mark.quick
def test_simulator_catches_a_broken_schedule() -> None:
    schedule = build_schedule(2, 4)
    # Stage 1 without its transfers computes before its input arrives; a dropped backward
    # leaves a micro-batch half done.
    broken = [list(schedule[0]), [a for a in schedule[1] if not isinstance(a, Communicate)]]
    with pytest.raises(ScheduleError):
        simulate(broken, 4, 1)
    dropped = [list(schedule[0]), [a for a in schedule[1] if a != Backward(3, 0)]]
    with pytest.raises(ScheduleError):
        simulate(dropped, 4, 1)


def test_interleaved_with_microbatches_not_a_multiple_of_stages_is_unsafe() -> None:
    # Why validate() demands m % p == 0 for the interleaved schedule.
    with pytest.raises(ScheduleError):
        simulate(build_schedule(4, 6, 2), 6, 2)


@pytest.mark.parametrize(("pp", "v", "m"), [(1, 1, 3), (2, 1, 2), (4, 1, 5), (2, 2, 4),
                                            (4, 2, 8), (3, 3, 6)])
def test_forward_only_schedule_for_evaluation(pp: int, v: int, m: int) -> None:
    result = simulate(build_schedule(pp, m, v, forward_only=True), m, v, forward_only=True)
    # Forwards stream through the pipeline: m*v chunk forwards plus (p - 1) fill slots.
    assert result.makespan == pytest.approx((m * v + pp - 1) / v)
