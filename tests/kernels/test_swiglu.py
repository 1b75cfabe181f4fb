"""Triton SwiGLU against the torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.kernels.swiglu import swiglu, swiglu_reference
from tests.kernels.util import assert_close, grads_of, leaf

# One element; a row wider than one 1024-column block with a ragged tail; 3-D leading dims.
SHAPES = [(1, 1), (3, 1030), (2, 3, 17)]
DTYPES = [torch.float32, torch.bfloat16]


def _check(shape, dtype, device, gen):
    gate = leaf(shape, dtype, device, gen, scale=3.0)
    up = leaf(shape, dtype, device, gen)
    dy = torch.randn(shape, generator=gen).to(device, dtype)
    (y,), grads = grads_of(lambda a, b: swiglu(a, b, use_triton=True), [gate, up], [dy])
    (y_ref,), grads_ref = grads_of(swiglu, [gate, up], [dy])
    assert_close(y, y_ref, dtype, "y")
    assert_close(grads[0], grads_ref[0], dtype, "d_gate")
    assert_close(grads[1], grads_ref[1], dtype, "d_up")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu(shape, dtype, device, gen):
    _check(shape, dtype, device, gen)


def test_halves_of_fused_projection(device, gen):
    """gate/up as the two halves of one [.., 2f] matmul output are used without a copy."""
    fused = leaf((2, 5, 2 * 24), torch.float32, device, gen)
    dy = torch.randn(2, 5, 24, generator=gen).to(device)
    (y,), (g,) = grads_of(lambda t: swiglu(*t.chunk(2, -1), use_triton=True), [fused], [dy])
    (y_ref,), (g_ref,) = grads_of(lambda t: swiglu(*t.chunk(2, -1)), [fused], [dy])
    assert_close(y, y_ref, torch.float32, "y")
    assert_close(g, g_ref, torch.float32, "d_fused")


def test_reference_matches_definition(gen):
    a, b = torch.randn(2, 9, generator=gen), torch.randn(2, 9, generator=gen)
    assert_close(swiglu_reference(a, b), a * torch.sigmoid(a) * b, torch.float32, "reference")
    assert_close(swiglu_reference(a, b), F.silu(a) * b, torch.float32, "reference")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_cuda_sizes(dtype, gen):
    _check((4096, 14336), dtype, torch.device("cuda"), gen)
