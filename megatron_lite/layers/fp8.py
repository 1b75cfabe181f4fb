"""FP8 GEMMs for the parallel linears (--fp8-format, --fp8-recipe tensorwise).

Each operand of a GEMM is quantized with current (dynamic) tensorwise scaling: its amax is
taken now, scale = fp8_max / amax / 2^margin (--fp8-margin, as Transformer Engine applies
it), and the scaled tensor is cast to float8 (e4m3 for activations and weights; the output
gradient in e5m2 under `hybrid`, whose wider range holds gradients). On CUDA the GEMM is
`torch._scaled_mm` with the inverse scales; elsewhere it is an emulation that dequantizes each
operand (fp8 value x inverse scale, in fp32) and multiplies in fp32, which is what
`torch._scaled_mm` computes on the CPU (tests/layers/test_fp8.py checks the two bit for bit):
`_scaled_mm` itself is far too slow on the CPU to train with.

Under tensor parallelism a sharded operand's amax is the max over the TP group, so every
rank scales with the one-process scale: which operands are sharded depends on the layer
(`Fp8Linear` takes a group per operand). The master weights are untouched: the weight is
quantized afresh in each forward from the model's weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_lite.config import TrainConfig
from megatron_lite.parallel import comms

FORMATS = ("e4m3", "hybrid")
FWD_DTYPE = torch.float8_e4m3fn
"""Activations and weights are e4m3 in both formats."""


@dataclass(frozen=True)
class Fp8Recipe:
    """How a linear quantizes: --fp8-format and --fp8-margin (tensorwise current scaling)."""

    format: str
    margin: int = 0

    @property
    def grad_dtype(self) -> torch.dtype:
        """The output gradient's fp8 type: e5m2 under hybrid (range), else e4m3."""
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn



def quantize(x: Tensor, dtype: torch.dtype, margin: int = 0,
             group: comms.Group = None) -> tuple[Tensor, Tensor]:
    """(x in fp8, its inverse scale as a 0-dim fp32 tensor). The amax is reduced over `group`
    (the TP group of a sharded operand) so every rank uses the whole tensor's scale."""
    amax = x.detach().abs().amax().float()
    if group is not None and comms.group_size(group) > 1:
        comms.all_reduce_(amax, group, op=dist.ReduceOp.MAX)
    fp8_max = torch.finfo(dtype).max
    # An all-zero tensor keeps scale 1 (any scale maps it to zeros).
    scale = torch.where(amax > 0, fp8_max / amax, torch.ones_like(amax)) / 2.0 ** margin
    x8 = (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
    return x8, scale.reciprocal()


def scaled_mm(a8: Tensor, b8: Tensor, a_inv: Tensor, b_inv: Tensor,
              out_dtype: torch.dtype) -> Tensor:
    """(a8 * a_inv) @ (b8 * b_inv) for a8 [m, k], b8 [k, n]: `torch._scaled_mm` on CUDA, its
    bit-identical emulation (dequantize, fp32 matmul) elsewhere. Scales are 0-dim
    (tensorwise) or [m, 1] / [1, n] (rowwise)."""
    if a8.is_cuda:
        # _scaled_mm wants `a` row-major and `b` column-major.
        return torch._scaled_mm(a8.contiguous(), b8.t().contiguous().t(), scale_a=a_inv,
                                scale_b=b_inv, out_dtype=out_dtype)
    return ((a8.float() * a_inv) @ (b8.float() * b_inv)).to(out_dtype)


def fp8_matmul(a: Tensor, b: Tensor, a_dtype: torch.dtype = FWD_DTYPE,
               b_dtype: torch.dtype = FWD_DTYPE, *, margin: int = 0,
               a_group: comms.Group = None, b_group: comms.Group = None) -> Tensor:
    """a [m, k] @ b [k, n] with both operands quantized tensorwise to fp8, in a's dtype."""
    a8, a_inv = quantize(a, a_dtype, margin, a_group)
    b8, b_inv = quantize(b, b_dtype, margin, b_group)
    return scaled_mm(a8, b8, a_inv, b_inv, a.dtype)


@dataclass(frozen=True)
class Fp8Groups:
    """The TP group each operand of one linear is sharded over (None: whole on every rank)."""

    x: comms.Group = None
    weight: comms.Group = None
    grad: comms.Group = None
    sequence: comms.Group = None
    """The TP group a sequence-parallel input is split over along dim 0 (None: whole). The
    shard is quantized with the whole input's scale (its amax MAX-reduced over the group)
    and the fp8 bytes are all-gathered: 1 byte per element on the wire instead of 2 or 4,
    and the same fp8 values as gathering first and quantizing after."""


def gather_fp8(x8: Tensor, group: comms.Group) -> Tensor:
    """All-gather an fp8 tensor's dim-0 slices as uint8 (gloo has no float8 types)."""
    full, _ = comms.all_gather_dim0(x8.contiguous().view(torch.uint8), group)
    return full.view(x8.dtype)


class Fp8Linear(torch.autograd.Function):
    """x W^T with the forward, input-gradient and weight-gradient GEMMs in fp8.

    Saves the fp8 input and weight with their inverse scales (1 byte per element) for
    backward; the output gradient is quantized once and used by both backward GEMMs. With
    `groups.sequence` the input is a sequence shard, gathered in fp8 (see `Fp8Groups`).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, recipe: Fp8Recipe,
                groups: Fp8Groups) -> Tensor:
        x2 = x.reshape(-1, x.size(-1))
        x_group = groups.x if groups.sequence is None else groups.sequence
        x8, x_inv = quantize(x2, FWD_DTYPE, recipe.margin, x_group)
        if groups.sequence is not None:
            x8 = gather_fp8(x8, groups.sequence)  # rows [s/t * b] per rank, in rank order
        w8, w_inv = quantize(weight, FWD_DTYPE, recipe.margin, groups.weight)
        ctx.recipe, ctx.groups, ctx.x_shape = recipe, groups, x.shape
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        out = scaled_mm(x8, w8.t(), x_inv, w_inv, x.dtype)
        return out.reshape(-1, *x.shape[1:-1], weight.size(0))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        recipe, groups = ctx.recipe, ctx.groups
        x_dtype, w_dtype = ctx.dtypes
        g2 = grad.reshape(-1, grad.size(-1))
        g8, g_inv = quantize(g2, recipe.grad_dtype, recipe.margin, groups.grad)
        grad_x = scaled_mm(g8, w8, g_inv, w_inv, x_dtype)
        if groups.sequence is not None:  # the whole input's gradient back to this shard
            grad_x = comms.reduce_scatter_dim0(grad_x, groups.sequence)[0]
        grad_x = grad_x.reshape(ctx.x_shape)
        grad_w = scaled_mm(g8.t(), x8, g_inv, x_inv, w_dtype)
        return grad_x, grad_w, None, None


def recipe(train: TrainConfig) -> Fp8Recipe | None:
    """The run's recipe (None without --fp8-format); config.validate refused the others."""
    if train.fp8_format is None:
        return None
    return Fp8Recipe(train.fp8_format, train.fp8_margin)


def bf16_layers(train: TrainConfig, num_layers: int) -> frozenset[int]:
    """The transformer layers --first-last-layers-bf16 keeps out of FP8 (as in Megatron: the
    first and last N of the whole model, whatever stage holds them)."""
    if train.fp8_format is None or not train.first_last_layers_bf16:
        return frozenset()
    start = range(min(train.num_layers_at_start_in_bf16, num_layers))
    end = range(max(num_layers - train.num_layers_at_end_in_bf16, 0), num_layers)
    return frozenset(start) | frozenset(end)
