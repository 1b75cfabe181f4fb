"""FP8 GEMMs for the parallel linears (--fp8-format, --fp8-recipe tensorwise or delayed) and
the MoE experts (current scaling, rowwise: see `scaled_grouped_mm`).

Under tensorwise each operand of a GEMM is quantized with current (dynamic) scaling: its amax
is taken now, scale = fp8_max / amax / 2^margin (--fp8-margin, as Transformer Engine applies
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

Under delayed (Megatron's default recipe) the scale comes from an amax history instead: each
FP8 linear owns a [--fp8-amax-history-len, 3] fp32 history (input, weight, output gradient),
and scale = fp8_max / amax_h / 2^margin with amax_h the window's max (--fp8-amax-compute-algo
max) or its newest entry (most_recent). The history gains ONE entry per optimizer step: the max
of the operand's amax over all the step's micro-batches, reduced (MAX) over every rank holding
the same layers (TP x DP x CP of the stage, the set Megatron's amax reduction group spans), in
one all-reduce per step for all linears (`Fp8History.fold`). So the scales do not depend on how
a batch is split over DP ranks and micro-batches (DP=2 equals one process accumulating two
micro-batches; TP=2 equals TP=1). Transformer Engine instead rolls its history per
micro-batch. Every micro-batch of a step uses the scale from the history as it stood before
the step; on the first step (empty history) an operand is scaled by its current amax, as under
tensorwise, so the first step does not underflow. Values beyond the range saturate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_lite.config import FP8_LINEARS, Config, TrainConfig
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState

FORMATS = ("e4m3", "hybrid")
FWD_DTYPE = torch.float8_e4m3fn
"""Activations and weights are e4m3 in both formats."""


@dataclass(frozen=True)
class Fp8Recipe:
    """How a linear quantizes: --fp8-format, --fp8-margin and, with `delayed`, the amax
    history's length and how a scale is taken from it."""

    format: str
    margin: int = 0
    delayed: bool = False
    history_len: int = 1
    compute_algo: str = "most_recent"
    rowwise: bool = False
    """--fp8-recipe rowwise: `Fp8RowwiseLinear` (current scaling, one scale per row or
    column of each operand, e4m3 throughout)."""

    @property
    def grad_dtype(self) -> torch.dtype:
        """The output gradient's fp8 type: e5m2 under hybrid (range), else e4m3."""
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn



def quantize(x: Tensor, dtype: torch.dtype, margin: int = 0,
             group: comms.Group = None, kind: str = "tp") -> tuple[Tensor, Tensor]:
    """(x in fp8, its inverse scale as a 0-dim fp32 tensor). The amax is reduced over `group`
    (the TP group of a sharded operand; `kind` names it, audit.group_kind) so every rank uses
    the whole tensor's scale."""
    return cast(x, dtype, _reduced(x.detach().abs().amax().float(), group, kind), margin)


def _reduced(amax: Tensor, group: comms.Group, kind: str) -> Tensor:
    if group is not None and comms.group_size(group) > 1:
        comms.all_reduce_(amax, group, op=dist.ReduceOp.MAX, kind=kind)
    return amax


def cast(x: Tensor, dtype: torch.dtype, amax: Tensor, margin: int = 0) -> tuple[Tensor, Tensor]:
    """x scaled by fp8_max / amax / 2^margin and cast (saturating) to `dtype`."""
    scale = _scale(amax, margin, dtype)
    return cast_scaled(x, scale, dtype), scale.reciprocal()


def scaled_mm(a8: Tensor, b8: Tensor, a_inv: Tensor, b_inv: Tensor,
              out_dtype: torch.dtype) -> Tensor:
    """(a8 * a_inv) @ (b8 * b_inv) for a8 [m, k], b8 [k, n]: `torch._scaled_mm` on CUDA, its
    bit-identical emulation (dequantize, fp32 matmul) on the CPU. Scales are 0-dim
    (tensorwise) or [m, 1] / [1, n] (rowwise). The meta device (the rank dry run) takes the
    CUDA call: its meta kernel checks the layouts CUDA wants, and the emulation's fp32
    copies, which a GPU never makes, stay out of the measured peak."""
    if a8.is_cuda or a8.is_meta:
        # _scaled_mm wants `a` row-major and `b` column-major.
        write = out_dtype
        if a_inv.dim() and a8.is_cuda:
            write = rowwise_write_dtype(out_dtype, torch.cuda.get_device_capability(a8.device),
                                        torch.version.cuda)
        return torch._scaled_mm(a8.contiguous(), b8.t().contiguous().t(),
                                scale_a=a_inv.contiguous(), scale_b=b_inv.contiguous(),
                                out_dtype=write).to(out_dtype)
    return ((a8.float() * a_inv) @ (b8.float() * b_inv)).to(out_dtype)


ROWWISE_FP32_OUT_SM = (9, 10)
"""Compute capabilities [from, to) whose rowwise-scaled `_scaled_mm` writes fp32: cuBLAS's
rowwise kernel (SM 9.x, Hopper; torch's Blas.cpp refuses it below SM 9.0). From SM 10.0
(Blackwell) only the CUTLASS kernel that writes bf16 takes rowwise scales."""
ROWWISE_FP32_OUT_CUBLAS = (12, 9)
"""cuBLAS from which the rowwise fp32-output kernel exists (torch refuses it below 12.9)."""


def rowwise_write_dtype(out_dtype: torch.dtype, capability: tuple[int, int],
                        cuda_version: str | None) -> torch.dtype:
    """The dtype a rowwise-scaled `_scaled_mm` writes for a wanted `out_dtype` on a device of
    `capability` under CUDA `cuda_version` (torch.version.cuda: its cuBLAS is that release):
    fp32 only where CUDA takes it, else bf16, which the caller widens (same bf16 rounding as a
    bf16 model gets)."""
    if out_dtype != torch.float32:
        return out_dtype
    major_minor = tuple(int(v) for v in (cuda_version or "0.0").split(".")[:2])
    lo, hi = ROWWISE_FP32_OUT_SM
    if lo <= capability[0] < hi and major_minor >= ROWWISE_FP32_OUT_CUBLAS:
        return torch.float32
    return torch.bfloat16


def fp8_matmul(a: Tensor, b: Tensor, a_dtype: torch.dtype = FWD_DTYPE,
               b_dtype: torch.dtype = FWD_DTYPE, *, margin: int = 0,
               a_group: comms.Group = None, b_group: comms.Group = None) -> Tensor:
    """a [m, k] @ b [k, n] with both operands quantized tensorwise to fp8, in a's dtype."""
    a8, a_inv = quantize(a, a_dtype, margin, a_group, kind="tp")
    b8, b_inv = quantize(b, b_dtype, margin, b_group, kind="tp")
    return scaled_mm(a8, b8, a_inv, b_inv, a.dtype)


@dataclass(frozen=True)
class Fp8Groups:
    """The TP group each operand of one linear is sharded over (None: whole on every rank);
    the linears' collectives name them kind "tp" (a dry run checks each is the TP group)."""

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
    full, _ = comms.all_gather_dim0(x8.contiguous().view(torch.uint8), group, kind="tp")
    return full.view(x8.dtype)


INPUT, WEIGHT, GRAD = 0, 1, 2
"""The columns of an amax history: the operands of one linear."""


class Fp8State:
    """One linear's delayed-scaling state: its amax history [N, 3] (newest entry first) and
    this step's running amax per operand [3]. `Fp8History` rebinds both to views of its
    tables, so one all-reduce covers every linear."""

    def __init__(self, recipe: Fp8Recipe, device: torch.device | None = None) -> None:
        self.history = torch.zeros(recipe.history_len, 3, dtype=torch.float32, device=device)
        self.amax = torch.zeros(3, dtype=torch.float32, device=device)
        self.use_max = recipe.compute_algo == "max"
        self.started = False
        """The history holds at least one step (else operands use their current amax)."""

    def observe(self, operand: int, local_amax: Tensor) -> None:
        """Fold one micro-batch's local amax into the step's running max."""
        torch.maximum(self.amax[operand], local_amax, out=self.amax[operand])

    def history_amax(self, operand: int) -> Tensor:
        column = self.history[:, operand]
        return column.max() if self.use_max else column[0]


def _quantize_operand(x: Tensor, dtype: torch.dtype, recipe: Fp8Recipe, group: comms.Group,
                      state: Fp8State | None, operand: int, record: bool
                      ) -> tuple[Tensor, Tensor]:
    """Tensorwise without `state`; else scaled from the history (from the current TP-reduced
    amax before the first fold), the local amax recorded for the step when `record`."""
    if state is None:
        return quantize(x, dtype, recipe.margin, group, kind="tp")
    local = x.detach().abs().amax().float()
    if record:
        state.observe(operand, local)
    amax = (state.history_amax(operand) if state.started
            else _reduced(local.clone(), group, kind="tp"))
    return cast(x, dtype, amax, recipe.margin)


@dataclass
class Fp8Weight:
    """A linear's weight as --fp8-param-gather keeps it: e4m3 values (a view of the gathered
    buffer), the inverse scale they were cast with, and the whole weight's amax (the MAX over
    the ranks that own its pieces and its TP shards), which a forward under delayed scaling
    records as the weight's: the amax it would have taken of the weight itself."""

    data: Tensor
    inv_scale: Tensor
    amax: Tensor


def weight_scale(amax: Tensor, recipe: Fp8Recipe, state: Fp8State | None) -> Tensor:
    """The scale a forward quantizes a weight of whole-tensor amax `amax` with: its history's
    once delayed scaling has started, else the amax itself (as `_quantize_operand`)."""
    if state is not None and state.started:
        amax = state.history_amax(WEIGHT)
    return _scale(amax, recipe.margin)


class Fp8Linear(torch.autograd.Function):
    """x W^T with the forward, input-gradient and weight-gradient GEMMs in fp8.

    Saves the fp8 input and weight with their inverse scales (1 byte per element) for
    backward; the output gradient is quantized once and used by both backward GEMMs. With a
    `state` (delayed scaling) the forward records the input and weight amaxes iff `record`
    and the backward always records the gradient's (a recompute rerun has no backward of its
    own). With `groups.sequence` the input is a sequence shard, gathered in fp8 (see
    `Fp8Groups`; under delayed scaling the shard's amax is recorded, and the fold's MAX over
    the ranks makes it the whole input's).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, recipe: Fp8Recipe, groups: Fp8Groups,
                state: Fp8State | None = None, record: bool = False,
                fp8_weight: Fp8Weight | None = None,
                defer: Callable[[Callable[[], Tensor]], None] | None = None) -> Tensor:
        x2 = x.reshape(-1, x.size(-1))
        x_group = groups.x if groups.sequence is None else groups.sequence
        x8, x_inv = _quantize_operand(x2, FWD_DTYPE, recipe, x_group, state, INPUT, record)
        if groups.sequence is not None:
            x8 = gather_fp8(x8, groups.sequence)  # rows [s/t * b] per rank, in rank order
        if fp8_weight is None:
            w8, w_inv = _quantize_operand(weight, FWD_DTYPE, recipe, groups.weight, state,
                                          WEIGHT, record)
        else:  # --fp8-param-gather: cast by the optimizer with this forward's scale
            w8, w_inv = fp8_weight.data, fp8_weight.inv_scale
            if state is not None and record:
                state.observe(WEIGHT, fp8_weight.amax)
        ctx.recipe, ctx.groups, ctx.state, ctx.x_shape = recipe, groups, state, x.shape
        ctx.defer = defer
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        out = scaled_mm(x8, w8.t(), x_inv, w_inv, x.dtype)
        return out.reshape(-1, *x.shape[1:-1], weight.size(0))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        recipe, groups = ctx.recipe, ctx.groups
        x_dtype, w_dtype = ctx.dtypes
        g2 = grad.reshape(-1, grad.size(-1))
        g8, g_inv = _quantize_operand(g2, recipe.grad_dtype, recipe, groups.grad, ctx.state,
                                      GRAD, True)
        grad_x = scaled_mm(g8, w8, g_inv, w_inv, x_dtype)
        if groups.sequence is not None:  # the whole input's gradient back to this shard
            grad_x = comms.reduce_scatter_dim0(grad_x, groups.sequence, kind="tp")[0]
        grad_x = grad_x.reshape(ctx.x_shape)
        if ctx.defer is not None:  # a zero-bubble B step: the W step runs this GEMM
            ctx.defer(lambda: scaled_mm(g8.t(), x8, g_inv, x_inv, w_dtype))
            return grad_x, None, None, None, None, None, None, None
        grad_w = scaled_mm(g8.t(), x8, g_inv, x_inv, w_dtype)
        return grad_x, grad_w, None, None, None, None, None, None


def fp8_linear(x: Tensor, weight: Tensor, recipe: Fp8Recipe, groups: Fp8Groups,
               state: Fp8State | None, fp8_weight: Fp8Weight | None = None,
               defer: Callable[[Callable[[], Tensor]], None] | None = None) -> Tensor:
    """`Fp8Linear`, recording amaxes only in a training forward: not under no_grad
    (evaluation) and not in a full-recompute rerun inside backward (the forward it repeats
    recorded them; the check layers/router.py makes for its statistics). With `defer` (a
    zero-bubble schedule's queue for this weight) the weight gets no autograd edge: backward
    hands `defer` the weight-gradient GEMM (on the saved e4m3 operands) for the W step."""
    record = torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
    if defer is not None:
        weight = weight.detach()
    if recipe.rowwise:
        return Fp8RowwiseLinear.apply(x, weight, recipe.margin, groups, defer)
    return Fp8Linear.apply(x, weight, recipe, groups, state, record, fp8_weight, defer)


class Fp8RowwiseLinear(torch.autograd.Function):
    """x W^T under --fp8-recipe rowwise: each GEMM's operands in e4m3 with one scale per slice
    along the GEMM's contraction (x per token for the forward, per feature over the tokens
    for the weight gradient; W per output row forward, per input column for the input
    gradient; the output gradient per token, then per output column), taken from current
    amaxes. Every operand is e4m3 whatever --fp8-format says (each slice's own scale gives
    the range e5m2 would, and CUDA's rowwise kernels are built for e4m3).

    A scale's amax runs along the contraction, so it is MAX-reduced over the TP group when
    that dim is sharded (`groups.x`: a row-parallel input's and weight's features;
    `groups.grad`: a column-parallel output's), and the scales are the one-process ones.
    Under SP (`groups.sequence`) each rank quantizes its own tokens (a token's scale is
    local), gathers the e4m3 rows and their scales, and the per-feature amax of the weight
    gradient's operand is reduced over the group. Saves that e4m3 operand and its scales;
    the weight is quantized afresh along its other dim in backward (no saved copy).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, margin: int, groups: Fp8Groups,
                defer: Callable[[Callable[[], Tensor]], None] | None = None) -> Tensor:
        x2 = x.reshape(-1, x.size(-1))
        x8, x_inv = quantize_rowwise(x2, 1, margin, groups.x, kind="tp")
        if groups.sequence is not None:  # rows [s/t * b] per rank, in rank order
            x8 = gather_fp8(x8, groups.sequence)
            x_inv = comms.all_gather_dim0(x_inv.contiguous(), groups.sequence, kind="tp")[0]
        w8, w_inv = quantize_rowwise(weight, 1, margin, groups.x, kind="tp")
        out = scaled_mm(x8, w8.t(), x_inv, w_inv.t(), x.dtype)
        del x8, w8  # before the saved copy: one gathered e4m3 input at a time
        xc8, xc_inv = quantize_rowwise(x2, 0, margin, groups.sequence, kind="tp")
        if groups.sequence is not None:
            xc8 = gather_fp8(xc8, groups.sequence)
        ctx.margin, ctx.groups, ctx.defer, ctx.x_shape = margin, groups, defer, x.shape
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(xc8, xc_inv, weight)
        return out.reshape(-1, *x.shape[1:-1], weight.size(0))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        xc8, xc_inv, weight = ctx.saved_tensors
        margin, groups = ctx.margin, ctx.groups
        g2 = grad.reshape(-1, grad.size(-1))
        g8, g_inv = quantize_rowwise(g2, 1, margin, groups.grad, kind="tp")
        wc8, wc_inv = quantize_rowwise(weight, 0, margin, groups.grad, kind="tp")
        grad_x = scaled_mm(g8, wc8, g_inv, wc_inv, ctx.x_dtype)
        del g8, wc8
        if groups.sequence is not None:  # the whole input's gradient back to this shard
            grad_x = comms.reduce_scatter_dim0(grad_x, groups.sequence, kind="tp")[0]
        grad_x = grad_x.reshape(ctx.x_shape)
        gc8, gc_inv = quantize_rowwise(g2, 0, margin)

        def weight_grad() -> Tensor:
            return scaled_mm(gc8.t(), xc8, gc_inv.t(), xc_inv, weight.dtype)

        if ctx.defer is not None:  # a zero-bubble B step: the W step runs this GEMM
            ctx.defer(weight_grad)
            return grad_x, None, None, None, None
        return grad_x, weight_grad(), None, None, None


class Fp8History:
    """Every FP8 linear's delayed-scaling state, in two tables over the whole model:
    histories [layers x 6, N, 3] and the step's amaxes [layers x 6, 3].

    `begin` (before a step's forwards) clears the step's amaxes: a forward outside training
    steps (the startup's memory measurement) does not leak into a step. `fold` (once per
    step, after the backward) all-reduces the amax table (MAX) over the
    world: a row is non-zero only on the ranks holding its layer, so this equals the MAX over
    that stage's TP x DP x CP ranks, and every rank then holds every layer's history, so rank
    0's `state_dict` is the whole model's (the checkpoint keeps it in its metadata, as it
    keeps MoEStep's expert biases).
    """

    def __init__(self, recipe: Fp8Recipe, num_layers: int, chunks: Sequence[torch.nn.Module],
                 pstate: ParallelState) -> None:
        self.pstate, rows = pstate, num_layers * len(FP8_LINEARS)
        self.history = torch.zeros(rows, recipe.history_len, 3, dtype=torch.float32,
                                   device=pstate.device)
        self.amax = torch.zeros(rows, 3, dtype=torch.float32, device=pstate.device)
        self.states: list[Fp8State] = []
        self.started = False
        """A fold has run (kept here, not per state: rank 0 may hold no FP8 linear)."""
        for chunk in chunks:
            for layer in getattr(chunk, "layers", []):
                for name, module in layer.named_modules():
                    state = getattr(module, "fp8_state", None)
                    if state is not None:
                        row = layer.layer_number * len(FP8_LINEARS) + FP8_LINEARS.index(name)
                        state.history, state.amax = self.history[row], self.amax[row]
                        self.states.append(state)

    @property
    def nbytes(self) -> int:
        """What the tables hold (the planner's `fp8_scaling_state_bytes`)."""
        return self.history.nbytes + self.amax.nbytes

    def begin(self) -> None:
        self.amax.zero_()

    def fold(self) -> None:
        """The step's amaxes become each history's newest entry (the oldest drops out)."""
        if self.pstate.world_group is not None and dist.get_world_size(
                self.pstate.world_group) > 1:
            comms.all_reduce_(self.amax, self.pstate.world_group, op=dist.ReduceOp.MAX,
                              kind="world")
        self.history.copy_(torch.roll(self.history, 1, dims=1))
        self.history[:, 0] = self.amax
        self._start(True)

    def _start(self, started: bool) -> None:
        self.started = started
        for state in self.states:
            state.started = started

    def state_dict(self) -> dict:
        return {"amax_history": self.history.tolist(), "started": self.started}

    def load_state_dict(self, state: dict) -> None:
        saved = torch.tensor(state["amax_history"], dtype=torch.float32)
        if saved.shape != self.history.shape:
            raise ValueError(f"the checkpoint's FP8 amax history is {list(saved.shape)}, this "
                             f"run's {list(self.history.shape)} (--fp8-amax-history-len)")
        self.history.copy_(saved)
        self._start(bool(state["started"]))


def recipe(train: TrainConfig) -> Fp8Recipe | None:
    """The run's recipe (None without --fp8-format); config.validate refused the others."""
    if train.fp8_format is None:
        return None
    return Fp8Recipe(train.fp8_format, train.fp8_margin, train.fp8_recipe == "delayed",
                     train.fp8_amax_history_len, train.fp8_amax_compute_algo,
                     train.fp8_recipe == "rowwise")


def history(cfg: Config, pstate: ParallelState, chunks: Sequence[torch.nn.Module]
            ) -> Fp8History | None:
    """The run's amax histories under --fp8-recipe delayed (else None)."""
    run_recipe = recipe(cfg.train)
    if run_recipe is None or not run_recipe.delayed:
        return None
    return Fp8History(run_recipe, cfg.model.num_layers, chunks, pstate)


# --- The MoE experts' grouped GEMMs (rowwise current scaling) ----------------------------
# `torch._scaled_grouped_mm` (CUDA only) takes e4m3 operands with rowwise fp32 inverse
# scales: for `a` [M, K] @ `b` [G, K, N] one per row of a ([M]) and one per expert and output
# column of b ([G, N]); for the weight gradient, `a` [K, M] @ `b` [M, N] with the groups along
# M, one per expert and row of a ([G x K]) and per expert and column of b ([G x N]). So every
# expert operand is e4m3 (hybrid's e5m2 gradient is not taken: each row's own scale gives the
# range) and scaled by current amaxes only (no delayed scaling for the experts).


def quantize_rowwise(x: Tensor, dim: int, margin: int = 0, group: comms.Group = None,
                     kind: str = "tp") -> tuple[Tensor, Tensor]:
    """(x in e4m3, inverse scales): one scale per slice along every dim but `dim` (the amax is
    taken over `dim`, reduced over `group`, of `kind`, when that dim is sharded over TP)."""
    amax = x.detach().abs().amax(dim, keepdim=True).float()
    if group is not None and comms.group_size(group) > 1:
        comms.all_reduce_(amax, group, op=dist.ReduceOp.MAX, kind=kind)
    scale = _scale(amax, margin)
    return cast_scaled(x, scale), scale.reciprocal()


def quantize_per_group(x: Tensor, counts: Tensor, margin: int = 0) -> tuple[Tensor, Tensor]:
    """x [M, K] (rows sorted in groups of `counts`) in e4m3, with one inverse scale per group
    and column ([G, K]): the weight gradient's operands, whose contraction runs over rows.
    Every amax is over one expert's rows, all on this rank: no reduction under EP or TP."""
    groups = counts.numel()
    group_of_row = torch.repeat_interleave(torch.arange(groups, device=x.device), counts,
                                           output_size=x.size(0))
    rows = group_of_row[:, None].expand(-1, x.size(1))
    amax = x.new_zeros(groups, x.size(1), dtype=torch.float32).scatter_reduce(
        0, rows, x.detach().abs().float(), "amax")
    scale = _scale(amax, margin)
    return cast_scaled(x, scale[group_of_row]), scale.reciprocal()


def _scale(amax: Tensor, margin: int, dtype: torch.dtype = FWD_DTYPE) -> Tensor:
    """fp8_max / amax / 2^margin, 1 where amax is 0 (any scale maps zeros to zeros)."""
    fp8_max = torch.finfo(dtype).max
    return torch.where(amax > 0, fp8_max / amax, torch.ones_like(amax)) / 2.0 ** margin


def cast_scaled(x: Tensor, scale: Tensor, dtype: torch.dtype = FWD_DTYPE) -> Tensor:
    """x x scale, saturated to the format's range, in `dtype` (elementwise: a piece of a
    tensor casts to the same values as the whole). One fp32 copy at a time, scaled and
    clamped in place: a [tokens, ffn] gradient's transient is 4 bytes an element, not 8."""
    fp8_max = torch.finfo(dtype).max
    wide = x.to(torch.float32, copy=True)
    return wide.mul_(scale).clamp_(-fp8_max, fp8_max).to(dtype)


GROUP_ALIGN_BYTES = 16
"""CUDA's grouped GEMMs address each operand's rows through 16-byte aligned strides (TMA):
torch's `_scaled_grouped_mm` refuses an operand whose leading stride is not a multiple of 16
bytes ("Expected mat_a stride along 0 dim to be multiple of 16 bytes"), which for the weight
gradient, groups along the contraction, is the row count in e4m3; each group's block starts
at its offset, so the groups are kept at multiples of 16 rows too."""


def pad_groups(x: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] (rows sorted in groups of `counts`) with zero rows after each group so that
    every group, and the whole, is a multiple of `GROUP_ALIGN_BYTES` rows (e4m3: 1 byte an
    element); returns (padded x, padded counts). The padded size is a bound known without
    reading the counts (M + 15 per group, rounded up; the last group takes the slack), so
    no device value is read; zero rows add nothing to a contraction over rows nor to a
    group's amax."""
    align, groups, rows = GROUP_ALIGN_BYTES, counts.numel(), x.size(0)
    size = -(-(rows + (align - 1) * groups) // align) * align
    padded = (counts + align - 1) // align * align
    padded = torch.cat([padded[:-1], (size - padded[:-1].sum()).view(1)])
    group = torch.repeat_interleave(torch.arange(groups, device=x.device), counts,
                                    output_size=rows)
    shift = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)
    dest = torch.arange(rows, device=x.device) + shift[group]
    return x.new_zeros(size, x.size(1)).index_copy(0, dest, x), padded


def check_grouped_layout(a8: Tensor, b8: Tensor, a_inv: Tensor, b_inv: Tensor,
                         offs: Tensor) -> None:
    """Refuse on the CPU what CUDA's `_scaled_grouped_mm` refuses: its meta kernel run on
    stand-ins laid out as the CUDA call lays them out, and, groups along the contraction,
    each group's start a multiple of `GROUP_ALIGN_BYTES` rows."""
    b_shape = (*b8.shape[:-2], b8.size(-1), b8.size(-2))
    torch._scaled_grouped_mm(
        torch.empty(a8.shape, dtype=a8.dtype, device="meta"),
        torch.empty(b_shape, dtype=b8.dtype, device="meta").transpose(-1, -2),
        torch.empty(a_inv.shape, device="meta"), torch.empty(b_inv.shape, device="meta"),
        offs=torch.empty(offs.shape, dtype=offs.dtype, device="meta"),
        out_dtype=torch.bfloat16)
    ends = offs.tolist()
    if b8.dim() == 2 and any(end % GROUP_ALIGN_BYTES for end in ends):
        raise RuntimeError(f"_scaled_grouped_mm: group ends {ends} along the contraction are "
                           f"not multiples of {GROUP_ALIGN_BYTES} rows (CUDA refuses them; "
                           "fp8.pad_groups pads them)")


def scaled_grouped_mm(a8: Tensor, b8: Tensor, a_inv: Tensor, b_inv: Tensor, offs: Tensor,
                      out_dtype: torch.dtype) -> Tensor:
    """Per group g of rows (`offs`: cumulative ends, int32), the rowwise-scaled GEMM of its
    block: a8 [M, K] @ b8 [G, K, N] -> [M, N] (a_inv [M], b_inv [G, N]), or, groups along the
    contraction, a8 [K, M] @ b8 [M, N] -> [G, K, N] (a_inv [G x K], b_inv [G x N]).

    `torch._scaled_grouped_mm` on CUDA and on the meta device (as `scaled_mm`); it writes
    bf16 only, so an fp32 model's result is the bf16 one widened there (the meta kernel refuses
    float32, which is how the dry run found it). On the CPU each group's block dequantized and
    multiplied in fp32, which is `scaled_mm` (and `torch._scaled_mm`) per group, bit for bit,
    after `check_grouped_layout` has refused what CUDA would."""
    if a8.is_cuda or a8.is_meta:
        return torch._scaled_grouped_mm(a8.contiguous(), b8.transpose(-1, -2).contiguous()
                                        .transpose(-1, -2), a_inv.contiguous(),
                                        b_inv.contiguous(), offs=offs,
                                        out_dtype=torch.bfloat16).to(out_dtype)
    check_grouped_layout(a8, b8, a_inv, b_inv, offs)
    groups = offs.numel()
    if b8.dim() == 3:
        blocks = zip(a8.split(_sizes(offs)), a_inv.split(_sizes(offs)), b8, b_inv, strict=True)
        return torch.cat([scaled_mm(a, b, sa[:, None], sb[None], out_dtype)
                          for a, sa, b, sb in blocks])
    blocks = zip(a8.split(_sizes(offs), dim=1), a_inv.view(groups, -1),
                 b8.split(_sizes(offs)), b_inv.view(groups, -1), strict=True)
    return torch.stack([scaled_mm(a, b, sa[:, None], sb[None], out_dtype)
                        for a, sa, b, sb in blocks])


def _sizes(offs: Tensor) -> list[int]:
    """Group sizes from cumulative ends (a host read: the emulation's split)."""
    ends = offs.tolist()
    return [end - start for start, end in zip([0, *ends[:-1]], ends, strict=True)]


class Fp8GroupedLinear(torch.autograd.Function):
    """x [N, k] (rows sorted by expert, `counts` per expert) @ w [G, k, n] per expert, with
    the forward, input-gradient and weight-gradient grouped GEMMs in e4m3, rowwise scaled.

    `k_group` / `n_group`: the expert-TP group k / n is sharded over (None: whole here;
    collectives of kind "etp"); the amax of
    a row or column that runs along a sharded dim is reduced over it, so the scales are the
    one-process ones. Backward quantizes the weight afresh along its other dim; the saved
    activation is x in e4m3 scaled per expert and column (1 byte per element), the operand
    the weight gradient needs, its groups zero-padded to CUDA's 16-row alignment
    (`pad_groups`: any routing's counts, empty experts included).
    """

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, counts: Tensor, margin: int,
                k_group: comms.Group, n_group: comms.Group) -> Tensor:
        offs = counts.cumsum(0).to(torch.int32)
        x8, x_inv = quantize_rowwise(x, 1, margin, k_group, kind="etp")
        w8, w_inv = quantize_rowwise(w, 1, margin, k_group, kind="etp")
        x_pad, padded = pad_groups(x, counts)  # the weight gradient's rows, CUDA-aligned
        xg8, xg_inv = quantize_per_group(x_pad, padded, margin)
        ctx.save_for_backward(xg8, xg_inv, w, counts, offs, padded)
        ctx.margin, ctx.n_group, ctx.x_dtype = margin, n_group, x.dtype
        return scaled_grouped_mm(x8, w8, x_inv.view(-1), w_inv.squeeze(1), offs, x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        xg8, xg_inv, w, counts, offs, padded = ctx.saved_tensors
        margin = ctx.margin
        g8, g_inv = quantize_rowwise(grad, 1, margin, ctx.n_group, kind="etp")
        wt8, wt_inv = quantize_rowwise(w.transpose(1, 2), 1, margin, ctx.n_group, kind="etp")
        grad_x = scaled_grouped_mm(g8, wt8, g_inv.view(-1), wt_inv.squeeze(1), offs,
                                   ctx.x_dtype)
        gg8, gg_inv = quantize_per_group(pad_groups(grad, counts)[0], padded, margin)
        grad_w = scaled_grouped_mm(xg8.t(), gg8, xg_inv.view(-1), gg_inv.view(-1),
                                   padded.cumsum(0).to(torch.int32), w.dtype)
        return grad_x, grad_w, None, None, None, None
