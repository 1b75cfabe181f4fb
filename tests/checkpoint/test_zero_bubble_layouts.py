"""A checkpoint saved under ZBV (two chunks per stage in a V, the tied embedding and head on
stage 0) resumes under 1F1B and the other way round, from one 2-rank spawn.

Per schedule X: `a` = 6 iterations uninterrupted; `b` = 3 iterations (--exit-interval 3),
then resumed to 6. A reshard X -> Y loads X's `b`@3 into Y, saves it at once (no step), then
continues to 6 in Y.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.checkpoint.common import assert_same_state, run_sequence
from tests.distributed import run_ranks

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
                                          [*extra, "--save", str(b), "--exit-interval", "3"],
                                          [*extra, "--save", str(b)]])
    for source, target in PAIRS:
        y = root_path / f"{source}->{target}"
        out[f"{source}->{target}"] = run_sequence(pstate, [
            [*SCHEDULES[target], "--load", str(root_path / source / "b"), "--ckpt-step", "3",
             "--save", str(y), "--train-iters", "3"],
            [*SCHEDULES[target], "--save", str(y)]])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("zero_bubble_layouts")
    ranks = run_ranks(_runs, 2, root, pp=2, timeout=240, root=str(root))
    assert all(r == ranks[0] for r in ranks)
    return ranks[0], root


def test_zbv_checkpoint_records_the_v_and_resumes_bit_identical(runs) -> None:
    out, root = runs
    meta = json.loads((root / "pp2-zbv" / "b" / "iter_0000003" / "metadata.json").read_text())
    assert meta["partition"] == [[[0], [3]], [[1], [2]]]
    assert meta["layout"]["virtual_chunks"] == 2
    full, first, resumed = out["pp2-zbv"]
    assert first == full[:3] and resumed == full[3:]  # exact float equality
    assert_same_state(root / "pp2-zbv" / "a" / "iter_0000006",
                      root / "pp2-zbv" / "b" / "iter_0000006")


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_reshard_between_zbv_and_1f1b(runs, source: str, target: str) -> None:
    """The full weights and optimizer state come back bit for bit in the other schedule's
    layout, at the same data position, and training continues as in the source schedule."""
    out, root = runs
    loaded, continued_y = out[f"{source}->{target}"]
    continued_x = out[source][2]
    assert loaded == []
    saved = root / source / "b" / "iter_0000003"
    resharded = root / f"{source}->{target}" / "iter_0000003"
    assert_same_state(saved, resharded)
    for ckpt in (saved, resharded):
        meta = json.loads((ckpt / "metadata.json").read_text())
        assert (meta["iteration"], meta["consumed_samples"]) == (3, 12)
    assert len(continued_y) == len(continued_x) == 3
    for a, b in zip(continued_y, continued_x):
        assert abs(a - b) <= 1e-5 * abs(b), (continued_y, continued_x)
