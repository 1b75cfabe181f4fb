"""A resume keeps the checkpoint's LR and weight-decay schedule unless told otherwise, as
Megatron's scheduler does: a changed --lr, length or style is refused by default,
--override-opt_param-scheduler continues on the new flags, --use-checkpoint-opt_param-scheduler
on the saved ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.checkpoint.files import CheckpointError
from megatron_lite.config import ConfigError
from megatron_lite.training import run

TINY = ["--mock-data", "--seed", "3", "--lr", "3e-3", "--eval-iters", "0", "--peak-tflops", "1",
        "--log-interval", "1", "--num-layers", "1", "--lr-warmup-iters", "1"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """Iteration 2 of a 4-iteration linear-decay run (the decay length is --train-iters)."""
    path = str(tmp_path_factory.mktemp("sched") / "ckpt")
    run(parse_config([*TINY, "--train-iters", "2", "--lr-decay-iters", "4", "--save", path]))
    return path


@pytest.mark.quick
@pytest.mark.parametrize("change, named", [
    (["--lr", "1e-3"], "--lr"),
    (["--lr-decay-iters", "8"], "decay samples"),
    (["--lr-decay-style", "cosine"], "--lr-decay-style"),
    (["--weight-decay", "0.1"], "--weight-decay"),
    (["--min-lr", "1e-5"], "--min-lr"),
])
def test_a_changed_schedule_is_refused_naming_it(saved, change, named) -> None:
    cfg = parse_config([*TINY, "--train-iters", "4", "--lr-decay-iters", "4", "--load", saved,
                        *change])
    with pytest.raises(CheckpointError, match="--override-opt_param-scheduler") as e:
        run(cfg)
    assert named in str(e.value) and "in the checkpoint" in str(e.value)


def _lrs(tmp_path: Path, name: str, flags: list[str]) -> tuple[list[float], list[float]]:
    """The logged LR and loss of each step of a run."""
    log = tmp_path / f"{name}.jsonl"
    run(parse_config([*flags, "--log-jsonl", str(log)]))
    steps = [r for r in map(json.loads, log.read_text().splitlines()) if "lr" in r]
    return [r["lr"] for r in steps], [r["loss"] for r in steps]


def test_override_runs_on_this_runs_flags_and_use_checkpoint_on_the_saved(saved,
                                                                         tmp_path) -> None:
    resume = [*TINY, "--train-iters", "4", "--lr-decay-iters", "4", "--load", saved]
    same, same_loss = _lrs(tmp_path, "same", resume)
    override, _ = _lrs(tmp_path, "override", [*resume, "--lr", "1e-3",
                                              "--override-opt_param-scheduler"])
    kept, kept_loss = _lrs(tmp_path, "kept", [*resume, "--lr", "1e-3",
                                              "--use-checkpoint-opt_param-scheduler"])
    # linear decay to 0 over 4 iterations after 1 of warm-up, at iterations 3 and 4
    assert same == pytest.approx([3e-3 * 2 / 3, 3e-3 * 1 / 3], rel=1e-12)
    assert override == pytest.approx([1e-3 * 2 / 3, 1e-3 * 1 / 3], rel=1e-12)
    assert kept == same and kept_loss == same_loss


def test_finetune_starts_a_new_schedule_and_both_flags_contradict(saved) -> None:
    tuned = run(parse_config([*TINY, "--train-iters", "1", "--lr", "1e-3", "--load", saved,
                              "--finetune"]))
    assert tuned.iteration == 1
    with pytest.raises(ConfigError, match="contradict"):
        parse_config([*TINY, "--override-opt_param-scheduler",
                      "--use-checkpoint-opt_param-scheduler"])
