"""Triton kernels for vocab-parallel cross-entropy (math and sources in cross_entropy.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ce_row_stats_kernel(
    LOGITS_ptr, TARGET_ptr, MAX_ptr, SUMEXP_ptr, TLOGIT_ptr,
    logits_row_stride, n_cols, n_valid, vocab_start,
    BLOCK_SIZE: tl.constexpr,
):
    """One row per program, one read of its logits: local max m, sum exp(z - m), target logit.

    Online softmax (Milakov & Gimelshein 2018): the running sum is rescaled whenever the running
    max grows, so a row of any width is one pass. Columns >= n_valid are vocab padding and count
    as -inf. The max starts finite so a rank holding only padding gives m = -1e30, S = 0, no NaN.
    """
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS_ptr + row * logits_row_stride
    m = tl.full((), -1e30, tl.float32)
    total = tl.zeros((), tl.float32)
    for start in range(0, n_cols, BLOCK_SIZE):
        cols = start + tl.arange(0, BLOCK_SIZE)
        z = tl.load(base + cols, mask=cols < n_valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    local_t = tl.load(TARGET_ptr + row) - vocab_start
    on_rank = (local_t >= 0) & (local_t < n_valid)
    t_logit = tl.load(base + tl.where(on_rank, local_t, 0), mask=on_rank, other=0.0)
    tl.store(MAX_ptr + row, m)
    tl.store(SUMEXP_ptr + row, total)
    tl.store(TLOGIT_ptr + row, t_logit.to(tl.float32))


@triton.jit
def _ce_grad_kernel(
    LOGITS_ptr, GRAD_ptr, TARGET_ptr, MAX_ptr, SUMEXP_ptr,
    logits_row_stride, grad_row_stride, n_cols, n_valid, vocab_start, ignore_index,
    BLOCK_SIZE: tl.constexpr,
):
    """grad = softmax(z) - onehot(target) with the global m and S; zero rows for ignored targets.

    GRAD may be LOGITS itself (in-place backward): each element is read before it is written, by
    the same program, so overwriting is safe.
    """
    row = tl.program_id(0).to(tl.int64)
    m = tl.load(MAX_ptr + row)
    inv_sum = 1.0 / tl.load(SUMEXP_ptr + row)
    target = tl.load(TARGET_ptr + row)
    keep = tl.where(target == ignore_index, 0.0, 1.0)
    local_t = target - vocab_start
    for start in range(0, n_cols, BLOCK_SIZE):
        cols = start + tl.arange(0, BLOCK_SIZE)
        z = tl.load(LOGITS_ptr + row * logits_row_stride + cols, mask=cols < n_valid,
                    other=float("-inf")).to(tl.float32)
        grad = tl.exp(z - m) * inv_sum - tl.where(cols == local_t, 1.0, 0.0)
        tl.store(GRAD_ptr + row * grad_row_stride + cols,
                 (grad * keep).to(GRAD_ptr.dtype.element_ty), mask=cols < n_cols)
