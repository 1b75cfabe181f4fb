"""The LR of every step equals Megatron-LM's OptimizerParamScheduler, re-derived here.

`MegatronScheduler` is written from Megatron's definition, as Megatron runs it: a counter of
samples that starts at 0 (so the first step runs at --lr-warmup-init) and grows by each step's
global batch after the step; iteration-based lengths are converted to samples with
--global-batch-size. It shares no code with megatron_lite/optim/lr.py.
"""

from __future__ import annotations

import json
import math

import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.config import (
    ConfigError,
    OptimConfig,
    TrainConfig,
    batch_schedule,
    global_batch_at,
    schedule_lengths,
    validate,
)
from megatron_lite.optim.lr import lr_at
from megatron_lite.training import run

TINY = ["--mock-data", "--seed", "7", "--eval-iters", "0", "--peak-tflops", "1",
        "--micro-batch-size", "2", "--log-interval", "1"]


class MegatronScheduler:
    """Megatron's scheduler state machine: lengths in samples, `num_steps` consumed samples."""

    def __init__(self, init: float, peak: float, floor: float, warmup: float, decay: int,
                 style: str, wsd: int | None = None, wsd_style: str = "exponential") -> None:
        self.init, self.peak, self.floor = init, peak, floor
        self.warmup, self.decay, self.style = warmup, decay, style
        self.wsd, self.wsd_style = wsd, wsd_style
        self.num_steps = 0

    def step(self, increment: int) -> None:
        self.num_steps += increment

    def lr(self) -> float:
        n = self.num_steps
        if self.warmup > 0 and n <= self.warmup:
            return self.init + (self.peak - self.init) * float(n) / float(self.warmup)
        if self.style == "constant":
            return self.peak
        if n > self.decay:
            return self.floor
        if self.style == "inverse-square-root":
            return max(self.floor, self.peak * max(self.warmup, 1) ** 0.5 / max(n, 1) ** 0.5)
        ratio = float(n - self.warmup) / float(self.decay - self.warmup)
        assert 0.0 <= ratio <= 1.0
        if self.style == "linear":
            coeff = 1.0 - ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            assert self.style == "WSD" and self.wsd is not None
            start = self.decay - self.wsd
            r = float(n - start) / float(self.wsd)
            coeff = 1.0 if n <= start else {
                "linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                "exponential": 2.0 * math.pow(0.5, r) - 1.0, "minus_sqrt": 1.0 - math.sqrt(r),
            }[self.wsd_style]
        return self.floor + coeff * (self.peak - self.floor)


def megatron_from_flags(o: OptimConfig, t: TrainConfig, gbs: int) -> MegatronScheduler:
    """Megatron's get_optimizer_param_scheduler: iterations x --global-batch-size, or the
    sample flags; --lr-warmup-fraction times the decay samples, kept fractional."""
    if t.train_samples is None:
        decay = (o.lr_decay_iters or t.train_iters) * gbs
        warmup = o.lr_warmup_iters * gbs
        wsd = None if o.lr_wsd_decay_iters is None else o.lr_wsd_decay_iters * gbs
    else:
        decay = o.lr_decay_samples or t.train_samples
        warmup, wsd = o.lr_warmup_samples, o.lr_wsd_decay_samples
    if o.lr_warmup_fraction is not None:
        warmup = o.lr_warmup_fraction * decay
    return MegatronScheduler(o.lr_warmup_init, o.lr, o.min_lr, warmup, decay, o.lr_decay_style,
                             wsd, o.lr_wsd_decay_style)


def assert_every_step(o: OptimConfig, t: TrainConfig, gbs: int, batches: list[int]) -> None:
    """Ours at the samples consumed before each step == Megatron's scheduler after the
    increments of the steps before it (float64, to the last bits)."""
    ref, lengths, consumed = megatron_from_flags(o, t, gbs), schedule_lengths(o, t, gbs), 0
    for k, batch in enumerate(batches):
        assert abs(lr_at(consumed, o, lengths) - ref.lr()) <= 1e-15, (k, consumed)
        ref.step(batch)
        consumed += batch


STYLES = [("constant", "exponential"), ("linear", "exponential"), ("cosine", "exponential"),
          ("inverse-square-root", "exponential"), ("WSD", "exponential"), ("WSD", "linear"),
          ("WSD", "cosine"), ("WSD", "minus_sqrt")]


@pytest.mark.quick
@pytest.mark.parametrize(("style", "wsd_style"), STYLES)
@pytest.mark.parametrize("warmup", [0, 7])
def test_iteration_based_every_step(style: str, wsd_style: str, warmup: int) -> None:
    o = OptimConfig(lr=1e-3, min_lr=1e-5, lr_warmup_init=1e-4, lr_warmup_iters=warmup,
                    lr_decay_iters=50, lr_decay_style=style, lr_wsd_decay_iters=12,
                    lr_wsd_decay_style=wsd_style)
    assert_every_step(o, TrainConfig(train_iters=60), 8, [8] * 60)  # 10 steps past the decay


@pytest.mark.parametrize(("style", "wsd_style"), STYLES)
def test_sample_based_every_step_with_fractional_warmup(style: str, wsd_style: str) -> None:
    o = OptimConfig(lr=2e-3, min_lr=1e-4, lr_warmup_fraction=0.137, lr_decay_samples=300,
                    lr_decay_style=style, lr_wsd_decay_samples=90, lr_wsd_decay_style=wsd_style)
    t = TrainConfig(train_samples=360, global_batch_size=6)
    assert schedule_lengths(o, t, 6).warmup == 0.137 * 300  # not truncated to whole samples
    assert_every_step(o, t, 6, [6] * t.train_iters)


@pytest.mark.parametrize("style", ["cosine", "inverse-square-root"])
def test_rampup_every_step(style: str) -> None:
    """Under a ramp-up the counter grows by each step's batch, iteration-based lengths still
    count --global-batch-size per iteration (Megatron's conversion)."""
    t = TrainConfig(train_iters=30, global_batch_size=8, rampup_batch_size=[2, 2, 40])
    o = OptimConfig(lr=1e-3, min_lr=1e-5, lr_warmup_iters=3, lr_decay_style=style)

    batches, consumed = [], 0
    for _ in range(t.train_iters):
        batches.append(global_batch_at(t, consumed))
        consumed += batches[-1]
    assert batches[0] == 2 and batches[-1] == 8
    assert_every_step(o, t, 8, batches)


def test_warmup_starts_at_init_as_in_megatron() -> None:
    """The issue's numbers: warm-up 5 from 0 to 1e-3 gives 0, 2e-4, 4e-4, ... then decays."""
    o = OptimConfig(lr=1e-3, lr_warmup_iters=5)
    lengths = schedule_lengths(o, TrainConfig(train_iters=10), 4)
    got = [lr_at(4 * k, o, lengths) for k in range(7)]
    assert got == pytest.approx([0.0, 2e-4, 4e-4, 6e-4, 8e-4, 1e-3, 8e-4], abs=1e-18)


def test_megatron_defaults_and_spellings() -> None:
    o = OptimConfig()
    assert (o.lr_decay_style, o.lr_wsd_decay_style, o.lr_warmup_init, o.min_lr) == (
        "linear", "exponential", 0.0, 0.0)
    assert OptimConfig(lr_decay_style="wsd").lr_decay_style == "WSD"
    cfg = parse_config(["--lr-decay-style", "WSD", "--train-iters", "10"])
    with pytest.raises(ConfigError, match="--lr-wsd-decay-iters"):
        validate(cfg, 1)
    cfg = parse_config(["--train-samples", "40", "--global-batch-size", "4",
                        "--lr-warmup-iters", "2"])
    with pytest.raises(ConfigError, match="--lr-warmup-iters does not apply to a --train-s"):
        validate(cfg, 1)
    long_warmup = parse_config(["--train-iters", "4", "--lr-warmup-iters", "8", "--lr", "1"])
    validate(long_warmup, 1)  # Megatron refuses it; here a smoke run of a long warm-up starts
    lengths = schedule_lengths(long_warmup.optim, long_warmup.train, 2)
    assert [lr_at(2 * k, long_warmup.optim, lengths) for k in range(4)] == [0, 1 / 8, 2 / 8, 3 / 8]


def test_rampup_bounded_by_train_samples_end_to_end(tmp_path) -> None:
    """The issue's ramp (2 2 30, --global-batch-size 8, --train-samples 10) takes Megatron's 6
    steps and 14 samples, and the logged LR of every step is Megatron's."""
    log = tmp_path / "log.jsonl"
    flags = [*TINY, "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "30",
             "--train-samples", "10", "--lr", "1e-3", "--min-lr", "1e-5", "--lr-warmup-samples",
             "5", "--lr-warmup-init", "1e-4", "--lr-decay-style", "cosine",
             "--log-jsonl", str(log)]
    cfg = parse_config(flags)
    assert cfg.train.train_iters == 6
    assert len(run(cfg).losses) == 6
    steps = [r for r in map(json.loads, log.read_text().splitlines()) if "lr" in r]
    assert [r["global_batch_size"] for r in steps] == [2, 2, 2, 2, 2, 4]
    assert steps[-1]["consumed_samples"] == 14
    ref = MegatronScheduler(1e-4, 1e-3, 1e-5, 5, 10, "cosine")
    for r in steps:
        assert r["lr"] == pytest.approx(ref.lr(), rel=1e-12, abs=0.0)
        ref.step(r["global_batch_size"])


def logged_steps(flags: list[str], tmp_path) -> list[dict]:
    """The JSONL step records of a run of `flags` (one per step: --log-interval 1)."""
    tmp_path.mkdir(exist_ok=True)
    log = tmp_path / "log.jsonl"
    cfg = parse_config([*TINY, *flags, "--log-jsonl", str(log)])
    run(cfg)
    return [r for r in map(json.loads, log.read_text().splitlines()) if "lr" in r]


def test_step_batch_size_schedule_parses_as_megatron() -> None:
    """Thresholds in tokens (floor-divided by --seq-length), suffixes, commas, sorted."""
    cfg = parse_config(["--step-batch-size-schedule", "2k:16, 0:4 1K:8", "--seq-length", "64",
                        "--train-samples", "100"])
    assert batch_schedule(cfg.train.step_batch_size_schedule, 64) == ((0, 4), (15, 8), (31, 16))
    assert [global_batch_at(cfg.train, c, 64) for c in (0, 14, 15, 30, 31, 99)] == [
        4, 4, 8, 8, 16, 16]
    # Megatron's count: steps while fewer than --train-samples are consumed
    assert cfg.train.train_iters == 4 + 2 + 5  # to 16 by 4, to 32 by 8, to 112 by 16
    for bad, match in ((["--global-batch-size", "8"], "drop --global-batch-size"),
                       ([], "first threshold must be 0")):
        with pytest.raises(ConfigError, match=match):
            schedule = "0:4 64:8" if bad else "1:4"
            parse_config(["--step-batch-size-schedule", schedule, *bad])
    with pytest.raises(ConfigError, match="thresholds must increase"):
        parse_config(["--step-batch-size-schedule", "0:4 10:8", "--seq-length", "64"])
    with pytest.raises(ConfigError, match="multiples of --micro-batch-size"):
        validate(parse_config(["--step-batch-size-schedule", "0:3 1K:8"]), 1)


@pytest.mark.parametrize("by_samples", [True, False])
def test_step_batch_size_schedule_end_to_end(by_samples: bool, tmp_path) -> None:
    """Batches 2, then 4 from 256 tokens (4 samples), then 8 from 640 (10 samples); the LR of
    every step is Megatron's: sample lengths, or iterations x micro x dp (= 2) samples."""
    flags = ["--step-batch-size-schedule", "0:2 256:4 640:8", "--lr", "1e-3", "--min-lr",
             "1e-5", "--lr-warmup-init", "1e-4", "--lr-decay-style", "cosine"]
    if by_samples:
        steps = logged_steps([*flags, "--train-samples", "30", "--lr-warmup-samples", "6"],
                             tmp_path)
        ref = MegatronScheduler(1e-4, 1e-3, 1e-5, 6, 30, "cosine")
    else:
        steps = logged_steps([*flags, "--train-iters", "7", "--lr-warmup-iters", "3",
                              "--lr-decay-iters", "12"], tmp_path)
        ref = MegatronScheduler(1e-4, 1e-3, 1e-5, 3 * 2, 12 * 2, "cosine")
    assert [r["global_batch_size"] for r in steps] == [2, 2, 4, 4, 8, 8, 8]
    assert steps[-1]["consumed_samples"] == 36
    for r in steps:
        assert r["lr"] == pytest.approx(ref.lr(), rel=1e-12, abs=0.0)
        ref.step(r["global_batch_size"])


def test_skipped_step_holds_the_lr_and_resume_continues_it(tmp_path) -> None:
    """A skipped step (--skip-iterations 2) consumes its batch but, as in Megatron, does not
    advance the schedule; a run resumed after it (from iteration 3's checkpoint) logs the same
    LR sequence as the uninterrupted one, both Megatron's."""
    flags = ["--train-iters", "6", "--lr", "1e-3", "--lr-warmup-iters", "2",
             "--lr-warmup-init", "1e-4", "--skip-iterations", "2"]
    full = logged_steps(flags, tmp_path / "a")
    save = ["--save", str(tmp_path / "ckpt")]
    first = logged_steps([*flags, *save, "--exit-interval", "3"], tmp_path / "b")
    resumed = logged_steps([*flags, *save], tmp_path / "c")
    assert [r["iteration"] for r in first + resumed] == list(range(1, 7))
    assert [r["lr"] for r in first + resumed] == [r["lr"] for r in full]
    ref = MegatronScheduler(1e-4, 1e-3, 0.0, 2 * 2, 6 * 2, "linear")  # global batch 2
    for r in full:
        assert r["lr"] == pytest.approx(ref.lr(), rel=1e-12, abs=0.0)
        if r["iteration"] != 2:
            ref.step(2)
