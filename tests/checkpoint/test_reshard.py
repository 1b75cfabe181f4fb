"""Resharding: a checkpoint saved in layout X loads into layout Y with the same full state,
and training continued in Y follows training continued in X."""

from __future__ import annotations

import pytest

from tests.checkpoint.common import LAYOUTS, assert_same_state, run_sequence
from tests.distributed import run_ranks

PAIRS = [("tp2-pp2", "single"), ("dp2-zero1", "tp2"), ("pp2-v2", "pp4")]


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_reshard_round_trip(tmp_path, source: str, target: str) -> None:
    x_flags, x_world, x_tp, x_pp = LAYOUTS[source]
    y_flags, y_world, y_tp, y_pp = LAYOUTS[target]
    x, y = tmp_path / "x", tmp_path / "y"
    _, continued_x = run_ranks(run_sequence, x_world, tmp_path, tp=x_tp, pp=x_pp, runs=[
        [*x_flags, "--save", str(x), "--exit-interval", "3"],
        [*x_flags, "--load", str(x), "--ckpt-step", "3", "--save", str(tmp_path / "x6")]])[0]
    # Load X's iteration 3 into Y and save it at once (no step), then continue from there.
    loaded, continued_y = run_ranks(run_sequence, y_world, tmp_path, tp=y_tp, pp=y_pp, runs=[
        [*y_flags, "--load", str(x), "--ckpt-step", "3", "--save", str(y), "--train-iters", "3"],
        [*y_flags, "--save", str(y)]])[0]
    assert loaded == []
    assert_same_state(x / "iter_0000003", y / "iter_0000003")
    assert len(continued_y) == len(continued_x) == 3
    for a, b in zip(continued_y, continued_x):
        assert abs(a - b) <= 1e-5 * abs(b), (continued_y, continued_x)
