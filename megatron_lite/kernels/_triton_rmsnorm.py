"""Triton kernels for RMSNorm (math and sources in rmsnorm.py); imported lazily by its launcher."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rms_norm_fwd_kernel(
    X_ptr, R_ptr, W_ptr, Y_ptr, S_ptr, RSTD_ptr,
    x_row_stride, r_row_stride, y_row_stride, s_row_stride,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """One row per program: s = x (+ r), rstd = 1/sqrt(mean(s^2) + eps), y = s * rstd * w."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(X_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # The sum is rounded to the input dtype before it is normed, as an unfused `x + r` is.
        r = tl.load(R_ptr + row * r_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        total = (x + r).to(S_ptr.dtype.element_ty)
        tl.store(S_ptr + row * s_row_stride + cols, total, mask=mask)
        x = total.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd * w).to(Y_ptr.dtype.element_ty)
    tl.store(Y_ptr + row * y_row_stride + cols, y, mask=mask)
    tl.store(RSTD_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    DY_ptr, X_ptr, W_ptr, RSTD_ptr, DS_ptr, DX_ptr, DW_ptr,
    dy_row_stride, x_row_stride, ds_row_stride, dx_row_stride,
    n_rows, n_cols, rows_per_program,
    HAS_DSUM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Rows [pid * rows_per_program, ...): dx per row, and this program's partial sum of dw.

    dx = rstd * (dy * w - xh * mean(dy * w * xh)) with xh = x * rstd; dw += dy * xh. With a fused
    residual, the gradient of the returned sum (DS) adds straight into dx.
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    # int64 bounds make the loop index int64, so row * stride cannot overflow on big inputs.
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row64 in range(row_start, row_end):
        dy = tl.load(DY_ptr + row64 * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X_ptr + row64 * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD_ptr + row64)
        xh = x * rstd
        wdy = w * dy
        dx = rstd * (wdy - xh * (tl.sum(wdy * xh, axis=0) / n_cols))
        if HAS_DSUM:
            ds = tl.load(DS_ptr + row64 * ds_row_stride + cols, mask=mask, other=0.0)
            dx += ds.to(tl.float32)
        tl.store(DX_ptr + row64 * dx_row_stride + cols, dx.to(DX_ptr.dtype.element_ty), mask=mask)
        dw += dy * xh
    tl.store(DW_ptr + pid * n_cols + cols, dw, mask=mask)
