"""Checkpoints across --data-parallel-sharding-strategy: exact resume, resharding both ways.

One 4-rank spawn, float64 throughout. ZeRO-2 at DP=4 is interrupted at iteration HALF and
resumed (bit-identical to the uninterrupted run), and its iteration HALF is loaded into ZeRO-1
at TP=2 x DP=2 and into plain DP and ZeRO-3 at DP=4; the plain run's goes into ZeRO-2 at
TP=2 x DP=2 (ZeRO-3 as a source: tests/optim/test_zero3_end_to_end.py). Every load is saved
at once (no step) and must hold the source's full weights and optimizer state bit for bit (in
float64: ZeRO-3's weights are its float64 masters); training then follows the source's
continued run, losses and final state to EXACT (TP changes the summation order: measured
worst 0 on losses, 7.5e-16 on the state), bit for bit where TP is the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint.common import (
    HALF,
    ITERS,
    assert_close_state,
    assert_same_state,
    relayout,
    run_sequence,
)
from tests.distributed import run_ranks
from tests.numerics import EXACT, assert_close

STRATEGY = "--data-parallel-sharding-strategy"
LAYOUTS = {
    "dp4-optim_grads": ([STRATEGY, "optim_grads", "--ddp-bucket-size", "3000"], 1),
    "dp4-no_shard": ([STRATEGY, "no_shard"], 1),
    "tp2dp2-optim": (["--use-distributed-optimizer", "--tensor-model-parallel-size", "2"], 2),
    "tp2dp2-optim_grads": ([STRATEGY, "optim_grads", "--tensor-model-parallel-size", "2"], 2),
    "dp4-optim_grads_params": ([STRATEGY, "optim_grads_params"], 1),
}
"""name -> (flags, tp)."""
RESHARDS = [("dp4-optim_grads", "tp2dp2-optim"), ("dp4-optim_grads", "dp4-no_shard"),
            ("dp4-no_shard", "tp2dp2-optim_grads"), ("dp4-optim_grads", "dp4-optim_grads_params")]
SOURCES = ("dp4-optim_grads", "dp4-no_shard")


def _spawn(pstate, root: str) -> dict:
    root_path, out = Path(root), {}
    for name in SOURCES:
        flags, d = LAYOUTS[name][0], root_path / name
        out[name] = run_sequence(pstate, [[*flags, "--save", str(d / "a")],
                                          [*flags, "--save", str(d / "b"), "--exit-interval",
                                           str(HALF)],
                                          [*flags, "--save", str(d / "b")]])
    for source, target in RESHARDS:
        flags, tp = LAYOUTS[target]
        y = root_path / f"{source}->{target}"
        out[(source, target)] = run_sequence(relayout(pstate, tp, 1), [
            [*flags, "--load", str(root_path / source / "b"), "--ckpt-step", str(HALF),
             "--save", str(y), "--train-iters", str(HALF)],
            [*flags, "--save", str(y)]])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("sharding_layouts")
    ranks = run_ranks(_spawn, 4, root, timeout=300, root=str(root))
    assert all(r == ranks[0] for r in ranks)
    return ranks[0], root


@pytest.mark.parametrize("name", SOURCES)
def test_resume_is_bit_identical(runs, name: str) -> None:
    out, _ = runs
    full, first, resumed = out[name]
    assert len(full) == ITERS and len(first) == HALF
    assert first == full[:HALF] and resumed == full[HALF:]


@pytest.mark.parametrize("source,target", RESHARDS, ids=[f"{a}->{b}" for a, b in RESHARDS])
def test_reshard_between_strategies(runs, source: str, target: str) -> None:
    out, root = runs
    loaded, continued = out[(source, target)]
    assert loaded == []
    y, x = root / f"{source}->{target}", root / source / "b"
    assert_same_state(x / f"iter_{HALF:07d}", y / f"iter_{HALF:07d}")
    reference = out[source][2]
    assert len(continued) == len(reference) == ITERS - HALF
    assert_close(continued, reference, EXACT, "continued losses")
    assert_close_state(y / f"iter_{ITERS:07d}", x / f"iter_{ITERS:07d}")
    if LAYOUTS[target][1] == LAYOUTS[source][1]:
        assert continued == reference  # same TP: the strategy changes no rounding of the loss
