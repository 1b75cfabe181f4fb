"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm block.

Math (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"), over the last dim of size h:
    r = 1 / sqrt(mean(x^2) + eps);   y = x * r * w
Backward, with g = dL/dy and xh = x * r:
    dx = r * (g * w - xh * mean(g * w * xh));   dw = sum over rows of g * xh
The Triton path follows the Triton "Layer Normalization" tutorial: whole rows per program, the
forward saves only r per row, and the weight gradient is written as per-program partial sums
that are then reduced. Math is fp32 whatever the input dtype; outputs take x's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_lite.kernels._launch import (
    load_triton_module,
    num_persistent_programs,
    row_block_and_warps,
    rows_per_program,
)
from megatron_lite.kernels._precision import upcast


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Plain-PyTorch RMSNorm in fp32 (float64 for float64), cast back to x's dtype;
    autograd gives the backward."""
    xf = upcast(x)
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * inv_rms * upcast(weight)).to(x.dtype)


def _rows(t: Tensor) -> Tensor:
    """2-D [rows, h] view with unit stride along h (copies only if the last dim is strided)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_forward(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Launches the forward kernel on 2-D x; returns (y, x + residual or None, rstd [rows] fp32)."""
    kernels = load_triton_module("rmsnorm", x.device)
    n_rows, n_cols = x.shape
    block, num_warps = row_block_and_warps(n_cols)
    block_rows = rows_per_program(block, n_rows)
    y = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else None
    rstd = torch.empty(n_rows, device=x.device, dtype=torch.float32)
    r = residual if residual is not None else x
    s = total if total is not None else y
    kernels._rms_norm_fwd_kernel[(-(-n_rows // block_rows),)](
        x, r, weight, y, s, rstd, x.stride(0), r.stride(0), y.stride(0), s.stride(0), n_rows,
        n_cols, eps, HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK_SIZE=block,
        num_warps=num_warps,
    )
    return y, total, rstd


def rms_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, dsum: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Launches the backward kernel; returns (dx, dw). dw is reduced from per-program partials."""
    kernels = load_triton_module("rmsnorm", x.device)
    n_rows, n_cols = x.shape
    block, num_warps = row_block_and_warps(n_cols)
    block_rows = rows_per_program(block, n_rows)
    n_tiles = -(-n_rows // block_rows)
    n_programs = min(n_tiles, num_persistent_programs(x.device))
    tiles_per_program = -(-n_tiles // n_programs)
    dx = torch.empty_like(x)
    dw_partial = torch.empty(n_programs, n_cols, device=x.device, dtype=torch.float32)
    ds = dsum if dsum is not None else dy
    kernels._rms_norm_bwd_kernel[(n_programs,)](
        dy, x, weight, rstd, ds, dx, dw_partial,
        dy.stride(0), x.stride(0), ds.stride(0), dx.stride(0), n_rows, n_cols, tiles_per_program,
        HAS_DSUM=dsum is not None, BLOCK_ROWS=block_rows, BLOCK_SIZE=block, num_warps=num_warps,
    )
    return dx, dw_partial.sum(0).to(weight.dtype)


class _RMSNormFunction(torch.autograd.Function):
    """Triton RMSNorm with optional fused residual; saves the normed input and rstd only."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        shape = x.shape
        x2 = _rows(x)
        r2 = _rows(residual) if residual is not None else None
        y, total, rstd = rms_norm_forward(x2, r2, weight.contiguous(), eps)
        ctx.save_for_backward(total if total is not None else x2, weight, rstd)
        ctx.has_residual = residual is not None
        y = y.view(shape)
        return (y, total.view(shape)) if total is not None else (y,)

    @staticmethod
    def backward(ctx, dy, dsum=None):
        x, weight, rstd = ctx.saved_tensors
        shape = dy.shape
        ds = _rows(dsum) if dsum is not None else None
        dx, dw = rms_norm_backward(_rows(dy), x, weight, rstd, ds)
        dx = dx.view(shape)
        return dx, (dx if ctx.has_residual else None), dw, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, use_triton: bool = False) -> Tensor:
    """RMSNorm over the last dim of x (any leading shape)."""
    if use_triton:
        return _RMSNormFunction.apply(x, None, weight, eps)[0]
    return rms_norm_reference(x, weight, eps)


def rms_norm_residual(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, use_triton: bool = False
) -> tuple[Tensor, Tensor]:
    """Returns (rms_norm(x + residual) * weight, x + residual); the sum is in x's dtype.

    Fusing saves one full read and write of the activation: the sum is formed in registers and
    normalized in the same pass instead of being written out and read back.
    """
    if use_triton:
        return _RMSNormFunction.apply(x, residual, weight, eps)
    total = x + residual
    return rms_norm_reference(total, weight, eps), total
