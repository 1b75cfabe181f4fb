"""Triton RMSNorm (with and without the fused residual) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.kernels.rmsnorm import rms_norm, rms_norm_reference, rms_norm_residual
from tests.kernels.util import assert_close, grads_of, leaf

# One row; hidden not a power of two; rows not divisible by the backward's program count.
SHAPES = [(1, 37), (5, 48), (3, 7, 100)]
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(shape, dtype, device, gen):
    x = leaf(shape, dtype, device, gen)
    w = (1.0 + 0.1 * leaf(shape[-1:], torch.float32, device, gen)).detach()
    return x, w.to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape, dtype, device, gen):
    x, w = _inputs(shape, dtype, device, gen)
    dy = torch.randn(shape, generator=gen).to(device, dtype)
    (y,), (dx, dw) = grads_of(lambda a, b: rms_norm(a, b, 1e-5, use_triton=True), [x, w], [dy])
    (y_ref,), (dx_ref, dw_ref) = grads_of(lambda a, b: rms_norm(a, b, 1e-5), [x, w], [dy])
    assert_close(y, y_ref, dtype, "y")
    assert_close(dx, dx_ref, dtype, "dx")
    assert_close(dw, dw_ref, dtype, "dw")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_residual(shape, dtype, device, gen):
    x, w = _inputs(shape, dtype, device, gen)
    r = leaf(shape, dtype, device, gen)
    dy, ds = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(2))

    def fused(a, b, c):
        return rms_norm_residual(a, b, c, 1e-6, use_triton=True)

    def unfused(a, b, c):
        return rms_norm_residual(a, b, c, 1e-6)

    (y, s), grads = grads_of(fused, [x, r, w], [dy, ds])
    (y_ref, s_ref), grads_ref = grads_of(unfused, [x, r, w], [dy, ds])
    assert_close(s, s_ref, dtype, "x + residual")
    assert_close(y, y_ref, dtype, "y")
    for name, g, g_ref in zip(("dx", "dresidual", "dw"), grads, grads_ref):
        assert_close(g, g_ref, dtype, name)


def test_reference_matches_definition(gen):
    """The reference itself against the formula written out in fp64."""
    x = torch.randn(4, 24, generator=gen, dtype=torch.float64)
    w = torch.randn(24, generator=gen, dtype=torch.float64)
    expected = x / torch.sqrt((x * x).sum(-1, keepdim=True) / 24 + 1e-5) * w
    assert_close(rms_norm_reference(x.float(), w.float(), 1e-5), expected.float(), torch.float32,
                 "reference")


def test_strided_rows(device, gen):
    """Rows of a wider buffer (row stride != hidden) are read in place, not assumed packed."""
    base = leaf((6, 64), torch.float32, device, gen)
    w = leaf((40,), torch.float32, device, gen)
    (y,), grads = grads_of(lambda b, c: rms_norm(b[:, 8:48], c, 1e-5, use_triton=True),
                           [base, w], [torch.ones(6, 40, device=device)])
    (y_ref,), grads_ref = grads_of(lambda b, c: rms_norm(b[:, 8:48], c, 1e-5), [base, w],
                                   [torch.ones(6, 40, device=device)])
    assert_close(y, y_ref, torch.float32, "y")
    for g, g_ref in zip(grads, grads_ref):
        assert_close(g, g_ref, torch.float32, "grad")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 8192), (8, 5120)])
def test_rms_norm_residual_cuda_sizes(shape, dtype, gen):
    test_rms_norm_residual(shape, dtype, torch.device("cuda"), gen)
