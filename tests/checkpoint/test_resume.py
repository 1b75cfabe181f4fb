"""Exact resume: interrupted at iteration 3 and resumed = uninterrupted, bit for bit."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.checkpoint.common import LAYOUTS, run_sequence
from tests.distributed import run_ranks


def _same_files(a, b) -> None:
    """Every tensor of every file (weights, optimizer shards, RNG) equal; same file set."""
    files_a = json.loads((a / "metadata.json").read_text())["files"]
    files_b = json.loads((b / "metadata.json").read_text())["files"]
    assert sorted(files_a) == sorted(files_b)
    for name in files_a:
        ta, tb = load_file(a / name), load_file(b / name)
        assert sorted(ta) == sorted(tb), name
        for key in ta:
            assert ta[key].equal(tb[key]), (name, key)


@pytest.mark.parametrize("layout", ["single", "tp2", "pp2-v2", "dp2-zero1"])
def test_resume_is_bit_identical(tmp_path, layout: str) -> None:
    extra, world, tp, pp = LAYOUTS[layout]
    a, b = tmp_path / "a", tmp_path / "b"
    runs = [[*extra, "--save", str(a)],
            [*extra, "--save", str(b), "--exit-interval", "3"],
            [*extra, "--save", str(b)]]
    results = run_ranks(run_sequence, world, tmp_path, tp=tp, pp=pp, runs=runs)
    full, first, resumed = results[0]
    assert len(full) == 6 and len(first) == 3 and len(resumed) == 3
    assert first == full[:3]
    assert resumed == full[3:], (resumed, full)  # exact float equality
    assert (b / "latest").read_text().strip() == "iter_0000006"
    _same_files(a / "iter_0000006", b / "iter_0000006")
    meta = json.loads((b / "iter_0000003" / "metadata.json").read_text())
    assert meta["iteration"] == 3 and meta["consumed_samples"] == 12
    assert meta["layout"]["tp"] == tp and meta["layout"]["pp"] == pp
