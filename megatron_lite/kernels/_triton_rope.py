"""Triton kernel for rotary embeddings (math and sources in rope.py); imported lazily.

The work is a list of head rows: q's s*b*n_q rows, then k's s*b*n_kv rows. A program rotates a
tile of BLOCK_ROWS of them, so one launch covers q and k for any head count (GQA included).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotate_rows(
    X_ptr, Y_ptr, COS_ptr, SIN_ptr, tile, x_s_stride, x_b_stride, x_h_stride,
    y_s_stride, y_b_stride, y_h_stride, seq, batch, n_heads, half,
    BACKWARD: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Rotates rows [tile * BLOCK_ROWS, ...) of X (row = (s, b, head)) into Y."""
    rows = tile.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    head = rows % n_heads
    b = (rows // n_heads) % batch
    s = rows // (n_heads * batch)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (s[:, None] < seq) & (dims < half)
    x_offs = (s * x_s_stride + b * x_b_stride + head * x_h_stride)[:, None] + dims
    y_offs = (s * y_s_stride + b * y_b_stride + head * y_h_stride)[:, None] + dims
    t_offs = (s * 2 * half)[:, None] + dims
    c1 = tl.load(COS_ptr + t_offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS_ptr + t_offs + half, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN_ptr + t_offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN_ptr + t_offs + half, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(X_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X_ptr + x_offs + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        # Transpose of the forward map: dx1 = c1 g1 + s2 g2, dx2 = c2 g2 - s1 g1.
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(Y_ptr + y_offs, y1.to(Y_ptr.dtype.element_ty), mask=mask)
    tl.store(Y_ptr + y_offs + half, y2.to(Y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q_ptr, K_ptr, QO_ptr, KO_ptr, COS_ptr, SIN_ptr,
    q_s_stride, q_b_stride, q_h_stride, k_s_stride, k_b_stride, k_h_stride,
    qo_s_stride, qo_b_stride, qo_h_stride, ko_s_stride, ko_b_stride, ko_h_stride,
    seq, batch, n_q_heads, n_kv_heads, half, n_q_tiles,
    BACKWARD: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """y = x * cos + rotate_half(x) * sin on q's tiles (pid < n_q_tiles), then on k's.

    On the two halves of the head dim: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2. BACKWARD applies
    the transpose (the rotation by minus the angle) to the incoming gradients.
    """
    pid = tl.program_id(0)
    if pid < n_q_tiles:
        _rotate_rows(Q_ptr, QO_ptr, COS_ptr, SIN_ptr, pid, q_s_stride, q_b_stride, q_h_stride,
                     qo_s_stride, qo_b_stride, qo_h_stride, seq, batch, n_q_heads, half,
                     BACKWARD, BLOCK_ROWS, BLOCK_HALF)
    else:
        _rotate_rows(K_ptr, KO_ptr, COS_ptr, SIN_ptr, pid - n_q_tiles, k_s_stride, k_b_stride,
                     k_h_stride, ko_s_stride, ko_b_stride, ko_h_stride, seq, batch, n_kv_heads,
                     half, BACKWARD, BLOCK_ROWS, BLOCK_HALF)
