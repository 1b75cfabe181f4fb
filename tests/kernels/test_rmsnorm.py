"""Triton RMSNorm (with and without the fused residual) against float64, within a small multiple
of the torch reference's own error in the same dtype (tests/kernels/util.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.kernels.rmsnorm import rms_norm, rms_norm_reference, rms_norm_residual
from tests.kernels.util import check_kernel, leaf
from tests.numerics import assert_close

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
    check_kernel(lambda a, b: rms_norm(a, b, 1e-5, use_triton=True),
                 lambda a, b: rms_norm(a, b, 1e-5), [x, w], [dy], ("y", "dx", "dw"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_residual(shape, dtype, device, gen):
    x, w = _inputs(shape, dtype, device, gen)
    r = leaf(shape, dtype, device, gen)
    dy, ds = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(2))
    check_kernel(lambda a, b, c: rms_norm_residual(a, b, c, 1e-6, use_triton=True),
                 lambda a, b, c: rms_norm_residual(a, b, c, 1e-6), [x, r, w], [dy, ds],
                 ("y", "x + residual", "dx", "dresidual", "dw"))


def test_reference_matches_definition(gen):
    """The reference keeps float64 in float64 (--fp64 runs) and is the formula to ~1e-16."""
    x = torch.randn(4, 24, generator=gen, dtype=torch.float64)
    w = torch.randn(24, generator=gen, dtype=torch.float64)
    def formula(t):
        return t / torch.sqrt((t * t).sum(-1, keepdim=True) / 24 + 1e-5) * w

    got = rms_norm_reference(x, w, 1e-5)
    assert got.dtype == torch.float64
    assert_close(got, formula(x), 1e-14, "float64 reference")
    y, s = rms_norm_residual(x, x.flip(0), w, 1e-5)
    assert y.dtype == s.dtype == torch.float64
    assert_close(s, x + x.flip(0), 0.0, "x + residual")
    assert_close(y, formula(x + x.flip(0)), 1e-14, "float64 y")
    x32, w32 = x.float(), w.float()
    assert rms_norm_reference(x32, w32, 1e-5).dtype == torch.float32


@pytest.mark.quick
def test_strided_rows(device, gen):
    """Rows of a wider buffer (row stride != hidden) are read in place, not assumed packed."""
    base = leaf((6, 64), torch.float32, device, gen)
    w = leaf((40,), torch.float32, device, gen)
    dy = torch.randn(6, 40, generator=gen).to(device)
    check_kernel(lambda b, c: rms_norm(b[:, 8:48], c, 1e-5, use_triton=True),
                 lambda b, c: rms_norm(b[:, 8:48], c, 1e-5), [base, w], [dy],
                 ("y", "dbase", "dw"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 8192), (8, 5120)])
def test_rms_norm_residual_cuda_sizes(shape, dtype, gen):
    test_rms_norm_residual(shape, dtype, torch.device("cuda"), gen)
