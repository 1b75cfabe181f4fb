"""A checkpoint saved under ZBV (two chunks per stage in a V, the tied embedding and head on
stage 0) resumes under 1F1B and the other way round, from one 2-rank spawn.

Per schedule X: `a` = ITERS iterations uninterrupted; `b` = HALF iterations
(--exit-interval), then resumed to ITERS. A reshard X -> Y loads X's `b`@HALF into Y, saves it
at once (no step), then continues to ITERS in Y. Float64 throughout: the resume is bit for
bit, the reshard's continued losses and final state follow X's to EXACT (measured: losses
0, state 3.4e-16; ZBV and 1F1B sum the tied embedding's two gradients in another order).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.checkpoint.common import (
    HALF,
    HALF_SAMPLES,
    ITERS,
    assert_close_state,
    assert_same_state,
    run_sequence,
)
from tests.distributed import run_ranks
from tests.numerics import EXACT, assert_close

SCHEDULES = {
    "pp2-1f1b": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"],
    "pp2-zbv": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"],
}
PAIRS = [("pp2-zbv", "pp2-1f1b"), ("pp2-1f1b", "pp2-zbv")]


def _runs(pstate, root: str) -> dict:
    root_path, out = Path(root), {}
    for name, extra in SCHEDULES.items():
        b = root_path / name / "b"
        out[name] = run_sequence(pstate, [[*extra, "--save", str(root_path / name / "a")],
                                          [*extra, "--save", str(b), "--exit-interval",
                                           str(HALF)],
                                          [*extra, "--save", str(b)]])
    for source, target in PAIRS:
        y = root_path / f"{source}->{target}"
        out[f"{source}->{target}"] = run_sequence(pstate, [
            [*SCHEDULES[target], "--load", str(root_path / source / "b"), "--ckpt-step",
             str(HALF), "--save", str(y), "--train-iters", str(HALF)],
            [*SCHEDULES[target], "--save", str(y)]])
    return out


def _it(i: int) -> str:
    return f"iter_{i:07d}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("zero_bubble_layouts")
    ranks = run_ranks(_runs, 2, root, pp=2, timeout=240, root=str(root))
    assert all(r == ranks[0] for r in ranks)
    return ranks[0], root


@pytest.mark.quick
def test_zbv_checkpoint_records_the_v_and_resumes_bit_identical(runs) -> None:
    out, root = runs
    meta = json.loads((root / "pp2-zbv" / "b" / _it(HALF) / "metadata.json").read_text())
    assert meta["partition"] == [[[0], [3]], [[1], [2]]]
    assert meta["layout"]["virtual_chunks"] == 2
    full, first, resumed = out["pp2-zbv"]
    assert len(full) == ITERS and len(first) == HALF
    assert first == full[:HALF] and resumed == full[HALF:]  # exact float equality
    assert_same_state(root / "pp2-zbv" / "a" / _it(ITERS), root / "pp2-zbv" / "b" / _it(ITERS))


@pytest.mark.quick
@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_reshard_between_zbv_and_1f1b(runs, source: str, target: str) -> None:
    """The full weights and optimizer state come back bit for bit in the other schedule's
    layout, at the same data position, and training continues as in the source schedule."""
    out, root = runs
    loaded, continued_y = out[f"{source}->{target}"]
    continued_x = out[source][2]
    assert loaded == []
    saved = root / source / "b" / _it(HALF)
    resharded = root / f"{source}->{target}" / _it(HALF)
    assert_same_state(saved, resharded)
    for ckpt in (saved, resharded):
        meta = json.loads((ckpt / "metadata.json").read_text())
        assert (meta["iteration"], meta["consumed_samples"]) == (HALF, HALF_SAMPLES)
    assert len(continued_y) == len(continued_x) == ITERS - HALF
    assert_close(continued_y, continued_x, EXACT, "continued losses")
    assert_close_state(root / f"{source}->{target}" / _it(ITERS), root / source / "b" / _it(ITERS))
