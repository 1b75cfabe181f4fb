"""Planted breakage: the DP / ZeRO-1 / ZeRO-2 / ZeRO-3 equivalence comparison can fail.

One spawn of DP=2 trains each strategy for two steps (two micro-batches per rank, several
buckets) twice: as shipped, and with one collective broken inside the ranks (patched on the
`comms` module the optimizer calls). The shipped runs must pass the equivalence tests' own
comparison with one process (`assert_same_params`, EXACT); each broken run must fail it, by a
relative error above 1e-6 (measured worst tensor: 0.59 to 0.80).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any
from unittest import mock

import pytest
import torch

from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState
from tests.distributed import run_ranks
from tests.numerics import rel_err
from tests.optim.common import assert_same_params, make_config, train_ours, train_reference

STEPS = 2
BUCKETS = {"ddp_bucket_size": 3000}


def _first_call_only(real: Callable[..., Any], broken: Callable[..., Any]
                     ) -> Callable[..., Any]:
    """`real`, except that its first call in the run goes to `broken` (one bucket, once)."""
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return (broken if calls[0] == 1 else real)(*args, **kwargs)
    return wrapper


def _skip(*_: Any, **__: Any) -> None:
    """A collective that every rank skips (so none of them waits): its sum never happens."""
    return None


def _patches(pstate: ParallelState) -> dict[str, tuple[dict, str, Callable[..., Any]]]:
    """name -> (make_config flags, comms function, its broken stand-in)."""
    odd = pstate.dp_rank % 2 == 1
    real_rs, real_ag = comms.reduce_scatter_flat, comms.all_gather_flat

    def drop_contribution(out: torch.Tensor, x: torch.Tensor, *args: Any, **kw: Any) -> Any:
        # odd DP ranks lose one micro-batch's gradient of one bucket
        return real_rs(out, torch.zeros_like(x) if odd else x, *args, **kw)

    def zero_gather_input(out: torch.Tensor, x: torch.Tensor, *args: Any, **kw: Any) -> Any:
        # odd DP ranks contribute zeros to one unit's parameter gather (one forward)
        return real_ag(out, torch.zeros_like(x) if odd else x, *args, **kw)

    return {
        "dp_skip_all_reduce": ({**BUCKETS}, "all_reduce_flat", _skip),
        "zero1_skip_reduce_scatter": ({"use_distributed_optimizer": True, **BUCKETS},
                                      "reduce_scatter_flat", _skip),
        "zero2_drop_contribution": ({"data_parallel_sharding_strategy": "optim_grads",
                                     **BUCKETS}, "reduce_scatter_flat", drop_contribution),
        "zero3_corrupt_gather": ({"data_parallel_sharding_strategy": "optim_grads_params"},
                                 "all_gather_flat", zero_gather_input),
    }


def _suite(pstate: ParallelState, names: list[str]) -> dict[str, dict]:
    out = {}
    for name in names:
        flags, fn, broken = _patches(pstate)[name]
        for patched in (False, True):
            patch = (mock.patch.object(comms, fn, _first_call_only(getattr(comms, fn), broken))
                     if patched else nullcontext())
            with patch:
                run = train_ours(pstate, make_config(**flags), STEPS)
            out[f"{name}{'_broken' if patched else ''}"] = run["params"]
    return out


NAMES = ["dp_skip_all_reduce", "zero1_skip_reduce_scatter", "zero2_drop_contribution",
         "zero3_corrupt_gather"]


@pytest.fixture(scope="module")
def reference() -> dict:
    return train_reference(STEPS)["params"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_suite, 2, tmp_path_factory.mktemp("breakage"), names=NAMES, timeout=300)


@pytest.mark.quick
@pytest.mark.parametrize("name", NAMES)
def test_breakage_fails_the_equivalence_check(ranks, reference, name: str) -> None:
    """Quick suite: one spawn checks DP, ZeRO-1, ZeRO-2 and ZeRO-3 against one process over
    two steps (EXACT) and that each planted breakage fails that check."""
    for rank in ranks:
        assert_same_params(rank[name], reference)  # as shipped: the equivalence holds
        with pytest.raises(AssertionError):
            assert_same_params(rank[f"{name}_broken"], reference)
        worst = max(rel_err(rank[f"{name}_broken"][n], p) for n, p in reference.items())
        print(f"{name}: worst relative error {worst:.3e}")
        assert worst > 1e-6, worst
