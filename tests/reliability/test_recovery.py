"""Bounded automatic recovery on two gloo ranks: a rank that makes NaNs on every step stops the
run after --max-skipped-iterations-in-a-row with a checkpoint, a total budget stops scattered
skips, a lasting loss level shift is accepted after --spike-accept-after, and every skip,
recovery and stop is a timestamped event in the JSONL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_lite.checkpoint import files as ckpt_files
from tests.distributed import run_ranks
from tests.reliability.common import ROOT, TINY, run_train


def _runs(pstate, tmp: str) -> dict:
    t = Path(tmp)
    r = {}
    # rank 1 makes a NaN gradient on every step
    r["nan"] = run_train(pstate, ["--train-iters", "20", "--max-skipped-iterations-in-a-row",
                                  "4", "--save", f"{t}/nan", "--save-interval", "100",
                                  "--log-jsonl", f"{t}/nan.jsonl"],
                         fault="rank1:iter1-20:nan_grad")
    # scattered NaNs, trained on in between: only the total budget stops them
    r["budget"] = run_train(pstate, ["--train-iters", "20", "--max-skipped-iterations", "3",
                                     "--log-jsonl", f"{t}/budget.jsonl"],
                            fault="rank0:iter3:nan_loss,rank0:iter6:nan_loss,"
                                  "rank0:iter9:nan_loss")
    # from iteration 12 on, every rank's loss is 20x: a lasting new level, not an outlier
    shift = ["--train-iters", "18", "--spike-threshold", "5", "--log-interval", "1"]
    r["accept"] = run_train(pstate, [*shift, "--spike-accept-after", "3", "--log-jsonl",
                                     f"{t}/accept.jsonl"],
                            fault="rank0:iter12-18:spike,rank1:iter12-18:spike")
    r["no_accept"] = run_train(pstate, [*shift, "--spike-accept-after", "0",
                                        "--max-skipped-iterations-in-a-row", "5",
                                        "--log-jsonl", f"{t}/no_accept.jsonl"],
                               fault="rank1:iter12-18:spike")
    return r


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], Path]:
    tmp = tmp_path_factory.mktemp("recovery")
    return run_ranks(_runs, 2, tmp, tmp=str(tmp), timeout=240), tmp


def _records(path: Path) -> tuple[list[dict], list[dict]]:
    """(train records, event records) of a JSONL file."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    events = [r for r in records if "event" in r]
    return [r for r in records if "loss" in r], events


def test_nan_on_every_step_stops_after_n_with_a_checkpoint(runs) -> None:
    out, tmp = runs
    for rank in (0, 1):  # every rank stops, with the reason
        o = out[rank]["nan"]
        assert o.error is not None and o.error.startswith("SkipLimitError: stopped after "
                                                          "iteration 4: 4 steps in a row")
        assert "--max-skipped-iterations-in-a-row 4" in o.error and "4 for NaN/Inf" in o.error
    assert ckpt_files.list_iterations(tmp / "nan") == [4]  # saved before stopping
    meta = ckpt_files.read_metadata(tmp / "nan" / "iter_0000004")
    assert meta["consumed_samples"] == 16  # the 4 skipped batches were consumed
    _, events = _records(tmp / "nan.jsonl")
    assert [e["event"] for e in events] == ["nan_skip"] * 4 + ["stop"]
    assert [e["iteration"] for e in events] == [1, 2, 3, 4, 4]
    assert "rank 1" in events[0]["found"] and "a gradient" in events[0]["found"]
    assert all(abs(e["time"] - time.time()) < 600 for e in events)
    assert "stopping after iteration 4" in out[0]["nan"].output


def test_total_skip_budget_and_recovery_events(runs) -> None:
    out, tmp = runs
    err = out[0]["budget"].error
    assert err is not None and "stopped after iteration 9: 3 steps were skipped in all " \
        "(--max-skipped-iterations 3)" in err
    _, events = _records(tmp / "budget.jsonl")
    assert [(e["event"], e["iteration"]) for e in events] == [
        ("nan_skip", 3), ("recovered", 4), ("nan_skip", 6), ("recovered", 7), ("nan_skip", 9),
        ("stop", 9)]
    assert events[1]["after_skipped"] == 1


def test_level_shift_is_accepted_after_k_spikes(runs) -> None:
    out, tmp = runs
    assert out[0]["accept"].error is None and out[0]["accept"].iteration == 18
    trains, events = _records(tmp / "accept.jsonl")
    assert [(e["event"], e["iteration"]) for e in events] == [
        ("spike", 12), ("spike", 13), ("spike_level_accepted", 14), ("recovered", 14)]
    accepted = events[2]
    assert accepted["spikes_in_a_row"] == 3 and accepted["spike_loss"] > accepted["limit"]
    skipped = {r["iteration"]: r for r in trains}
    assert all(skipped[i]["loss"] > 5 * skipped[11]["loss"] for i in range(12, 19))
    assert "accepted as the new level" in out[0]["accept"].output
    # without it every later step is a spike: the in-a-row limit ends the run instead
    err = out[0]["no_accept"].error
    assert err is not None and "stopped after iteration 16: 5 steps in a row" in err
    _, events = _records(tmp / "no_accept.jsonl")
    assert [e["event"] for e in events] == ["spike"] * 5 + ["stop"]


def test_every_train_record_has_waits_tokens_and_epoch(runs) -> None:
    _, tmp = runs
    trains, _ = _records(tmp / "accept.jsonl")
    assert len(trains) == 18
    for r in trains:
        assert {"data_wait_ms", "comm_wait_ms", "tokens_seen", "epoch"} <= set(r)
        assert r["tokens_seen"] == r["consumed_samples"] * 16 == r["iteration"] * 4 * 16
        assert r["comm_wait_ms"] > 0  # two ranks: the DP all-reduces are waited for


def test_pretrain_exits_non_zero_when_the_budget_is_spent(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_LITE_FAULT": "rank0:iter1-9:nan_loss"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "pretrain.py", *TINY, "--train-iters", "9",
                           "--max-skipped-iterations-in-a-row", "3", "--save",
                           str(tmp_path / "ckpt")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2  # one `error:` line, no traceback
    assert "error: stopped after iteration 3: 3 steps in a row" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert ckpt_files.list_iterations(tmp_path / "ckpt") == [3]
