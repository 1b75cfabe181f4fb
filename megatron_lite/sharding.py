"""The data-parallel sharding strategies as one table: what each
--data-parallel-sharding-strategy splits over the ranks holding the same parameters
(stdlib only).

Config validation, the optimizer's choice of gradient-sync class (optim/optimizer.py
STRATEGIES), the memory model and the planner read a strategy's facts from here, so adding
a strategy is one row here, its class under optim/ and its entry in STRATEGIES.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sharding:
    """One --data-parallel-sharding-strategy."""

    name: str
    zero_stage: int
    """The ZeRO paper's stage (Rajbhandari et al. 2020): 0 shards nothing."""
    state: bool
    """fp32 master weights and Adam moments are split (each rank updates its slice)."""
    grads: bool
    """Only the owned slice of the reduced gradient is kept (reduce-scattered during
    backward; no full-size gradient buffer)."""
    params: bool
    """Only the owned slice of the parameters is kept between uses (gathered per unit)."""
    summary: str
    """What it keeps per rank, for --help and the planner's tables."""


TABLE: dict[str, Sharding] = {s.name: s for s in (
    Sharding("no_shard", 0, state=False, grads=False, params=False,
             summary="every rank keeps everything; gradients all-reduced"),
    Sharding("optim", 1, state=True, grads=False, params=False,
             summary="ZeRO-1: masters and Adam state split; parameters all-gathered after "
                     "the step"),
    Sharding("optim_grads", 2, state=True, grads=True, params=False,
             summary="ZeRO-2: also the gradients, reduce-scattered bucket by bucket during "
                     "backward"),
    Sharding("optim_grads_params", 3, state=True, grads=True, params=True,
             summary="ZeRO-3: also the parameters, gathered per layer for its forward and "
                     "backward"),
)}
NAMES = tuple(TABLE)
"""The flag's choices, in ZeRO-stage order."""
NO_SHARD, OPTIM, OPTIM_GRADS, OPTIM_GRADS_PARAMS = NAMES


def get(name: str) -> Sharding:
    """The strategy called `name` (a KeyError names the choices)."""
    try:
        return TABLE[name]
    except KeyError:
        raise KeyError(f"unknown sharding strategy {name!r}; choices: "
                       f"{', '.join(NAMES)}") from None
