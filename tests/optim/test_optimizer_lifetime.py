"""`Optimizer.close` leaves nothing that keeps the optimizer alive: once closed, dropping the
last reference frees it at once, without the cyclic collector. A cycle through its hooks'
state would keep it (and the process groups it holds) until a collection, possibly at
interpreter shutdown, where gloo's threads abort the process."""

from __future__ import annotations

import gc
import weakref

import pytest

from megatron_lite import sharding
from megatron_lite.arguments import parse_config
from megatron_lite.optim.optimizer import STRATEGIES, Optimizer
from megatron_lite.parallel.state import single_process_state
from megatron_lite.training import build_model

FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "16", "--ffn-hidden-size", "32",
         "--num-attention-heads", "2", "--seq-length", "8", "--vocab-size", "61",
         "--micro-batch-size", "1", "--global-batch-size", "1"]


def test_every_strategy_has_a_gradient_sync_class() -> None:
    assert set(STRATEGIES) == set(sharding.NAMES)


@pytest.mark.quick
@pytest.mark.parametrize("strategy", sharding.NAMES)
def test_closed_optimizer_is_freed_without_the_cycle_collector(strategy: str) -> None:
    extra = ["--overlap-param-gather"] if sharding.get(strategy).state else []
    cfg = parse_config([*FLAGS, "--data-parallel-sharding-strategy", strategy, *extra])
    optimizer = Optimizer(cfg, build_model(cfg, single_process_state()), single_process_state())
    alive = weakref.ref(optimizer)
    optimizer.close()
    gc.collect()
    gc.disable()
    try:
        del optimizer
        assert alive() is None, f"{strategy}: a reference cycle keeps the closed optimizer"
    finally:
        gc.enable()
