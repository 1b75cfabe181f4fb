"""Comparison helpers for the kernel tests."""

from __future__ import annotations

import torch

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
"""Norm-wise relative error allowed against the reference (the issue's acceptance bar)."""


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in fp64; NaN anywhere in `actual` gives inf."""
    a, e = actual.double(), expected.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    err = rel_err(actual, expected)
    assert err <= TOLERANCE[dtype], f"{what}: relative error {err:.3g} > {TOLERANCE[dtype]}"


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
