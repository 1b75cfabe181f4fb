"""The planned epochs at start-up (and its warnings), and `epoch` / `tokens_seen` in the JSONL,
the same after a resume as in one run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.data.test_node_local_resume import _cfg, _single
from tests.data.test_training_data import _corpus

PER_EPOCH = 118
"""Samples of 16 + 1 tokens in the two uneven shards of `_corpus(..., 2)` (train split 100%)."""


def _plan(out: str) -> list[str]:
    """The plan and its warnings (not the per-rank `data: rank R scanned/built` lines)."""
    return [line for line in out.splitlines()
            if line.startswith(("data:", "warning: ")) and not line.startswith("data: rank ")]


@pytest.mark.parametrize(("iters", "full_pass", "expected"), [
    (8, False, ["data: 64 training samples planned (8 steps) over 118 samples per epoch = "
                "0.542 epochs"]),
    (200, False, ["data: 1,600 training samples planned (200 steps) over 118 samples per "
                  "epoch = 13.6 epochs", "warning: the run would see its training data 13.6 "
                  "times (more than 4)"]),
    (2, True, ["data: 16 training samples planned (2 steps) over 118 samples per epoch = "
               "0.136 epochs", "warning: --expect-full-pass, but the run covers only 0.136 of "
               "its training data (16 of 118 samples); raise --train-iters to at least 15"]),
])
def test_planned_epochs_and_warnings(tmp_path: Path, iters: int, full_pass: bool,
                                     expected: list[str]) -> None:
    cfg = _cfg(_corpus(tmp_path / "c", 2), str(tmp_path), save="s")
    cfg.checkpoint.save, cfg.checkpoint.exit_interval = None, 1  # planned, one step run
    cfg.train.train_iters, cfg.data.expect_full_pass = iters, full_pass
    lines = _plan(_single(cfg)[1])
    assert len(lines) == len(expected)
    assert all(line.startswith(want) for line, want in zip(lines, expected)), lines


def _records(path: Path) -> dict[int, dict]:
    return {r["iteration"]: r for r in map(json.loads, path.read_text().splitlines())
            if "loss" in r}


@pytest.mark.quick
def test_epoch_and_tokens_seen_survive_a_resume(tmp_path: Path) -> None:
    data = _corpus(tmp_path / "c", 2)
    whole = _cfg(data, str(tmp_path), save="whole")
    whole.logging.log_jsonl = str(tmp_path / "whole.jsonl")
    _single(whole)
    first = _cfg(data, str(tmp_path), save="part", exit_at=4)
    first.logging.log_jsonl = str(tmp_path / "part.jsonl")
    _single(first)
    resumed = _cfg(data, str(tmp_path), save="part2", load="part", step=4)
    resumed.logging.log_jsonl = str(tmp_path / "part.jsonl")
    _single(resumed)
    a, b = _records(tmp_path / "whole.jsonl"), _records(tmp_path / "part.jsonl")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for i in range(1, 9):
        assert b[i]["tokens_seen"] == a[i]["tokens_seen"] == i * 8 * 16
        assert b[i]["epoch"] == a[i]["epoch"] == pytest.approx(i * 8 / PER_EPOCH)
