"""Comparison helpers for the kernel tests.

The kernels are dtype tests: what matters is how close an fp32 or bf16 kernel gets to the exact
result. "Exact" is the same op in float64 (the torch reference keeps float64 in float64), and the
bound is not a constant: it is a small multiple (`tests.numerics.within_floor`) of the error the
torch reference itself makes in the same dtype on the same inputs, measured in the test. That
floor moves with the CPU's vector width (ATEN_CPU_CAPABILITY) and the seed; the ratio does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tests.numerics import FLOOR_FACTOR, rel_err, within_floor


def floor_of(ref: torch.Tensor, truth: torch.Tensor) -> float:
    """The measured floor: the torch reference's error in its dtype, and never below rounding
    the exact result once to that dtype (a kernel can do no better than that)."""
    return max(rel_err(ref, truth), rel_err(truth.to(ref.dtype), truth))


def within_reference_floor(got: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor,
                           what: str, minimum: float = 0.0) -> tuple[float, float]:
    """`got` (kernel, some dtype) vs `truth` (float64) within FLOOR_FACTOR x the reference's
    own error `ref` vs `truth`. The minimum, one ulp of the dtype (a kernel may round a value to
    its other neighbour), only matters for a handful of elements whose reference rounding was
    lucky (or exact, floor 0); a caller may raise it to the rounding bound of the op's last
    step (`minimum`). Returns (err, floor).
    NaN (an element the kernel never wrote: the buffers start poisoned) fails, NaN > bound."""
    assert got.shape == truth.shape, f"{what}: shape {tuple(got.shape)} != {tuple(truth.shape)}"
    assert got.dtype == ref.dtype, f"{what}: dtype {got.dtype} != {ref.dtype}"
    assert truth.dtype == torch.float64, f"{what}: the exact side must be float64"
    floor = floor_of(ref, truth)
    err = rel_err(got, truth)
    assert err == err, f"{what}: NaN in the kernel's output"
    # A floor measured over n values is a noisy estimate when n is small (one value: whatever
    # its single rounding happened to be), so the one-ulp minimum widens to FLOOR_FACTOR ulps
    # for a single value and shrinks back as 1/sqrt(n).
    ulps = max(1.0, FLOOR_FACTOR / max(truth.numel(), 1) ** 0.5)
    within_floor(err, floor, what, minimum=max(minimum, ulps * torch.finfo(got.dtype).eps))
    return err, floor


def fp64_copy(t: torch.Tensor) -> torch.Tensor:
    """The same values in float64, a fresh leaf (needing grad if `t` does)."""
    return t.detach().to(torch.float64).requires_grad_(t.requires_grad)


def leaf(shape, dtype, device, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Fresh random leaf tensor (drawn on CPU from `generator`, then moved) that needs grad."""
    t = torch.randn(shape, generator=generator) * scale
    return t.to(device=device, dtype=dtype).requires_grad_()


def grads_of(fn, inputs, out_grads) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Runs fn(*inputs), backprops out_grads, returns (outputs, input grads); clears grads."""
    outs = fn(*inputs)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    torch.autograd.backward(outs, out_grads)
    grads = [x.grad for x in inputs]
    for x in inputs:
        x.grad = None
    return [o.detach() for o in outs], grads


def check_kernel(kernel: Callable, reference: Callable, inputs: Sequence[torch.Tensor],
                 out_grads: Sequence[torch.Tensor], names: Sequence[str]) -> float:
    """Outputs then input gradients of `kernel` within the floor of `reference` (both run on
    `inputs` in their dtype) against `reference` on float64 copies of the same values.
    Returns the worst err / floor ratio seen."""
    def flat(fn, xs, gs):
        outs, grads = grads_of(fn, xs, gs)
        return [*outs, *grads]

    got = flat(kernel, inputs, out_grads)
    ref = flat(reference, inputs, out_grads)
    truth = flat(reference, [fp64_copy(x) for x in inputs],
                 [g.to(torch.float64) for g in out_grads])
    assert len(names) == len(got) == len(truth), (names, len(got))
    worst = 0.0
    for name, g, r, t in zip(names, got, ref, truth, strict=True):
        err, floor = within_reference_floor(g, r, t, name)
        worst = max(worst, err / max(floor, torch.finfo(g.dtype).eps / FLOOR_FACTOR))
    return worst
