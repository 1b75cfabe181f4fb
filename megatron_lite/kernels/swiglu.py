"""SwiGLU activation (Shazeer 2020, "GLU Variants Improve Transformer"): y = silu(gate) * up.

silu(a) = a * sigmoid(a). Backward, with g = dL/dy and s = sigmoid(a):
    d_gate = g * up * s * (1 + a * (1 - s));   d_up = g * silu(a)
The Triton backward recomputes s from the saved gate instead of storing silu(gate), the same trade
Megatron-LM's fused bias-SwiGLU makes: one elementwise recompute for one activation less in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_lite.kernels._launch import load_triton_module, next_power_of_2, rows_per_program
from megatron_lite.kernels._precision import upcast

_TILE = 2048
"""Elements per program: 16 per thread at 4 warps, enough in flight to hide memory latency."""


def _tiling(n_rows: int, n_cols: int) -> tuple[tuple[int, int], int, int]:
    """(grid, rows per tile, columns per tile): short rows whole, long rows in parts."""
    block = min(next_power_of_2(n_cols), _TILE)
    block_rows = rows_per_program(block, n_rows, budget=_TILE)
    return (-(-n_rows // block_rows), -(-n_cols // block)), block_rows, block


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """Plain-PyTorch SwiGLU in fp32 (float64 for float64), cast back to gate's dtype;
    autograd gives the backward."""
    return (F.silu(upcast(gate)) * upcast(up)).to(gate.dtype)


def _rows(t: Tensor) -> Tensor:
    """2-D [rows, cols] view with unit column stride; a chunk of a fused [.., 2f] tensor stays a
    view (its row stride is 2f), so splitting gate/up from one matmul output costs no copy."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def swiglu_forward(gate: Tensor, up: Tensor) -> Tensor:
    """Launches the forward kernel on 2-D gate/up; returns a new contiguous output."""
    kernels = load_triton_module("swiglu", gate.device)
    n_rows, n_cols = gate.shape
    y = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    grid, block_rows, block = _tiling(n_rows, n_cols)
    kernels._swiglu_fwd_kernel[grid](
        gate, up, y, gate.stride(0), up.stride(0), y.stride(0), n_cols, n_rows,
        BLOCK_ROWS=block_rows, BLOCK_SIZE=block,
    )
    return y


def swiglu_backward(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """Launches the backward kernel; returns (d_gate, d_up) as new contiguous tensors."""
    kernels = load_triton_module("swiglu", gate.device)
    n_rows, n_cols = gate.shape
    dg = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    du = torch.empty(up.shape, device=up.device, dtype=up.dtype)
    grid, block_rows, block = _tiling(n_rows, n_cols)
    kernels._swiglu_bwd_kernel[grid](
        dy, gate, up, dg, du, dy.stride(0), gate.stride(0), up.stride(0), dg.stride(0),
        du.stride(0), n_cols, n_rows, BLOCK_ROWS=block_rows, BLOCK_SIZE=block,
    )
    return dg, du


class _SwiGLUFunction(torch.autograd.Function):
    """Triton SwiGLU; saves gate and up (its inputs), not silu(gate)."""

    @staticmethod
    def forward(ctx, gate, up):
        gate2, up2 = _rows(gate), _rows(up)
        ctx.save_for_backward(gate2, up2)
        return swiglu_forward(gate2, up2).view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = swiglu_backward(_rows(dy), gate, up)
        return dg.view(dy.shape), du.view(dy.shape)


def swiglu(gate: Tensor, up: Tensor, use_triton: bool = False) -> Tensor:
    """silu(gate) * up, elementwise; gate and up have the same shape."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    if use_triton:
        return _SwiGLUFunction.apply(gate, up)
    return swiglu_reference(gate, up)
