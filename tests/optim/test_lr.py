"""LR schedule shapes at their key points."""

from __future__ import annotations

import itertools
import math

import pytest

from megatron_lite.config import OptimConfig, TrainConfig, schedule_lengths
from megatron_lite.optim import lr


def lr_at(iteration: int, cfg: OptimConfig, train_iters: int) -> float:
    """The LR of step `iteration` (0-based) of an iteration-based run with global batch 1."""
    return lr.lr_at(iteration, cfg, schedule_lengths(cfg, TrainConfig(train_iters=train_iters), 1))


@pytest.mark.quick
def test_warmup_then_cosine_to_min() -> None:
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=10, lr_decay_iters=110,
                      lr_decay_style="cosine")
    assert lr_at(0, cfg, 110) == 0.0 and lr_at(1, cfg, 110) == pytest.approx(1e-4)
    assert lr_at(10, cfg, 110) == pytest.approx(1e-3)
    assert lr_at(60, cfg, 110) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr_at(110, cfg, 110) == pytest.approx(1e-4)
    assert lr_at(500, cfg, 110) == pytest.approx(1e-4)
    values = [lr_at(i, cfg, 110) for i in range(10, 110)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_linear_constant_and_wsd() -> None:
    lin = OptimConfig(lr=1.0, min_lr=0.0, lr_decay_style="linear")
    assert lr_at(50, lin, 100) == pytest.approx(0.5)
    const = OptimConfig(lr=0.3, lr_decay_style="constant", lr_warmup_iters=2)
    assert lr_at(2, const, 100) == pytest.approx(0.3) and lr_at(99, const, 100) == 0.3
    wsd = OptimConfig(lr=1.0, min_lr=0.0, lr_decay_style="wsd", lr_wsd_decay_iters=10,
                      lr_wsd_decay_style="linear")
    assert lr_at(90, wsd, 100) == 1.0
    assert lr_at(95, wsd, 100) == pytest.approx(0.5)
    assert not math.isnan(lr_at(100, wsd, 100))
