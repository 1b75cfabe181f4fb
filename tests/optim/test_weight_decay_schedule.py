"""Megatron's weight-decay increment (--weight-decay-incr-style linear/cosine from
--start-weight-decay to --end-weight-decay over the training samples): the value of every
step equals Megatron's get_wd, re-derived here as a counter of samples, and training applies it."""

from __future__ import annotations

import math

import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.checkpoint.files import CheckpointError
from megatron_lite.config import ConfigError
from megatron_lite.optim.lr import weight_decay_at
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.training import run

TINY = ["--mock-data", "--seed", "5", "--eval-iters", "0", "--peak-tflops", "1", "--fp64",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--num-layers", "1",
        "--lr", "1e-2", "--log-interval", "1"]
RAMP = ["--start-weight-decay", "0.0", "--end-weight-decay", "0.5"]


def megatron_wd(num_steps: int, incr_steps: int, start: float, end: float, style: str) -> float:
    """Megatron's get_wd: `num_steps` samples consumed before the step, `incr_steps` the
    training samples."""
    if num_steps > incr_steps:
        return end
    ratio = num_steps / incr_steps
    coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
    return start + coeff * (end - start)


@pytest.mark.quick
@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_every_steps_weight_decay_is_megatrons(style) -> None:
    cfg = parse_config([*TINY, "--train-iters", "6", "--weight-decay-incr-style", style,
                        "--start-weight-decay", "0.01", "--end-weight-decay", "0.1"])
    for k in range(8):  # two steps past the end keep the end value
        ours = weight_decay_at(4 * k, 4, cfg.optim, cfg.train)
        assert ours == pytest.approx(megatron_wd(4 * k, 24, 0.01, 0.1, style), rel=1e-12)
    samples = parse_config([*TINY, "--train-samples", "10", "--weight-decay-incr-style", style,
                            *RAMP])
    assert weight_decay_at(5, 4, samples.optim, samples.train) == pytest.approx(
        megatron_wd(5, 10, 0.0, 0.5, style), rel=1e-12)


def test_training_applies_the_ramp(monkeypatch) -> None:
    """The optimizer is handed Megatron's value at each step; a ramp from 0 trains like no
    decay until its first non-zero value, then not."""
    seen: list[float | None] = []
    step = Optimizer.step

    def record(self, lr, decoupled_lr=None, weight_decay=None):
        seen.append(weight_decay)
        return step(self, lr, decoupled_lr, weight_decay)

    monkeypatch.setattr(Optimizer, "step", record)
    ramp = run(parse_config([*TINY, "--train-iters", "4", "--weight-decay-incr-style", "linear",
                             *RAMP])).losses
    assert seen == pytest.approx([megatron_wd(4 * k, 16, 0.0, 0.5, "linear")
                                  for k in range(4)], rel=1e-12)
    none = run(parse_config([*TINY, "--train-iters", "4", "--weight-decay", "0"])).losses
    assert ramp[:2] == none[:2]  # step 1 decays by 0: the weights of step 2 are the same
    assert ramp[2] != none[2]


def test_bad_pairs_are_refused_and_a_changed_ramp_on_resume(tmp_path) -> None:
    with pytest.raises(ConfigError, match="--weight-decay-incr-style linear needs both"):
        parse_config([*TINY, "--weight-decay-incr-style", "linear", "--end-weight-decay", "1"])
    with pytest.raises(ConfigError, match="add --weight-decay-incr-style"):
        parse_config([*TINY, *RAMP])
    with pytest.raises(ConfigError, match="0 <= start <= end"):
        parse_config([*TINY, "--weight-decay-incr-style", "cosine",
                      "--start-weight-decay", "0.2", "--end-weight-decay", "0.1"])
    flags = [*TINY, "--train-iters", "2", "--lr-decay-iters", "4",
             "--weight-decay-incr-style", "linear", *RAMP, "--save", str(tmp_path)]
    run(parse_config(flags))
    with pytest.raises(CheckpointError, match="--weight-decay-incr-style"):
        run(parse_config([*flags[:-1], str(tmp_path), "--end-weight-decay", "0.3"]))
