"""Triton SwiGLU against float64, within a small multiple of the torch reference's own error in
the same dtype (tests/kernels/util.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.kernels.swiglu import swiglu, swiglu_reference
from tests.kernels.util import check_kernel, leaf
from tests.numerics import assert_close

# One element; a row wider than one 1024-column block with a ragged tail; 3-D leading dims.
SHAPES = [(1, 1), (3, 1030), (2, 3, 17)]
DTYPES = [torch.float32, torch.bfloat16]


def _check(shape, dtype, device, gen):
    gate = leaf(shape, dtype, device, gen, scale=3.0)
    up = leaf(shape, dtype, device, gen)
    dy = torch.randn(shape, generator=gen).to(device, dtype)
    check_kernel(lambda a, b: swiglu(a, b, use_triton=True), swiglu, [gate, up], [dy],
                 ("y", "d_gate", "d_up"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu(shape, dtype, device, gen):
    _check(shape, dtype, device, gen)


@pytest.mark.quick
def test_halves_of_fused_projection(device, gen):
    """gate/up as the two halves of one [.., 2f] matmul output are used without a copy."""
    fused = leaf((2, 5, 2 * 24), torch.float32, device, gen)
    dy = torch.randn(2, 5, 24, generator=gen).to(device)
    check_kernel(lambda t: swiglu(*t.chunk(2, -1), use_triton=True),
                 lambda t: swiglu(*t.chunk(2, -1)), [fused], [dy], ("y", "d_fused"))


def test_reference_matches_definition(gen):
    """The reference keeps float64 in float64 (--fp64 runs) and is the formula to ~1e-16."""
    a = torch.randn(2, 9, generator=gen, dtype=torch.float64)
    b = torch.randn(2, 9, generator=gen, dtype=torch.float64)
    got = swiglu_reference(a, b)
    assert got.dtype == torch.float64
    assert_close(got, a / (1 + torch.exp(-a)) * b, 1e-14, "float64 reference")
    assert_close(got, F.silu(a) * b, 1e-14, "float64 reference")
    assert swiglu_reference(a.float(), b.float()).dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_cuda_sizes(dtype, gen):
    _check((4096, 14336), dtype, torch.device("cuda"), gen)
