"""Triton kernels for RMSNorm (math and sources in rmsnorm.py); imported lazily by its launcher.

A program handles a tile of BLOCK_ROWS whole rows: one row at Llama widths, several when rows
are short, so small hidden sizes do not waste most of each program.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rms_norm_fwd_kernel(
    X_ptr, R_ptr, W_ptr, Y_ptr, S_ptr, RSTD_ptr,
    x_row_stride, r_row_stride, y_row_stride, s_row_stride,
    n_rows, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """s = x (+ r), rstd = 1/sqrt(mean(s^2) + eps), y = s * rstd * w, for a tile of rows."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows[:, None] * x_row_stride + cols[None, :]
    x = tl.load(X_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # The sum is rounded to the input dtype before it is normed, as an unfused `x + r` is.
        r_offs = rows[:, None] * r_row_stride + cols[None, :]
        r = tl.load(R_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
        total = (x + r).to(S_ptr.dtype.element_ty)
        tl.store(S_ptr + rows[:, None] * s_row_stride + cols[None, :], total, mask=mask)
        x = total.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    w = tl.load(W_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    y = (x * rstd[:, None] * w[None, :]).to(Y_ptr.dtype.element_ty)
    tl.store(Y_ptr + rows[:, None] * y_row_stride + cols[None, :], y, mask=mask)
    tl.store(RSTD_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit
def _rms_norm_bwd_kernel(
    DY_ptr, X_ptr, W_ptr, RSTD_ptr, DS_ptr, DX_ptr, DW_ptr,
    dy_row_stride, x_row_stride, ds_row_stride, dx_row_stride,
    n_rows, n_cols, tiles_per_program,
    HAS_DSUM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """A run of row tiles per program: dx per row, and this program's partial sum of dw.

    dx = rstd * (dy * w - xh * mean(dy * w * xh)) with xh = x * rstd; dw += dy * xh. With a fused
    residual, the gradient of the returned sum (DS) adds straight into dx.
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    cmask = cols[None, :] < n_cols
    w = tl.load(W_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros((BLOCK_ROWS, BLOCK_SIZE), dtype=tl.float32)
    # int64 bounds make the loop index int64, so row * stride cannot overflow on big inputs.
    tile_start = pid.to(tl.int64) * tiles_per_program
    for tile in range(tile_start, tile_start + tiles_per_program):
        rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        mask = (rows[:, None] < n_rows) & cmask
        dy = tl.load(DY_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        x = tl.load(X_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        rstd = tl.load(RSTD_ptr + rows, mask=rows < n_rows, other=0.0)[:, None]
        xh = x * rstd
        wdy = w * dy
        dx = rstd * (wdy - xh * (tl.sum(wdy * xh, axis=1) / n_cols)[:, None])
        if HAS_DSUM:
            ds = tl.load(DS_ptr + rows[:, None] * ds_row_stride + cols[None, :], mask=mask,
                         other=0.0)
            dx += ds.to(tl.float32)
        tl.store(DX_ptr + rows[:, None] * dx_row_stride + cols[None, :],
                 dx.to(DX_ptr.dtype.element_ty), mask=mask)
        dw += dy * xh
    tl.store(DW_ptr + pid * n_cols + cols, tl.sum(dw, axis=0), mask=cols < n_cols)
