"""Triton kernels for SwiGLU (math and sources in swiglu.py); imported lazily by its launcher."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _swiglu_fwd_kernel(
    G_ptr, U_ptr, Y_ptr, g_row_stride, u_row_stride, y_row_stride, n_cols,
    n_rows, BLOCK_ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Program (row tile, column tile): y = gate * sigmoid(gate) * up."""
    row = (tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS))[:, None]
    cols = (tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE))[None, :]
    mask = (row < n_rows) & (cols < n_cols)
    a = tl.load(G_ptr + row * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + row * u_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * u
    tl.store(Y_ptr + row * y_row_stride + cols, y.to(Y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    DY_ptr, G_ptr, U_ptr, DG_ptr, DU_ptr,
    dy_row_stride, g_row_stride, u_row_stride, dg_row_stride, du_row_stride, n_cols,
    n_rows, BLOCK_ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """d_gate = dy * up * s * (1 + a * (1 - s)), d_up = dy * a * s; s = sigmoid(a) recomputed."""
    row = (tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS))[:, None]
    cols = (tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE))[None, :]
    mask = (row < n_rows) & (cols < n_cols)
    dy = tl.load(DY_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(G_ptr + row * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + row * u_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    dg = dy * u * s * (1.0 + a * (1.0 - s))
    du = dy * a * s
    tl.store(DG_ptr + row * dg_row_stride + cols, dg.to(DG_ptr.dtype.element_ty), mask=mask)
    tl.store(DU_ptr + row * du_row_stride + cols, du.to(DU_ptr.dtype.element_ty), mask=mask)
