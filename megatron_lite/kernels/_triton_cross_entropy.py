"""Triton kernels for vocab-parallel cross-entropy (math and sources in cross_entropy.py).

A program owns a tile of BLOCK_ROWS rows (one at real vocab sizes) and streams across the
vocab in BLOCK_SIZE columns at a time.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ce_row_stats_kernel(
    LOGITS_ptr, TARGET_ptr, MAX_ptr, SUMEXP_ptr, TLOGIT_ptr,
    logits_row_stride, n_rows, n_valid, vocab_start,
    BLOCK_ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One read of each row: local max m, sum exp(z - m), and the target's logit (0 off-rank).

    Online softmax (Milakov & Gimelshein 2018): the running sum is rescaled whenever the running
    max grows, so a row of any width is one pass. Columns >= n_valid are vocab padding and count
    as -inf. The max starts finite so a rank holding only padding gives m = -1e30, S = 0, no NaN.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rmask = rows < n_rows
    base = LOGITS_ptr + rows[:, None] * logits_row_stride
    m = tl.full((BLOCK_ROWS,), -1e30, tl.float32)
    total = tl.zeros((BLOCK_ROWS,), tl.float32)
    for start in range(0, n_valid, BLOCK_SIZE):
        cols = start + tl.arange(0, BLOCK_SIZE)[None, :]
        z = tl.load(base + cols, mask=rmask[:, None] & (cols < n_valid),
                    other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new
    local_t = tl.load(TARGET_ptr + rows, mask=rmask, other=0) - vocab_start
    on_rank = rmask & (local_t >= 0) & (local_t < n_valid)
    t_logit = tl.load(LOGITS_ptr + rows * logits_row_stride + tl.where(on_rank, local_t, 0),
                      mask=on_rank, other=0.0)
    tl.store(MAX_ptr + rows, m, mask=rmask)
    tl.store(SUMEXP_ptr + rows, total, mask=rmask)
    tl.store(TLOGIT_ptr + rows, t_logit.to(tl.float32), mask=rmask)


@triton.jit
def _ce_grad_kernel(
    LOGITS_ptr, GRAD_ptr, TARGET_ptr, MAX_ptr, SUMEXP_ptr,
    logits_row_stride, grad_row_stride, n_rows, n_cols, n_valid, vocab_start, ignore_index,
    BLOCK_ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """grad = softmax(z) - onehot(target) with the global m and S; zero rows for ignored targets.

    GRAD may be LOGITS itself (in-place backward): each element is read before it is written, by
    the same program, so overwriting is safe.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rmask = rows < n_rows
    m = tl.load(MAX_ptr + rows, mask=rmask, other=0.0)[:, None]
    inv_sum = (1.0 / tl.load(SUMEXP_ptr + rows, mask=rmask, other=1.0))[:, None]
    target = tl.load(TARGET_ptr + rows, mask=rmask, other=ignore_index)[:, None]
    keep = tl.where(target == ignore_index, 0.0, 1.0)
    local_t = target - vocab_start
    for start in range(0, n_cols, BLOCK_SIZE):
        cols = start + tl.arange(0, BLOCK_SIZE)[None, :]
        z = tl.load(LOGITS_ptr + rows[:, None] * logits_row_stride + cols,
                    mask=rmask[:, None] & (cols < n_valid), other=float("-inf")).to(tl.float32)
        grad = (tl.exp(z - m) * inv_sum - tl.where(cols == local_t, 1.0, 0.0)) * keep
        tl.store(GRAD_ptr + rows[:, None] * grad_row_stride + cols,
                 grad.to(GRAD_ptr.dtype.element_ty), mask=rmask[:, None] & (cols < n_cols))
