"""Nothing non-finite is trained on or saved, and a lasting fault is never the new normal.

- Optimizer values that poison the first update are refused by name before anything starts.
- The update check (folded into the gradient norm's all-reduce) changes nothing in a normal
  run, bit for bit in float64, and a non-finite update proposed on one ZeRO-1 rank skips the
  step on both, exactly as --skip-iterations does.
- A save of non-finite state is refused before anything is written, so --save-keep-last 1
  keeps the last good checkpoint; with the check on, the run never gets there: it skips the
  poisoned updates and stops at the skip limit with one `error:` line.
- A spike carried by one rank names it, and lasting past --spike-accept-after it stops the run
  instead of becoming the new level; a rollback is a JSONL event with its iterations, cause
  and the LR back-off it applied (the LR sequence shows it).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_lite.arguments import parse_config
from megatron_lite.checkpoint import files as ckpt_files
from megatron_lite.config import ConfigError
from megatron_lite.errors import run_cli
from megatron_lite.optim.lr import step_lrs
from megatron_lite.parallel.state import single_process_state
from megatron_lite.reliability.guard import Guard
from megatron_lite.training import train
from tests.distributed import run_ranks
from tests.reliability.common import TINY, run_train

ZERO1 = ["--fp64", "--use-distributed-optimizer", "--train-iters", "5"]


def _two_ranks(pstate, tmp: str) -> dict:
    t = Path(tmp)
    return {
        # main's code path (no update check) with iteration 4 skipped by request ...
        "plain": run_train(pstate, [*ZERO1, "--no-check-for-nan-in-loss-and-grad",
                                    "--skip-iterations", "3"]),
        # ... and the check on, rank 1 alone proposing a NaN update at iteration 3
        "checked": run_train(pstate, ZERO1, fault="rank1:iter3:nan_update"),
        # from iteration 11 on, rank 1's loss is 20x: a rank's fault, not a new level
        "lasting": run_train(pstate, ["--train-iters", "14", "--spike-threshold", "5",
                                      "--spike-accept-after", "2",
                                      "--max-skipped-iterations-in-a-row", "3",
                                      "--log-jsonl", f"{t}/lasting.jsonl"],
                             fault="rank1:iter11-14:spike"),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[list[dict], Path]:
    tmp = tmp_path_factory.mktemp("finite")
    return run_ranks(_two_ranks, 2, tmp, tmp=str(tmp), timeout=180), tmp


@pytest.mark.quick
@pytest.mark.parametrize(("flags", "named"), [
    (["--lr", "nan"], "--lr nan must be a finite number >= 0"),
    (["--lr=-1e-3"], "--lr -0.001 must be a finite number >= 0"),
    (["--adam-eps", "0"], "--adam-eps 0.0 must be a finite number > 0"),
    (["--adam-beta1", "1"], "--adam-beta1 1.0 must be in [0, 1)"),
    (["--adam-beta2", "-0.1"], "--adam-beta2 -0.1 must be in [0, 1)"),
    (["--clip-grad", "inf"], "--clip-grad inf must be a finite number >= 0"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1 must be a finite number >= 0"),
    (["--min-lr", "nan"], "--min-lr nan must be a finite number >= 0"),
    (["--decoupled-lr", "inf"], "--decoupled-lr inf must be a finite number >= 0"),
])
def test_optimizer_values_that_poison_the_update_are_refused(flags, named) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config([*TINY, *flags])
    assert named in str(err.value)


def test_update_check_is_exact_and_a_one_rank_nan_update_skips_on_both(ranks) -> None:
    """Every step but the 3rd is bit-identical to the unchecked run that skipped the 3rd
    (so the check alters nothing, and rank 1's poisoned update changed no rank's weights)."""
    out, _ = ranks
    for rank, r in enumerate(out):
        plain, checked = r["plain"], r["checked"]
        assert plain.error is None and checked.error is None, (plain.error, checked.error)
        assert len(checked.losses) == 5 and plain.losses[2] != plain.losses[2]  # NaN: unseen
        assert [x for i, x in enumerate(checked.losses) if i != 2] == \
            [x for i, x in enumerate(plain.losses) if i != 2], rank
    assert "fault injection: rank 1 iteration 3: nan_update" in out[1]["checked"].output
    assert ("iteration 3: optimizer step skipped on every rank, nothing changed: the update "
            "would not be finite on rank 1 (") in out[0]["checked"].output
    assert "LR nan" in out[0]["checked"].output


def _single(flags: list[str], eps: float | None = None) -> object:
    """Train in this process; `eps` set after validation (as a corrupted value would be)."""
    cfg = parse_config([*TINY, *flags])
    if eps is not None:
        cfg.optim.adam_eps = eps
    with contextlib.redirect_stdout(io.StringIO()):
        return train(cfg, single_process_state())


def _finite(ckpt: Path) -> bool:
    return all(bool(torch.isfinite(t).all()) for f in ckpt.glob("*.safetensors")
               for t in load_file(f).values() if t.is_floating_point())


def test_a_non_finite_save_is_refused_and_the_last_good_checkpoint_kept(tmp_path) -> None:
    """Without the update check, eps 0 poisons the weights at iteration 4; the save of 6 is
    refused before writing, so --save-keep-last 1 cannot delete iteration 3."""
    save = ["--save", str(tmp_path), "--save-interval", "3", "--save-keep-last", "1"]
    _single(["--train-iters", "3", *save])
    with pytest.raises(ckpt_files.CheckpointError) as err:
        _single(["--train-iters", "6", *save, "--no-check-for-nan-in-loss-and-grad"], eps=0.0)
    text = str(err.value)
    assert f"refusing to save iteration 6 to {tmp_path}: non-finite values (NaN/Inf) in rank 0:" \
        in text and "the newest checkpoint there, iteration 3, is kept" in text
    assert ckpt_files.list_iterations(tmp_path) == [3]
    assert not list(tmp_path.glob("*.tmp")) and _finite(tmp_path / "iter_0000003")


def test_poisoned_updates_are_skipped_and_the_stop_is_one_error_line(tmp_path, capsys) -> None:
    """With the check on, every eps-0 update is skipped; the skip limit saves the (finite)
    weights and ends in one `error:` line naming the rank, the iteration and what to do."""
    flags = ["--train-iters", "8", "--max-skipped-iterations-in-a-row", "3", "--save",
             str(tmp_path)]
    code = run_cli(lambda argv: _single(flags, eps=0.0) and 0, [])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: stopped after iteration 3: 3 steps in a row were skipped")
    assert "the last at iteration 3: the update would not be finite on rank 0 (" in err[0]
    assert "To go on: check the named rank" in err[0]
    assert ckpt_files.list_iterations(tmp_path) == [3] and _finite(tmp_path / "iter_0000003")


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_lasting_one_rank_spike_names_it_and_stops_instead_of_being_accepted(ranks) -> None:
    out, tmp = ranks
    for r in out:
        assert r["lasting"].error is not None and r["lasting"].error.startswith(
            "SkipLimitError: stopped after iteration 13: 3 steps in a row"), r["lasting"].error
        assert "the last at iteration 13: a loss spike on rank 1 (its loss" in r["lasting"].error
    events = [e for e in _records(tmp / "lasting.jsonl") if "event" in e]
    assert [e["event"] for e in events] == ["spike"] * 3 + ["stop"]
    assert all(e["ranks"] == [1] for e in events[:3])
    assert "not taken as a new level" in out[0]["lasting"].output
    assert "accepted as the new level" not in out[0]["lasting"].output


def test_rollback_is_an_event_and_its_lr_back_off_is_in_the_lr_sequence(runs) -> None:
    """conftest's rollback run: spikes on rank 1 at 12-13, patience 2, back to 10, LR x0.5
    for --spike-lr-iters 6. The event names both iterations and the rank; every re-run step
    11-16 has half the schedule's LR, at the schedule's own sample position."""
    _, tmp = runs
    records = _records(tmp / "rb.jsonl")
    at = next(i for i, r in enumerate(records) if r.get("event") == "rollback")
    event = records[at]
    assert (event["from_iteration"], event["to_iteration"]) == (13, 10)
    assert "a loss spike on rank 1 (its loss" in event["reason"]
    cfg = parse_config([*TINY, "--train-iters", "16"])
    after = [r for r in records[at:] if "lr" in r]
    assert [r["iteration"] for r in after] == list(range(11, 17))
    for k, r in enumerate(after):  # the schedule restarts from iteration 10's 40 samples
        assert r["lr"] == pytest.approx(0.5 * step_lrs(40 + 4 * k, 4, cfg.optim, cfg.train)[0],
                                        rel=1e-12)
    before = [r for r in records[:at] if "lr" in r and r["iteration"] == 11]
    assert before[0]["lr"] == pytest.approx(step_lrs(40, 4, cfg.optim, cfg.train)[0], rel=1e-12)


@pytest.mark.parametrize(("iters", "claim", "scales"), [
    ("0", "LR unchanged", [1.0, 1.0]),
    ("2", "LR x0.5 through iteration 12", [0.5, 0.5, 1.0])])
def test_the_logged_lr_back_off_is_the_one_applied(tmp_path, capsys, iters, claim, scales
                                                   ) -> None:
    """A rollback to iteration 10 claims a lowered LR only when the next iterations get it."""
    cfg = parse_config([*TINY, "--spike-threshold", "5", "--on-spike", "rollback", "--save",
                        str(tmp_path), "--spike-lr-iters", iters])
    guard = Guard(cfg, single_process_state())

    class Loader:
        consumed_samples = 40

    guard.after_rollback(13, 10, 52, Loader())
    assert claim in capsys.readouterr().out
    assert [guard.before_step(i, 40).lr_scale for i in range(11, 11 + len(scales))] == scales
