"""Triton RoPE against float64, within a small multiple of the torch reference's own error in
the same dtype (tests/kernels/util.py); the reference against a complex-number RoPE."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.kernels.rope import apply_rotary, apply_rotary_reference, rope_tables
from tests.kernels.util import check_kernel, leaf
from tests.numerics import assert_close

# (s, b, n_q, n_kv, d): GQA; head dim whose half (3) is not a power of two; a single token.
SHAPES = [(4, 2, 4, 2, 16), (5, 1, 3, 1, 6), (1, 1, 1, 1, 2)]
DTYPES = [torch.float32, torch.bfloat16]


def _check(s, b, n_q, n_kv, d, dtype, device, gen, offset=0, base=10000.0):
    q = leaf((s, b, n_q, d), dtype, device, gen)
    k = leaf((s, b, n_kv, d), dtype, device, gen)
    cos, sin = rope_tables(s, d, base, device, offset=offset)
    dq, dk = (torch.randn(t.shape, generator=gen).to(device, dtype) for t in (q, k))
    check_kernel(lambda a, c: apply_rotary(a, c, cos, sin, use_triton=True),
                 lambda a, c: apply_rotary(a, c, cos, sin), [q, k], [dq, dk],
                 ("q", "k", "dq", "dk"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_apply_rotary(shape, dtype, device, gen):
    _check(*shape, dtype, device, gen)


def test_position_offset(device, gen):
    """A chunk starting at position 7 uses rows 7.. of the full table."""
    cos_full, sin_full = rope_tables(12, 8, 500.0, device)
    cos, sin = rope_tables(5, 8, 500.0, device, offset=7)
    torch.testing.assert_close(cos, cos_full[7:], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, sin_full[7:], rtol=0, atol=1e-6)
    _check(3, 2, 2, 2, 8, torch.float32, device, gen, offset=7, base=500.0)


@pytest.mark.quick
def test_strided_qk_from_fused_projection(device, gen):
    """q and k as views of one fused qkv output (head stride != d) are read in place."""
    s, b, n_q, n_kv, d = 3, 2, 4, 2, 8
    qkv = leaf((s, b, (n_q + 2 * n_kv) * d), torch.float32, device, gen)
    cos, sin = rope_tables(s, d, 10000.0, device)

    def run(t, use_triton):
        q = t[..., : n_q * d].view(s, b, n_q, d)
        k = t[..., n_q * d : (n_q + n_kv) * d].view(s, b, n_kv, d)
        return apply_rotary(q, k, cos, sin, use_triton=use_triton)

    dq, dk = torch.randn(s, b, n_q, d, generator=gen), torch.randn(s, b, n_kv, d, generator=gen)
    check_kernel(lambda t: run(t, True), lambda t: run(t, False), [qkv],
                 [dq.to(device), dk.to(device)], ("q", "k", "dqkv"))


def test_reference_is_complex_rotation(gen):
    """Rotate-half RoPE = multiplying (x_j + i x_{j+d/2}) by exp(i * pos * base^(-2j/d)); the
    reference keeps float64 in float64 (--fp64 runs) and matches to ~1e-16."""
    s, d, base = 6, 8, 10000.0
    x = torch.randn(s, 1, 2, d, generator=gen, dtype=torch.float64)
    cos, sin = rope_tables(s, d, base, "cpu", dtype=torch.float64)
    rotated, _ = apply_rotary_reference(x, x, cos, sin)
    assert rotated.dtype == torch.float64
    pos = torch.arange(s, dtype=torch.float64)[:, None]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * torch.polar(
        torch.ones(s, d // 2, dtype=torch.float64), pos * theta)[:, None, None, :]
    expected = torch.cat((z.real, z.imag), dim=-1)
    assert_close(rotated, expected, 1e-14, "float64 reference")
    rotated32, _ = apply_rotary_reference(x.float(), x.float(), cos.float(), sin.float())
    assert rotated32.dtype == torch.float32


def test_bad_shapes_name_the_problem(device):
    q, k = torch.zeros(4, 1, 2, 8), torch.zeros(4, 1, 2, 8)
    cos, sin = rope_tables(3, 8, 10000.0, "cpu")
    with pytest.raises(ValueError, match="cos/sin must be"):
        apply_rotary(q, k, cos, sin, use_triton=True)
    with pytest.raises(ValueError, match="even head dim"):
        rope_tables(3, 7, 10000.0, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rotary_cuda_sizes(dtype, gen):
    _check(2048, 2, 32, 8, 128, dtype, torch.device("cuda"), gen, offset=4096)
