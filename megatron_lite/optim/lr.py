"""Learning-rate schedules as pure functions of the training position."""

from __future__ import annotations

import dataclasses
import math

from megatron_lite.config import OptimConfig, TrainConfig


def lr_at(iteration: int, cfg: OptimConfig, train_iters: int) -> float:
    """LR for the step that produces iteration `iteration + 1` (0-based step index).

    Linear warm-up from `lr_warmup_init` over `lr_warmup_iters`, then decay to `min_lr` over
    the remaining `lr_decay_iters - lr_warmup_iters` steps (cosine, linear, constant, or
    warmup-stable-decay whose last `lr_wsd_decay_iters` steps decay linearly), then `min_lr`.
    """
    decay = cfg.lr_decay_iters or train_iters
    return _schedule(iteration, 1, cfg, _warmup(cfg, cfg.lr_warmup_iters, decay), decay,
                     cfg.lr_wsd_decay_iters)


def lr_at_samples(consumed_samples: int, batch: int, cfg: OptimConfig, train_samples: int
                  ) -> float:
    """Megatron's sample-based schedule: the same curve with samples as the unit, for the
    step of `batch` samples that starts after `consumed_samples` (ramp-up changes `batch`).

    Where the two coincide (constant batch B, every length in samples = B x the one in
    iterations) this gives `lr_at` exactly: the position is B x the iteration.
    """
    decay = cfg.lr_decay_samples or train_samples
    return _schedule(consumed_samples, batch, cfg, _warmup(cfg, cfg.lr_warmup_samples, decay),
                     decay, cfg.lr_wsd_decay_samples)


def step_lrs(iteration: int, consumed_samples: int, batch: int, optim: OptimConfig,
             train: TrainConfig) -> tuple[float, float | None]:
    """(LR, --decoupled-lr's LR or None) for this step: sample-based with --train-samples,
    else iteration-based. The decoupled one is the same curve with its own peak and floor."""
    def at(cfg: OptimConfig) -> float:
        if train.train_samples is not None:
            return lr_at_samples(consumed_samples, batch, cfg, train.train_samples)
        return lr_at(iteration, cfg, train.train_iters)

    if optim.decoupled_lr is None:
        return at(optim), None
    decoupled = dataclasses.replace(optim, lr=optim.decoupled_lr, min_lr=optim.min_lr
                                    if optim.decoupled_min_lr is None else optim.decoupled_min_lr)
    return at(optim), at(decoupled)


def _warmup(cfg: OptimConfig, length: int, decay: int) -> int:
    if cfg.lr_warmup_fraction is not None:
        return int(cfg.lr_warmup_fraction * decay)
    return length


def _schedule(position: int, step: int, cfg: OptimConfig, warmup: int, decay: int,
              wsd: int | None) -> float:
    """Warm-up counts the step itself (position + step), decay the position before it."""
    if warmup and position < warmup:
        return cfg.lr_warmup_init + (cfg.lr - cfg.lr_warmup_init) * (position + step) / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    if position >= decay:
        return cfg.min_lr
    if cfg.lr_decay_style == "wsd":
        wsd = wsd or max(1, (decay - warmup) // 10)
        stable_end = decay - wsd
        if position < stable_end:
            return cfg.lr
        frac = (position - stable_end) / wsd
        return cfg.lr - (cfg.lr - cfg.min_lr) * frac
    frac = (position - warmup) / max(1, decay - warmup)
    if cfg.lr_decay_style == "linear":
        coeff = 1.0 - frac
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * frac))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * coeff
