"""Rotary position embeddings (Su et al. 2021, "RoFormer"), rotate-half convention.

The rotate-half layout is the one Hugging Face Llama uses: dim i pairs with dim i + d/2, and
    y = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[d/2:], x[:d/2])
with cos/sin tables of shape [s, d] whose two halves repeat the same d/2 frequencies
theta_j = base^(-2j/d) (Llama 3.1 rescales them first: `llama3_scaled_frequencies`; only the
table changes, so the kernel is the same). Backward is the rotation by minus the angle:
    dx = g * cos - rotate_half(g) * sin.
Layout is sequence-first: q [s, b, n_q, d], k [s, b, n_kv, d].

Partial RoPE (Megatron's --rotary-percent): tables r < d wide rotate the first r channels of
each head (frequencies base^(-2j/r), spaced over r), and channels r..d pass through as they are.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_lite.kernels._launch import load_triton_module, next_power_of_2, rows_per_program
from megatron_lite.kernels._precision import upcast

LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192
"""Llama 3.1's frequency-scaling constants, which Megatron's --use-rope-scaling fixes too."""


def llama3_scaled_frequencies(inv_freq: Tensor, factor: float) -> Tensor:
    """Llama 3.1's rule: a frequency that turns fewer than `low` = 1 times over the original
    8192-token context is divided by `factor`, one that turns more than `high` = 4 times is
    kept, and in between the two are mixed linearly in the number of turns r:
        w = clamp((r - low) / (high - low), 0, 1),   f' = (1 - w) f / factor + w f.
    """
    turns = LLAMA3_ORIGINAL_CONTEXT * inv_freq / (2 * math.pi)
    weight = ((turns - LLAMA3_LOW_FREQ_FACTOR)
              / (LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR)).clamp(0.0, 1.0)
    return (1 - weight) * inv_freq / factor + weight * inv_freq


def rope_tables(
    seq_len: int,
    head_dim: int,
    base: float,
    device: torch.device | str | None,
    dtype: torch.dtype = torch.float32,
    offset: int = 0,
    scaling_factor: float | None = None,
) -> tuple[Tensor, Tensor]:
    """cos, sin of shape [seq_len, head_dim] for positions offset .. offset + seq_len - 1.

    `offset` serves chunked or sequence-parallel sequences whose first token is not position 0.
    `scaling_factor` (--use-rope-scaling) rescales the frequencies as Llama 3.1 does.
    Angles are formed in fp64 so long positions keep their precision before the cast to `dtype`.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {head_dim} (check --kv-channels or "
                         "--hidden-size / --num-attention-heads)")
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (base**exponent)
    if scaling_factor is not None:
        inv_freq = llama3_scaled_frequencies(inv_freq, scaling_factor)
    positions = torch.arange(offset, offset + seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _check_rotary_shapes(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"apply_rotary wants q, k as [s, b, heads, d], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}")
    s, b, _, d = q.shape
    if k.shape[0] != s or k.shape[1] != b or k.shape[3] != d or d % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on s, b or an even d")
    if cos.shape not in ((s, d), (s, b, d)) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin must be [{s}, {d}] (or [{s}, {b}, {d}] per sample), got "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")


def _rotate_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    xf = upcast(x)
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def apply_rotary_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Plain-PyTorch RoPE in fp32 (float64 for float64), cast back to the input dtype;
    autograd gives the backward."""
    _check_rotary_shapes(q, k, cos, sin)
    cos, sin = upcast(cos), upcast(sin)
    cos4 = cos[:, None, None, :] if cos.dim() == 2 else cos[:, :, None, :]
    sin4 = sin[:, None, None, :] if sin.dim() == 2 else sin[:, :, None, :]
    return _rotate_reference(q, cos4, sin4), _rotate_reference(k, cos4, sin4)


def _heads_view(t: Tensor) -> Tensor:
    """q or k with unit stride along d (copies only if d itself is strided)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_launch(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool
) -> tuple[Tensor, Tensor]:
    """Launches one RoPE kernel over q's and k's head rows; returns new contiguous outputs."""
    kernels = load_triton_module("rope", q.device)
    seq, batch, n_q, d = q.shape
    n_kv = k.shape[2]
    qo = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    ko = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    block_half = next_power_of_2(d // 2)
    block_rows = rows_per_program(block_half, seq * batch * max(n_q, n_kv), budget=2048)
    n_q_tiles = -(-seq * batch * n_q // block_rows)
    n_k_tiles = -(-seq * batch * n_kv // block_rows)
    kernels._rope_kernel[(n_q_tiles + n_k_tiles,)](
        q, k, qo, ko, cos, sin, *q.stride()[:3], *k.stride()[:3], *qo.stride()[:3],
        *ko.stride()[:3], seq, batch, n_q, n_kv, d // 2, n_q_tiles, BACKWARD=backward,
        BLOCK_ROWS=block_rows, BLOCK_HALF=block_half, num_warps=4,
    )
    return qo, ko


class _RotaryFunction(torch.autograd.Function):
    """Triton RoPE on q and k together; saves only the tables (the map is linear in q, k)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return rope_launch(_heads_view(q), _heads_view(k), cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_launch(_heads_view(dq), _heads_view(dk), cos, sin, backward=True)
        return dq, dk, None, None


def apply_rotary(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, use_triton: bool = False
) -> tuple[Tensor, Tensor]:
    """Rotates q [s, b, n_q, d] and k [s, b, n_kv, d] by the angles in cos/sin [s, r], or
    [s, b, r] when samples differ (positions restarting per document; torch path). With
    r < d (partial RoPE) only the first r channels of each head turn."""
    r, d = cos.shape[-1], q.shape[-1]
    if r < d:
        (q_rot, q_pass), (k_rot, k_pass) = q.split([r, d - r], -1), k.split([r, d - r], -1)
        q_rot, k_rot = apply_rotary(q_rot, k_rot, cos, sin, use_triton=use_triton)
        return torch.cat((q_rot, q_pass), -1), torch.cat((k_rot, k_pass), -1)
    if use_triton and cos.dim() == 2:
        _check_rotary_shapes(q, k, cos, sin)
        return _RotaryFunction.apply(q, k, cos, sin)
    return apply_rotary_reference(q, k, cos, sin)
