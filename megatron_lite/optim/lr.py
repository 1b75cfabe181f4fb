"""Learning-rate schedules as pure functions of the iteration."""

from __future__ import annotations

import math

from megatron_lite.config import OptimConfig


def lr_at(iteration: int, cfg: OptimConfig, train_iters: int) -> float:
    """LR for the step that produces iteration `iteration + 1` (0-based step index).

    Linear warm-up from 0 over `lr_warmup_iters`, then decay to `min_lr` over the remaining
    `lr_decay_iters - lr_warmup_iters` steps (cosine, linear, constant, or warmup-stable-decay
    whose last `lr_wsd_decay_iters` steps decay linearly), then `min_lr`.
    """
    warmup = cfg.lr_warmup_iters
    decay_iters = cfg.lr_decay_iters or train_iters
    if warmup and iteration < warmup:
        return cfg.lr * (iteration + 1) / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    if iteration >= decay_iters:
        return cfg.min_lr
    if cfg.lr_decay_style == "wsd":
        wsd = cfg.lr_wsd_decay_iters or max(1, (decay_iters - warmup) // 10)
        stable_end = decay_iters - wsd
        if iteration < stable_end:
            return cfg.lr
        frac = (iteration - stable_end) / wsd
        return cfg.lr - (cfg.lr - cfg.min_lr) * frac
    frac = (iteration - warmup) / max(1, decay_iters - warmup)
    if cfg.lr_decay_style == "linear":
        coeff = 1.0 - frac
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * frac))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * coeff
