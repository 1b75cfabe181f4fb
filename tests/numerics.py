"""How the tests compare numbers: one rule, two kinds of test.

**Equivalence tests** claim exact math: "layout X computes what one process computes" (TP, SP,
CP, PP and its schedules, DP, ZeRO-1/2/3, recomputation, resume, reshard, document masks). Both
sides run in float64 (`--fp64`, `TrainConfig.fp64`: weights, activations, gradients, reductions
and optimizer state; gloo reduces float64), so the only difference left is the order in which
sums are taken, ~1e-16 per operation. They assert `EXACT` (1e-10 relative) on losses, gradients,
norms and weights after the same steps: 1,000x below the fp32 tolerance they used to need, and
far above float64's floor even after ten AdamW steps (measured floors are in the README's
Correctness section). A real bug - a missed reduction, a wrong shard, a swapped micro-batch -
moves numbers by 1e-3 or more and fails them on every CPU.

**Dtype tests** are about fp32 or bf16 themselves (mixed precision, bf16 gradient accumulation,
the Triton kernels, fp32 resume bit-exactness). Their tolerance is not a constant: it comes from
a floor measured in the same test, the difference between two runs that differ only in summation
order (e.g. the same single-process run with its micro-batches in another order), and the thing
under test must stay within a small multiple of it (`within_floor`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

EXACT = 1e-10
"""Relative tolerance of float64 equivalence tests."""

FLOOR_FACTOR = 4.0
"""A dtype test passes within this multiple of its measured floor."""


def rel_err(got: Tensor | float | Sequence[float], ref: Tensor | float | Sequence[float]
            ) -> float:
    """||got - ref|| / ||ref||, computed in float64 (0 when both are zero)."""
    a, b = (x.detach().to(torch.float64) if isinstance(x, Tensor)
            else torch.tensor(x, dtype=torch.float64) for x in (got, ref))
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    diff = (a - b).norm().item()
    scale = b.norm().item()
    return diff / scale if scale else diff


def assert_close(got: Tensor | float | Sequence[float],
                 ref: Tensor | float | Sequence[float], tol: float = EXACT,
                 what: str = "value") -> float:
    """Fails with the relative error when it exceeds `tol`; returns it."""
    err = rel_err(got, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"
    return err


def assert_all_close(got: Mapping[str, Tensor], ref: Mapping[str, Tensor],
                     tol: float = EXACT, what: str = "") -> float:
    """Every named tensor within `tol`; the same names on both sides. Returns the worst."""
    assert got.keys() == ref.keys(), (f"{what} names differ: only got "
                                      f"{sorted(got.keys() - ref.keys())}, only ref "
                                      f"{sorted(ref.keys() - got.keys())}")
    return max((assert_close(got[n], ref[n], tol, f"{what}{n}") for n in ref), default=0.0)


def within_floor(err: float, floor: float, what: str = "value",
                 factor: float = FLOOR_FACTOR, minimum: float = 0.0) -> None:
    """Dtype tests: `err` (layout vs reference) must stay within `factor` x the `floor`
    measured between two reference runs that differ only in summation order. `minimum` keeps
    the bound above zero where the floor itself can come out exactly 0 (identical rounding)."""
    bound = max(factor * floor, minimum)
    assert err <= bound, (f"{what}: relative error {err:.3e} > {factor:g} x measured floor "
                          f"{floor:.3e} (bound {bound:.3e})")
