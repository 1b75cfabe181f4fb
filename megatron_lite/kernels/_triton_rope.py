"""Triton kernel for rotary embeddings (math and sources in rope.py); imported lazily."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    X_ptr, Y_ptr, x_s_stride, x_b_stride, x_h_stride, y_s_stride, y_b_stride, y_h_stride,
    s, b, n_heads, half, c1, c2, s1, s2,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Rotates all heads of one (s, b) position of X into Y; c1/c2/s1/s2 are the table halves."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (dims < half)
    x_base = X_ptr + s * x_s_stride + b * x_b_stride + heads * x_h_stride + dims
    y_base = Y_ptr + s * y_s_stride + b * y_b_stride + heads * y_h_stride + dims
    x1 = tl.load(x_base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        # Transpose of the forward map: dx1 = c1 g1 + s2 g2, dx2 = c2 g2 - s1 g1.
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(y_base, y1.to(Y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_base + half, y2.to(Y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q_ptr, K_ptr, QO_ptr, KO_ptr, COS_ptr, SIN_ptr,
    q_s_stride, q_b_stride, q_h_stride, k_s_stride, k_b_stride, k_h_stride,
    qo_s_stride, qo_b_stride, qo_h_stride, ko_s_stride, ko_b_stride, ko_h_stride,
    batch, n_q_heads, n_kv_heads, half,
    BACKWARD: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program per (token, batch) pair: reads the cos/sin row once, rotates q and k heads.

    y = x * cos + rotate_half(x) * sin, i.e. y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2 on the two
    halves of the head dim. BACKWARD applies the transpose (the rotation by minus the angle).
    """
    pid = tl.program_id(0).to(tl.int64)
    s = pid // batch
    b = pid % batch
    dims = tl.arange(0, BLOCK_HALF)
    dmask = dims < half
    row = s * 2 * half
    c1 = tl.load(COS_ptr + row + dims, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(COS_ptr + row + half + dims, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(SIN_ptr + row + dims, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(SIN_ptr + row + half + dims, mask=dmask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(Q_ptr, QO_ptr, q_s_stride, q_b_stride, q_h_stride, qo_s_stride, qo_b_stride,
                  qo_h_stride, s, b, n_q_heads, half, c1, c2, s1, s2, BACKWARD, BLOCK_QH,
                  BLOCK_HALF)
    _rotate_heads(K_ptr, KO_ptr, k_s_stride, k_b_stride, k_h_stride, ko_s_stride, ko_b_stride,
                  ko_h_stride, s, b, n_kv_heads, half, c1, c2, s1, s2, BACKWARD, BLOCK_KH,
                  BLOCK_HALF)
