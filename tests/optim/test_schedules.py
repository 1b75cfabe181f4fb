"""Megatron's sample-based LR schedule, --train-samples, the batch-size ramp-up and
--decoupled-lr."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from megatron_lite.arguments import parse_config
from megatron_lite.config import (
    ConfigError,
    OptimConfig,
    TrainConfig,
    global_batch_at,
    schedule_lengths,
)
from megatron_lite.optim.lr import lr_at
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel.state import single_process_state
from megatron_lite.training import StepRunner, build_model, global_token_count, run
from tests.numerics import assert_all_close
from tests.optim.common import make_config, step_batches

TINY = ["--mock-data", "--seed", "7", "--lr", "3e-3", "--eval-iters", "0", "--peak-tflops", "1",
        "--micro-batch-size", "2", "--log-interval", "1"]


@pytest.mark.parametrize("style", ["cosine", "linear", "constant", "wsd"])
def test_sample_based_lr_equals_iteration_based_where_they_coincide(style: str) -> None:
    batch, iters = 8, 100
    by_iter = OptimConfig(lr=1e-3, min_lr=1e-5, lr_warmup_iters=10, lr_decay_iters=90,
                          lr_decay_style=style, lr_wsd_decay_iters=20, lr_warmup_init=1e-4)
    by_sample = replace(by_iter, lr_warmup_iters=0, lr_decay_iters=None,
                        lr_warmup_samples=10 * batch, lr_decay_samples=90 * batch,
                        lr_wsd_decay_samples=20 * batch)
    iter_lengths = schedule_lengths(by_iter, TrainConfig(train_iters=iters), batch)
    sample_lengths = schedule_lengths(
        by_sample, TrainConfig(train_samples=iters * batch, global_batch_size=batch), batch)
    for i in range(iters):
        assert abs(lr_at(i * batch, by_sample, sample_lengths)
                   - lr_at(i * batch, by_iter, iter_lengths)) <= 1e-12


def test_warmup_fraction_and_init() -> None:
    cfg = OptimConfig(lr=1.0, lr_warmup_fraction=0.1, lr_warmup_init=0.5, lr_decay_iters=100)
    lengths = schedule_lengths(cfg, TrainConfig(train_iters=100), 1)
    assert lr_at(0, cfg, lengths) == 0.5 and lr_at(1, cfg, lengths) == pytest.approx(0.55)
    assert lr_at(10, cfg, lengths) == 1.0
    with pytest.raises(ConfigError, match="--lr-warmup-fraction replaces"):
        OptimConfig(lr_warmup_fraction=0.1, lr_warmup_iters=5)


def test_train_samples_sets_the_iterations(tmp_path) -> None:
    cfg = parse_config([*TINY, "--train-samples", "96", "--global-batch-size", "8"])
    assert cfg.train.train_iters == 12
    assert len(run(cfg).losses) == 12
    with pytest.raises(ConfigError, match="--train-samples replaces --train-iters"):
        parse_config(["--train-samples", "96", "--train-iters", "3", "--global-batch-size", "8"])


def megatron_rampup(start: int, increment: int, ramp_samples: int, gbs: int,
                    consumed: int) -> int:
    """Megatron's formula, written out: INCREMENT every SAMPLES / ((GBS - START) / INCREMENT)
    samples, GBS once the ramp's samples are consumed."""
    if consumed > ramp_samples:
        return gbs
    per_increment = ramp_samples / ((gbs - start) / increment)
    return start + int(consumed / per_increment) * increment


RAMP = ["--global-batch-size", "8", "--rampup-batch-size", "2", "2", "30"]


def test_rampup_global_batch_per_step_follows_megatron(tmp_path) -> None:
    log = tmp_path / "log.jsonl"
    cfg = parse_config([*TINY, *RAMP, "--train-samples", "80", "--log-jsonl", str(log)])
    run(cfg)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if "global_batch_size" in r]
    consumed, expected = 0, []
    while consumed <= 30:
        expected.append(megatron_rampup(2, 2, 30, 8, consumed))
        consumed += expected[-1]
    expected += [8] * ((80 - consumed) // 8)
    assert [r["global_batch_size"] for r in steps] == expected
    assert [r["consumed_samples"] for r in steps][-1] == sum(expected)
    train = TrainConfig(global_batch_size=8, rampup_batch_size=[2, 2, 30], micro_batch_size=2)
    assert [global_batch_at(train, c) for c in range(0, 60)] == [
        megatron_rampup(2, 2, 30, 8, c) for c in range(0, 60)]


def test_rampup_needs_whole_micro_batches() -> None:
    from megatron_lite.config import validate

    with pytest.raises(ConfigError, match="multiples of --micro-batch-size"):
        validate(parse_config([*TINY, "--global-batch-size", "8", "--rampup-batch-size", "3",
                               "1", "30"]), 1)


def test_resume_mid_rampup_is_bit_exact(tmp_path) -> None:
    flags = [*TINY, *RAMP, "--train-iters", "12"]
    full = run(parse_config(flags)).losses
    save = ["--save", str(tmp_path / "ckpt")]
    first = run(parse_config([*flags, *save, "--exit-interval", "4"])).losses
    resumed = run(parse_config([*flags, *save])).losses
    assert len(first) == 4 and first + resumed == full  # step 5 starts mid-ramp (batch 4)


@pytest.mark.quick
def test_decoupled_lr_matches_a_second_adamw_group() -> None:
    """Embedding and output weights at --decoupled-lr, the rest at --lr: torch.optim.AdamW
    with those parameter groups lands on the same weights (float64, within EXACT)."""
    cfg = make_config(micro=1)
    cfg.model.untie_embeddings_and_output_weights = True
    pstate = single_process_state()
    ours, ref = build_model(cfg, pstate), build_model(cfg, pstate)
    opt = Optimizer(cfg, ours, pstate)
    named = list(ref[0].named_parameters())
    o, decoupled = cfg.optim, 3e-2

    def group(pred: object, lr: float, decay: bool) -> dict:
        return {"params": [p for n, p in named if pred(n) and (p.ndim >= 2) == decay],
                "lr": lr, "weight_decay": o.weight_decay if decay else 0.0}

    def is_outer(n: str) -> bool:
        return n.startswith(("embedding.", "output."))

    groups = [group(is_outer, decoupled, True), group(lambda n: not is_outer(n), o.lr, True),
              group(lambda n: not is_outer(n), o.lr, False)]
    adam = torch.optim.AdamW([g for g in groups if g["params"]], betas=(o.adam_beta1,
                             o.adam_beta2), eps=o.adam_eps)
    runners = StepRunner(cfg, pstate, ours), StepRunner(cfg, pstate, ref)
    for step in range(5):
        batches = step_batches(step, 0, 1, micro=1)
        opt.zero_grad()
        runners[0](batches, global_token_count(batches, pstate))
        opt.finalize_grads()
        opt.step(o.lr, decoupled)
        adam.zero_grad(set_to_none=True)
        runners[1](batches, global_token_count(batches, pstate))
        torch.nn.utils.clip_grad_norm_([p for _, p in named], o.clip_grad)
        adam.step()
    assert next(ours[0].parameters()).dtype == torch.float64
    assert_all_close(dict(ours[0].named_parameters()), dict(named))
