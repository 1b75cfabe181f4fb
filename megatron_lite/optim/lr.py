"""Learning-rate and weight-decay schedules as pure functions of the training position.

The curves are Megatron-LM's OptimizerParamScheduler: every length is counted in samples
(iteration-based flags are multiplied by the global batch size), and a step's LR is the value
at the samples consumed before it, so the first step runs at --lr-warmup-init. Being a pure
function of consumed samples, a resumed run continues the same LR sequence.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_lite.config import ConfigError, Lengths, OptimConfig, TrainConfig, schedule_lengths


def lr_at(consumed_samples: float, optim: OptimConfig, lengths: Lengths) -> float:
    """LR of the step that starts after `consumed_samples` samples."""
    peak, floor, n = optim.lr, optim.min_lr, consumed_samples
    if lengths.warmup > 0 and n <= lengths.warmup:
        return optim.lr_warmup_init + (peak - optim.lr_warmup_init) * n / lengths.warmup
    style = optim.lr_decay_style
    if style == "constant":
        return peak
    if n > lengths.decay:
        return floor
    if style == "inverse-square-root":
        return max(floor, peak * math.sqrt(max(lengths.warmup, 1)) / math.sqrt(max(n, 1)))
    if style == "WSD":
        return floor + (peak - floor) * _wsd_coeff(n, optim.lr_wsd_decay_style, lengths)
    ratio = (n - lengths.warmup) / (lengths.decay - lengths.warmup)
    if style == "linear":
        return floor + (peak - floor) * (1.0 - ratio)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * ratio))


def _wsd_coeff(n: float, style: str, lengths: Lengths) -> float:
    """1 through the stable phase, then the --lr-wsd-decay-style curve from 1 to 0."""
    if lengths.wsd is None:
        raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or "
                          "--lr-wsd-decay-samples with --train-samples)")
    anneal_start = lengths.decay - lengths.wsd
    if n <= anneal_start:
        return 1.0
    ratio = (n - anneal_start) / lengths.wsd
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * ratio))
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    return 2.0 * 0.5 ** ratio - 1.0  # exponential


def step_lrs(consumed_samples: int, global_batch_size: int, optim: OptimConfig,
             train: TrainConfig) -> tuple[float, float | None]:
    """(LR, --decoupled-lr's LR or None) of the step after `consumed_samples` samples. The
    decoupled one is the same curve with its own peak and floor."""
    lengths = schedule_lengths(optim, train, global_batch_size)
    if optim.decoupled_lr is None:
        return lr_at(consumed_samples, optim, lengths), None
    decoupled = dataclasses.replace(optim, lr=optim.decoupled_lr, min_lr=optim.min_lr
                                    if optim.decoupled_min_lr is None else optim.decoupled_min_lr)
    return lr_at(consumed_samples, optim, lengths), lr_at(consumed_samples, decoupled, lengths)


def weight_decay_at(consumed_samples: float, global_batch_size: int, optim: OptimConfig,
                    train: TrainConfig) -> float:
    """Weight decay of the step after `consumed_samples` samples: --weight-decay, or the
    --weight-decay-incr-style curve from --start- to --end-weight-decay over the training
    samples (Megatron's), held at the end value after them."""
    style = optim.weight_decay_incr_style
    if style == "constant":
        return optim.weight_decay
    start, end = optim.start_weight_decay, optim.end_weight_decay
    if start is None or end is None:
        raise ConfigError(f"--weight-decay-incr-style {style} needs --start-weight-decay and "
                          "--end-weight-decay")
    total = (train.train_samples if train.train_samples is not None
             else (train.train_iters or 0) * global_batch_size)
    if total <= 0 or consumed_samples > total:
        return end
    ratio = consumed_samples / total
    coeff = ratio if style == "linear" else 0.5 * (1.0 - math.cos(math.pi * ratio))
    return start + coeff * (end - start)
