"""Memory, FLOP and step-time model for choosing a parallel layout before renting a cluster.

Pure arithmetic (imports `megatron_lite.config`, the schedule table and the model's parameter
list, `megatron_lite.structure`, which our decoder's counts read). Three users:
- `pretrain.py --dry-run` / the start-up log call `estimate_memory(cfg, world_size)` for the
  per-rank bytes of the layout in a `Config`;
- `scripts/plan.py` calls `search(...)`, which enumerates TP x PP x schedule (1F1B, interleaved
  v, ZB-H1, ZBV) x DP x micro-batch x DP sharding x recompute, predicts memory and step time for
  each and ranks them;
- `metrics.py` takes its FLOPs per token from `training_flops_per_token`, so the training log's
  MFUs and the planner's are the same numbers for the same run.

FLOPs per token (`training_flops_per_token`, the one count): 6·N + 12·l·q·s, N =
`matmul_params`, every weight that takes part in a matmul (per layer QKV h·(q + 2k), attention
output q·h, MLP 3·h·f; plus the output layer V·h over the vocabulary padded for the run's TP
size; the input embedding is a lookup, so a tied one counts once, as the output layer), with
l layers, q = heads·head_dim (head_dim = --kv-channels), s = sequence length; the
--add-qkv-bias biases and the --qk-layernorm weights are elementwise work, not matmuls, so
they are parameters (`layer_params`) but not in N, as in Megatron's count. The 12·l·q·s term
counts the attention scores and values as if not causal (PaLM / nanoGPT / torchtitan): the
log's `mfu` and the planner's `Plan.mfu_noncausal`. `causal=True` halves it (Megatron-LM since
2025): the work the step-time model charges, since a causal kernel skips the masked half. The
planner's headline `Plan.mfu` counts it so (the log's `mfu_causal`) and never exceeds the
efficiency the time model allows (`efficiency_bound`), where the non-causal count does at
128K tokens (it counts work that never runs).
Recomputation never counts towards MFU; the step-time model adds it as extra work.

Model states (bytes per parameter, what megatron_lite keeps; `STATE_BYTES`): bf16 runs hold bf16
params (2), an fp32 gradient buffer (4), fp32 master weights (4) and Adam m, v (8) = 18; fp32
runs hold fp32 params (4), fp32 grads (4) and a separate fp32 master + m + v (12) = 20 (the
optimizer keeps its own master copy so ZeRO-1 can shard it). --grad-reduce-in-bf16 makes the
gradient (buffer, ZeRO-2/3 shard and buckets) 2 bytes (`grad_state_bytes`).
--data-parallel-sharding-strategy splits more of it over d DP ranks (`state_bytes`, bf16):
optim (ZeRO-1, `--use-distributed-optimizer`) master + m + v: 2 + 4 + 12/d; optim_grads
(ZeRO-2) also the fp32 gradient: 2 + 16/d; optim_grads_params (ZeRO-3) also the parameters:
18/d between steps, plus during the step the gathered units (bf16: running + prefetched,
and a tied embedding all along) and the fp32 gradient buckets of the units in the backward,
counted in the activation peak at the moments the schedule holds them (`zero3_peak_bytes`).
The textbook ZeRO stages (16 bytes/param, Rajbhandari et al. 2019) are `zero_state_bytes`.

Activations: see `layer_activation_bytes` for the per-layer formula, derived from what autograd
saves in our block (checked against `saved_tensors_hooks` in tests/test_planner.py). The peak
is the fullest moment of the step (`stage_memory`): a layer's backward, the loss, the head's
backward, the embedding's backward, each on top of the in-flight micro-batches' activations
(checked against the meta-device dry run's allocations in tests/optim/test_zero3_*.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatron_lite import plan_time, schedules, structure
from megatron_lite import sharding as sharding_table
from megatron_lite.config import (
    Config,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    TrainConfig,
    ddp_bucket_size,
    fp8_bf16_layers,
    fp8_scaling_state_bytes,
    moe_layer_pattern,
    num_microbatches,
    pipeline_schedule,
    schedule_in_effect,
    stage_layer_counts,
)
from megatron_lite.plan_time import ModelShape

GIB = 2**30

STATE_BYTES = {True: (2, 4, 12), False: (4, 4, 12)}
"""bf16 -> (param, grad, optimizer) bytes per parameter; optimizer = master (bf16 only) + m + v."""



def grad_state_bytes(bf16: bool, grad_bf16: bool = False) -> tuple[int, int, int]:
    """`STATE_BYTES` with the gradient in bf16 under --grad-reduce-in-bf16 (the optimizer's
    buffers, shards and buckets then hold bf16; the masters and moments stay fp32)."""
    pb, gb, ob = STATE_BYTES[bf16]
    return pb, 2 if grad_bf16 else gb, ob


RECOMPUTE_CHOICES = ("none", "selective", "full")


@dataclass(frozen=True)
class Recompute:
    """Activation recomputation, with Megatron's flag semantics."""

    granularity: str = "none"
    """none | selective (RoPE + attention core rerun) | full (whole layers rerun)."""
    method: str = "uniform"
    """full only: uniform = checkpoint groups of N layers; block = only the first N layers."""
    num_layers: int = 1
    """full only: N above (per pipeline chunk for block)."""

    def flags(self) -> list[str]:
        if self.granularity == "none":
            return []
        out = ["--recompute-granularity", self.granularity]
        if self.granularity == "full":
            out += ["--recompute-method", self.method, "--recompute-num-layers",
                    str(self.num_layers)]
        return out

    def label(self) -> str:
        if self.granularity != "full":
            return self.granularity
        return f"full/{self.method[0]}{self.num_layers}"


# ---------------------------------------------------------------------------------------------
# Matmul weights and FLOPs per token (see the module docstring for the convention)


BLOCKS = ("llama", "gpt")


def gpt_shape(model: ModelConfig, tp: int = 1) -> ModelShape:
    """`model` as a GPT block (`ModelShape.block`): --ffn-hidden-size is the GeLU MLP's width."""
    return dataclasses.replace(ModelShape.from_config(model, tp), gated_mlp=False, block="gpt",
                               layer_matmul=0)


def gpt_memory_stand_in(model: ModelConfig) -> ModelConfig:
    """The Llama config the memory model sizes a GPT block with: SwiGLU of width 2f/3 rounded
    to 128 has the GeLU MLP's parameters (3·h·2f/3 = 2·h·f). Its activations are a planning
    approximation (GPT's LayerNorm, GeLU and dropout masks are not what our block saves)."""
    return dataclasses.replace(model, ffn_hidden_size=max(128, round(2 * model.ffn_hidden_size
                                                                    / 3 / 128) * 128))


@dataclass(frozen=True)
class RunOptions:
    """How the run computes besides its layout (scripts/plan.py --block, --attention,
    --grad-reduce-in-bf16): what the step-time model times."""

    block: str = "llama"
    """`BLOCKS`: llama (ours) or gpt (planning only, `ModelShape.block`)."""
    attention: str = "flash"
    """flash (ours: SDPA / flash attention) or unfused (materialised softmax + dropout, as
    Megatron-LM ran GPT in 2021)."""
    grad_reduce_bytes: int = 4
    """Bytes per gradient element in the DP reduction (2: --grad-reduce-in-bf16, and
    Megatron-LM 2021's fp16 default). 2 also stores the gradients in 16 bits, as
    `estimate_memory` counts --grad-reduce-in-bf16 (`grad_state_bytes`)."""
    p2p_scatter_gather: bool = False
    """Megatron-LM's scatter-gather across stages (its 2021 default, not ours): without SP a
    stage sends 1/t of each activation and the next all-gathers it over TP."""
    dtype_bytes: int = 2
    """Activation element size the time model moves: 2 (bf16), 4 (fp32, the CPU runs). The
    memory model keeps bf16."""
    moe: MoEConfig | None = None
    """Mixture of experts (--num-experts ...): expert states split over EP (`Layout.ep`) and
    sharded over expert-DP, the active experts' GEMMs and the token dispatch in the step."""
    fp8: TrainConfig | None = None
    """The run's --fp8-* flags (a TrainConfig holding them; None or no --fp8-format: bf16
    GEMMs): memory counts what FP8 linears save, the fp8 weight copies and the amax
    histories; the step time keeps bf16 GEMMs (FP8's speed is measured, not assumed)."""


def model_shape(model: ModelConfig, tp: int, block: str = "llama",
                moe: MoEConfig | None = None) -> ModelShape:
    """The shape FLOPs and time are counted on, for `block` (with `moe`'s active experts)."""
    return gpt_shape(model, tp) if block == "gpt" else ModelShape.from_config(model, tp, moe)


def matmul_params_per_layer(shape: ModelShape) -> int:
    """Matmul weights of one transformer layer, all TP ranks together: our decoder's from its
    parameter list (`ModelShape.layer_matmul`), else QKV h·(q + 2k), attention output q·h,
    MLP 3·h·f (2·h·f without gating)."""
    if shape.layer_matmul:
        return shape.layer_matmul
    q, kv = shape.heads * shape.head_dim, shape.query_groups * shape.head_dim
    mlp = (3 if shape.gated_mlp else 2) * shape.hidden * shape.ffn_hidden
    return shape.hidden * (q + 2 * kv) + q * shape.hidden + mlp


def matmul_params(shape: ModelShape) -> int:
    """The N of 6N: every layer's matmul weights plus the output layer V·h; a MoE layer counts
    its active weights (router E·h, 3·h x the active SwiGLU width) instead of the dense MLP."""
    moe = shape.moe_layers * shape.hidden * (
        shape.moe_experts + 3 * (shape.moe_active_ffn - shape.ffn_hidden))
    return shape.layers * matmul_params_per_layer(shape) + moe + shape.vocab * shape.hidden


def attention_flops_per_layer(shape: ModelShape, seq_length: int, causal: bool) -> float:
    """Training FLOPs per token of one layer's attention core, which has no weights: scores
    q·kᵀ and the weighted sum of v, 2·s·q each forward, x 3 with backward; half when causal."""
    return (6 if causal else 12) * seq_length * shape.heads * shape.head_dim


def training_flops_per_token(shape: ModelShape, seq_length: int, causal: bool = False) -> float:
    """Model FLOPs per trained token, the MFU numerator: 6·N + layers x attention core.

    `causal=False` is the headline count (the log's `mfu`, the planner's MFU); `causal=True`
    is the log's causal figure. Recomputation is not counted.
    """
    attention = shape.layers * attention_flops_per_layer(shape, seq_length, causal)
    return 6.0 * matmul_params(shape) + attention


# ---------------------------------------------------------------------------------------------
# Parameters


def layer_params(model: ModelConfig, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank (megatron_lite/structure.py): its
    matmul weights split over TP (with --kv-channels d the attention ones are
    h·(heads + 2·groups)·d and heads·d·h), the --add-qkv-bias biases (heads + 2·groups)·d split
    likewise, plus the RMSNorm weights every rank holds whole: two h-wide, and two d-wide with
    --qk-layernorm."""
    return sum(p.local_numel(tp) for p in structure.layer_parameters(model, 0))


def stage_params(model: ModelConfig, tp: int, pp: int, stage: int, num_stage_layers: int,
                 v_shape: bool = False) -> int:
    """Parameters held by one rank of a pipeline stage.

    The first stage holds the vocab-parallel embedding; the last holds the final norm and the
    output layer, which with tied weights and pp > 1 is a second copy of the embedding
    (model/llama.py), and with pp = 1 and tied weights is the embedding itself. `v_shape`
    (ZBV) puts the final norm and the output layer on the first stage, where a tied output
    layer is the embedding itself.
    """
    vocab = model.padded_vocab_size(tp) * model.hidden_size // tp
    n = num_stage_layers * layer_params(model, tp)
    head_stage = 0 if v_shape else pp - 1
    if stage == 0:
        n += vocab
    if stage == head_stage:
        n += model.hidden_size
        if model.untie_embeddings_and_output_weights or head_stage != 0:
            n += vocab
    return n


def total_params(model: ModelConfig) -> int:
    """Unique parameters of the whole model (unpadded vocab, tied weights counted once)."""
    return sum(p.numel for p in structure.model_parameters(model, model.vocab_size))


def stage_layer_ids(counts: list[int], chunks: int, stage: int) -> list[int]:
    """Global layer ids of `stage` when each stage's `counts` layers are cut into `chunks`
    equal pieces dealt round-robin (pipeline/partition.py's interleaving rule)."""
    ids, start = [], 0
    for _ in range(chunks):
        for s, count in enumerate(counts):
            if s == stage:
                ids += range(start, start + count // chunks)
            start += count // chunks
    return ids


def fp8_gathered_params(model: ModelConfig, moe: MoEConfig | None, tp: int,
                        layer_ids: list[int], bf16_layers: frozenset[int]) -> int:
    """Elements of the FP8 linears' weights on one rank of a stage holding `layer_ids` (every
    matmul weight of a layer but the router's and the routed experts', outside the
    --first-last-layers-bf16 layers): under --fp8-param-gather each has a 1-byte fp8 copy
    (optim/fp8_params.py)."""
    return sum(p.local_numel(tp) for i in layer_ids if i not in bf16_layers
               for p in structure.layer_parameters(model, i, moe)
               if p.matmul and not p.expert and not p.name.endswith(".router.weight"))


def moe_stage_params(model: ModelConfig, moe: MoEConfig, tp: int, ep: int,
                     layer_ids: list[int]) -> tuple[int, int]:
    """(change to the dense parameters, routed-expert parameters) on one rank of a stage
    holding `layer_ids`: each MoE layer trades the dense MLP for the router and the shared
    expert (TP-split like the dense MLP, the router whole), and holds E/ep experts, each
    split over expert TP (structure.moe_parameters)."""
    pattern = moe_layer_pattern(moe.moe_layer_freq, model.num_layers)
    on = sum(pattern[i] for i in layer_ids)
    if not on:
        return 0, 0
    first = pattern.index(True)
    dense = sum(p.local_numel(tp) for p in structure.layer_parameters(model, first))
    mixed = structure.layer_parameters(model, first, moe)
    routed = sum(p.local_numel(expert_tp(moe, tp), ep) for p in mixed if p.expert)
    rest = sum(p.local_numel(tp) for p in mixed if not p.expert)
    return on * (rest - dense), on * routed


def expert_tp(moe: MoEConfig, tp: int) -> int:
    """The expert-TP size: --expert-tensor-parallel-size, else the TP size."""
    return moe.expert_tensor_parallel_size or tp


def moe_saved_bytes(model: ModelConfig, moe: MoEConfig, a: ActivationSetup,
                    moe_layers: int, ep: int = 1) -> float:
    """Saved-for-backward bytes that `moe_layers` MoE layers add to one micro-batch beyond
    dense MLPs. Every expert-TP rank routes T·e/t of the T = b·s/cp tokens (under SP
    gathered over its e expert-TP ranks), so with an even load its experts see T·k·e/t rows
    and keep: the rows entering the grouped GEMM, the weighted outputs and the combine's
    input (3 x h), the SwiGLU's gate|up and the down projection's input (3 x f/e); the
    shared expert keeps its own 3 x f_s/t per token; the dense MLP's 3 x f/t per token is
    not there. Router logits (E per token) are neglected."""
    e, etp = 2 if a.bf16 else 4, expert_tp(moe, a.tp)
    tokens = local_seq(model, a) * a.micro_batch
    h, f = model.hidden_size, (moe.moe_ffn_hidden_size or model.ffn_hidden_size) // etp
    shared = 3 * (moe.moe_shared_expert_intermediate_size or 0) // a.tp
    routed = moe.moe_router_topk * (3 * h + 3 * f) * etp / a.tp
    plain = moe_layers * e * tokens * (routed + shared - 3 * model.ffn_hidden_size // a.tp)
    return plain + (moe_layers * _moe_fp8_delta(model, moe, a, ep) if a.fp8 else 0.0)


def _moe_fp8_delta(model: ModelConfig, moe: MoEConfig, a: ActivationSetup, ep: int) -> float:
    """Under --fp8-format, what one MoE layer saves beyond `moe_saved_bytes`' plain count: the
    dense MLP's FP8 terms (`fp8_saved_delta`) are not there, except that the router keeps the
    norm's output in any case; the shared expert's FP8 linears add theirs; the routed
    experts (layers/fp8.py Fp8GroupedLinear) keep their rows entering each grouped GEMM in
    e4m3 instead of e bytes and no weight copy, plus per GEMM an fp32 scale per local expert
    and input column and the int32 group ends; the weight gradient's copy is padded to
    ceil16(rows + 15 x local experts) rows (fp8.pad_groups: CUDA's 16-byte alignment, a
    bound fixed without reading the counts), with its int64 padded counts."""
    s, b, e, t = local_seq(model, a), a.micro_batch, 2 if a.bf16 else 4, a.tp
    tokens, h = s * b, model.hidden_size
    shard = t if (a.sequence_parallel and t > 1) else 1
    f, fs = model.ffn_hidden_size / t, (moe.moe_shared_expert_intermediate_size or 0) / t
    dense = (_fp8_linear_bytes(tokens, h, 2 * f, e * tokens * h / shard, a)
             + _fp8_linear_bytes(tokens, f, h, e * tokens * f, a))
    shared = (_fp8_linear_bytes(tokens, h, 2 * fs, 0, a)
              + _fp8_linear_bytes(tokens, fs, h, e * tokens * fs, a) if fs else 0.0)
    etp = expert_tp(moe, t)
    routed_f = (moe.moe_ffn_hidden_size or model.ffn_hidden_size) / etp
    routed = (1 - e) * tokens * etp / t * moe.moe_router_topk * (h + routed_f)
    local = moe.num_experts // ep
    scales = 4 * local * (h + routed_f + 2)
    rows = math.ceil(tokens * etp / t * moe.moe_router_topk)
    pad = (-(-(rows + 15 * local) // 16) * 16 - rows) * (h + routed_f) + 2 * 8 * local
    return shared + routed + scales + pad - dense


def moe_total_params(model: ModelConfig, moe: MoEConfig) -> tuple[int, int]:
    """(all parameters, active parameters per token) of a MoE model (tied weights once,
    unpadded vocab): active = the others + top-k of each MoE layer's E experts."""
    params = structure.model_parameters(model, model.vocab_size, moe)
    experts = sum(p.numel for p in params if p.expert)
    total = sum(p.numel for p in params)
    return total, total - experts + experts * moe.moe_router_topk // (moe.num_experts or 1)


# ---------------------------------------------------------------------------------------------
# Model states


def zero_state_bytes(num_params: float, dp: int, stage: int, param_bytes: float = 2,
                     grad_bytes: float = 2, optim_bytes: float = 12) -> float:
    """Per-rank model-state bytes for ZeRO stage 0-3 (textbook mixed-precision Adam: 2+2+12)."""
    if stage >= 1:
        optim_bytes /= dp
    if stage >= 2:
        grad_bytes /= dp
    if stage >= 3:
        param_bytes /= dp
    return num_params * (param_bytes + grad_bytes + optim_bytes)


SHARDING = sharding_table.NAMES
"""--data-parallel-sharding-strategy values; index = ZeRO stage."""


def state_bytes(num_params: int, dp: int, sharding: str, bf16: bool,
                full_grad_accumulator: bool = False, grad_bf16: bool = False
                ) -> tuple[int, int, int]:
    """(param, grad, optimizer) bytes on one rank, as megatron_lite stores them.

    Sharded parts are ceil(n/dp) elements (bucket padding aside); ZeRO-3's gathered units
    come and go within the step (`gathered_unit_bytes`). ZeRO-2 with
    --sharded-grad-accumulation full-buffer adds a full-size accumulator in the parameter
    dtype (bucket tensors in flight are not counted, as for the other strategies).
    `grad_bf16`: --grad-reduce-in-bf16.
    """
    split = sharding_table.get(sharding)
    pb, gb, ob = grad_state_bytes(bf16, grad_bf16)
    owned = math.ceil(num_params / dp) if split.state else num_params
    params = owned * pb if split.params else num_params * pb
    grads = owned * gb if split.grads else num_params * gb
    if split.grads and not split.params and full_grad_accumulator:
        grads += num_params * pb
    return params, grads, owned * ob


def sharding_formula(sharding: str, dp: int, bf16: bool = True, grad_bf16: bool = False
                     ) -> tuple[str, float]:
    """The issue's bytes-per-parameter formula of a strategy and its value at `dp` (the
    gathered ZeRO-3 unit is not in it), e.g. ("2 + 16/d", 2.25) for optim_grads at d = 64."""
    pb, gb, ob = grad_state_bytes(bf16, grad_bf16)
    split = sharding_table.get(sharding)
    whole = [b for b, cut in ((pb, split.params), (gb, split.grads), (ob, split.state))
             if not cut]
    cut = sum((pb, gb, ob)) - sum(whole)
    form = " + ".join([str(b) for b in whole] + ([f"{cut}/d"] if cut else []))
    return form + (" + unit" if split.params else ""), sum(whole) + cut / dp


def largest_unit_params(model: ModelConfig, tp: int) -> int:
    """ZeRO-3's largest gathered unit on one TP rank: a layer, the embedding or the head."""
    vocab = model.padded_vocab_size(tp) * model.hidden_size // tp
    return max(layer_params(model, tp), vocab + model.hidden_size)


ZERO3_GRAD_BUCKETS = 3
"""ZeRO-3's full-size gradient buckets at once in the backward: the unit accumulating, and
the inputs of the reduce-scatters in flight (optim/sync_sharded.MAX_INFLIGHT_SCATTERS = 2)."""


def zero3_units(model: ModelConfig, tp: int) -> tuple[int, int, int]:
    """(embedding, layer, head) parameters that ZeRO-3 owns per unit on one TP rank: a tied
    output layer is the embedding's weight, so the head owns only the final norm (ZeRO-3
    refuses PP: one chunk holds all three)."""
    vocab = model.padded_vocab_size(tp) * model.hidden_size // tp
    head = model.hidden_size + (vocab if model.untie_embeddings_and_output_weights else 0)
    return vocab, layer_params(model, tp), head


def gathered_unit_bytes(model: ModelConfig, tp: int, bf16: bool) -> int:
    """The most parameter bytes ZeRO-3 holds gathered at once (optim/zero3.py): the running
    unit and the prefetched neighbour; a tied embedding is read by the head, so it stays
    gathered from its forward to its backward, beside a layer and the head (the last
    layer's forward with the head prefetched, the head's backward with the last layer
    prefetched) or two layers."""
    emb, layer, head = zero3_units(model, tp)
    if not model.num_layers:
        units = emb + head
    elif not model.untie_embeddings_and_output_weights:
        units = emb + layer + max(layer, head)
    else:
        units = max(emb + layer, layer + max(layer, head))
    return units * STATE_BYTES[bf16][0]


def zero3_layer_params(model: ModelConfig, tp: int, moe: MoEConfig | None = None, ep: int = 1
                       ) -> list[tuple[list[int], list[int]]]:
    """Per layer, the elements of its parameters on one rank in backward's (reverse) order:
    (those synced over DP x CP, the routed experts' synced over expert-DP). Each set is its
    own parameter buffer (optim/param_buffers.py), so a MoE layer is one ZeRO-3 unit gathered
    from two buffers, its experts being E/ep of them."""
    out = []
    for i in range(model.num_layers):
        params = list(reversed(structure.layer_parameters(model, i, moe)))
        out.append(([p.local_numel(tp) for p in params if not p.expert],
                    [p.local_numel(expert_tp(moe, tp), ep) for p in params if p.expert]))
    return out


def zero3_grad_buckets(model: ModelConfig, tp: int, bucket_size: int,
                       moe: MoEConfig | None = None, ep: int = 1) -> list[list[int]]:
    """Elements of ZeRO-3's gradient buckets per unit, in the order one micro-batch's
    backward reduce-scatters them: the head, the layers from the top, the embedding.

    As optim/buffers.build_layout cuts them: parameters in reverse order, a bucket closed
    once it holds `bucket_size` elements and at a unit's end (alignment padding left out);
    a MoE layer's experts are cut in their own buffer's buckets.
    A tied output layer's gradient is the embedding's (its unit owns the weight).
    """
    emb, _, head = zero3_units(model, tp)
    h = model.hidden_size

    def cut(sizes: list[int]) -> list[int]:
        buckets, n = [], 0
        for size in sizes:
            n += size
            if n >= bucket_size:
                buckets, n = [*buckets, n], 0
        return buckets + ([n] if n else [])

    head_params = [head - h, h] if model.untie_embeddings_and_output_weights else [h]
    layers = [cut(dense) + cut(experts)
              for dense, experts in reversed(zero3_layer_params(model, tp, moe, ep))]
    return [cut(head_params), *layers, [emb]]


# ---------------------------------------------------------------------------------------------
# Activations


@dataclass(frozen=True)
class ActivationSetup:
    """What decides saved-activation bytes besides the model shape."""

    micro_batch: int
    tp: int = 1
    sequence_parallel: bool = False
    bf16: bool = True
    fused_kernels: bool = True
    """Triton kernels (save inputs only) vs the plain-PyTorch references (save fp32 temporaries)."""
    fp32_attention_core: bool = False
    """bf16 on CPU: model/llama.py runs SDPA in fp32 there, which saves fp32 q, k, v and out."""
    cp: int = 1
    """Context-parallel size: a rank holds s/cp tokens of each sequence, and ring attention
    saves what flash attention does for them (its local q, k, v, out, log-sum-exp)."""
    fp8: bool = False
    """--fp8-format: the layers' linears save their input and weight in e4m3 (`fp8_saved_delta`;
    --first-last-layers-bf16 is not told apart: every layer is counted as FP8)."""
    fp8_param_gather: bool = False
    """--fp8-param-gather: the e4m3 weight a linear saves is a view of the gathered fp8 copy
    (counted with the parameters), not new bytes."""
    fp8_rowwise: bool = False
    """--fp8-recipe rowwise: a linear saves its input in e4m3 with a scale per input feature
    and no weight copy (layers/fp8.py Fp8RowwiseLinear)."""


def _fp8_linear_bytes(rows: float, fan_in: float, fan_out: float, saved_in: float,
                      a: ActivationSetup) -> float:
    """What an FP8 linear saves beyond a plain one: its input as e4m3 [rows, fan_in] in place
    of the `saved_in` bytes the plain one kept, the e4m3 weight [fan_out, fan_in] (a plain
    linear saves the parameter itself, no new bytes; nor does one under --fp8-param-gather)
    and the two fp32 inverse scales. Rowwise: no weight copy, an fp32 scale per input feature."""
    if a.fp8_rowwise:
        return rows * fan_in - saved_in + 4 * fan_in
    return rows * fan_in - saved_in + (0 if a.fp8_param_gather else fan_out * fan_in) + 8


def fp8_saved_delta(model: ModelConfig, a: ActivationSetup, selective: bool = False) -> float:
    """Bytes an FP8 dense layer saves beyond the same layer in `a`'s dtype (layers/fp8.py
    Fp8Linear, one TP rank). qkv and gate/up: the input, under SP gathered before the GEMM,
    is whole [s, b, h] in e4m3 (the plain one keeps the e-byte [s/T, b, h] shard). The
    projection's input is the attention output: flash attention keeps it anyway (then the e4m3
    copy is extra) unless selective recompute drops the core or the CPU's fp32 core saved its
    own fp32 copy (then the e-byte input goes). Down: e4m3 instead of e bytes of [s, b, f/t]."""
    s, b, e, t = local_seq(model, a), a.micro_batch, 2 if a.bf16 else 4, a.tp
    tokens, h, f = s * b, model.hidden_size, model.ffn_hidden_size / t
    q, k = (model.num_attention_heads * model.head_dim / t,
            model.num_query_groups * model.head_dim / t)
    shard = t if (a.sequence_parallel and t > 1) else 1
    proj_own = selective or (a.fp32_attention_core and a.bf16)
    return (_fp8_linear_bytes(tokens, h, q + 2 * k, e * tokens * h / shard, a)
            + _fp8_linear_bytes(tokens, q, h, e * tokens * q if proj_own else 0, a)
            + _fp8_linear_bytes(tokens, h, 2 * f, e * tokens * h / shard, a)
            + _fp8_linear_bytes(tokens, f, h, e * tokens * f, a))


def local_seq(model: ModelConfig, a: ActivationSetup) -> int:
    """Tokens of one sequence on one rank before SP: s / cp."""
    return model.seq_length // a.cp


def _norm_and_linear_input_bytes(model: ModelConfig, a: ActivationSetup) -> float:
    """One RMSNorm plus the saved input of the column-parallel linear that consumes it.

    With SP both are [s/t, b, h]: the linear saves its local shard and re-gathers it in
    backward (layers/linear.py), so the whole term shrinks by t.
    """
    s, b, h, e = local_seq(model, a), a.micro_batch, model.hidden_size, 2 if a.bf16 else 4
    shard = a.tp if (a.sequence_parallel and a.tp > 1) else 1
    # fused: x (e) + rstd (4/row); reference: fp32 x, fp32 x*rstd, rstd, fp32 weight copy
    own = (e * s * b * h + 4 * s * b) if a.fused_kernels else (8 * s * b * h + 4 * s * b)
    weight_copy = 0 if (a.fused_kernels or not a.bf16) else 4 * h
    linear_in = e * s * b * h
    return (own + linear_in) / shard + weight_copy


def layer_activation_bytes(model: ModelConfig, a: ActivationSetup,
                           selective: bool = False) -> float:
    """Bytes one transformer layer saves for backward, per micro-batch, on one TP rank.

    Korthikanti et al. 2022 (34·sbh + 5·a·s²·b for GPT) adapted to our block: RMSNorm (no
    biases), SwiGLU, no dropout (no masks), SDPA/flash attention (no a·s² scores; it saves q, k,
    v, out and an fp32 log-sum-exp per row). With s, b, h, f = ffn, q = heads·d, k = groups·d,
    e = 2 (bf16) or 4 (fp32), t = TP, T = t with SP else 1:

      norms     2 · (c·sbh + 4sb + e·sbh)/T         c = e fused, 8 reference (fp32 x and x·rstd);
                                                     e·sbh = the column linear's saved input,
                                                     under SP its local [s/t, b, h] shard (the
                                                     full input is re-gathered in backward)
      attention e·sb·(3q + 3k)/t + 4·heads·sb/t      qkv output (kept alive by the v view) +
                                                     rotated q, k + out; log-sum-exp
      MLP       (3e)·sbf/t fused | (12 + e)·sbf/t    gate|up output + product; the reference adds
                                                     fp32 gate, up and silu(gate) copies

    With bf16 reference kernels add 4h per norm (fp32 weight copy) and 8·s·d (fp32 RoPE tables).
    --qk-layernorm adds, over the q and k heads (q + k channels, heads + groups rows):
    (c'·sb·(q + k) + 4·sb·(heads + groups))/t, c' = e fused (the kernel's contiguous copy of
    the strided q/k input), e reference fp32 (x·rstd), 8 reference bf16 (fp32 x and x·rstd,
    plus 2 x 4d for the weights' fp32 copies); the 4 bytes are rstd per head row. Selective
    recompute drops it with the core.
    bf16 on CPU runs SDPA in fp32 (`fp32_attention_core`): attention is then
    4·sb·(2q + 2k)/t (fp32 q, k, v, out) + e·sb·q/t (projection input) + log-sum-exp.
    For MHA, f = 8h/3, fused bf16: about 34.7·sbh without TP, vs 34·sbh + 5·a·s²·b in the paper.
    Under context parallelism s is the rank's s/cp tokens (`local_seq`): every term shrinks by cp.
    `selective` reruns RoPE + SDPA in backward: it keeps the qkv output, drops rotated q, k and
    the log-sum-exp (out is still saved by the projection).
    """
    s, b, e = local_seq(model, a), a.micro_batch, 2 if a.bf16 else 4
    q, k, f = model.num_attention_heads * model.head_dim, model.num_query_groups * model.head_dim, \
        model.ffn_hidden_size
    t = a.tp
    norms = 2 * _norm_and_linear_input_bytes(model, a)
    qkv_out, rotated, out = e * s * b * (q + 2 * k), e * s * b * (q + k), e * s * b * q
    lse = 4 * model.num_attention_heads * s * b
    if a.fp32_attention_core and a.bf16 and not selective:
        # SDPA saves its fp32 copies of q, k, v and its fp32 out; v no longer views the bf16
        # qkv output, so nothing keeps that alive.
        qkv_out, rotated = 0, 4 * s * b * (2 * q + 2 * k)
    attn = (qkv_out + out + (0 if selective else rotated + lse)) / t
    if model.qk_layernorm and not selective:
        per_channel = e if a.fused_kernels or not a.bf16 else 8
        rows = model.num_attention_heads + model.num_query_groups
        attn += (per_channel * s * b * (q + k) + 4 * s * b * rows) / t
        if not a.fused_kernels and a.bf16:
            attn += 8 * model.head_dim
    if not a.fused_kernels and a.bf16 and not selective:
        attn += 8 * s * model.head_dim
    mlp = (3 * e if a.fused_kernels else 12 + e) * s * b * f / t
    return norms + attn + mlp + (fp8_saved_delta(model, a, selective) if a.fp8 else 0.0)


def layer_input_bytes(model: ModelConfig, a: ActivationSetup) -> float:
    """What full recomputation keeps per checkpointed group: its [s(/t), b, h] input."""
    e = 2 if a.bf16 else 4
    shard = a.tp if (a.sequence_parallel and a.tp > 1) else 1
    return e * local_seq(model, a) * a.micro_batch * model.hidden_size / shard


def head_activation_bytes(model: ModelConfig, a: ActivationSetup) -> float:
    """Last stage: final norm + output-layer input + the logits gradient the loss saves.

    The output layer is column-parallel like the others: under SP it saves its [s/t, b, h]
    input shard, not the gathered input. The vocab-parallel cross-entropy computes its
    gradient in forward and saves it in the logits dtype: e·s·b·V/t (V padded).
    """
    e = 2 if a.bf16 else 4
    vocab = model.padded_vocab_size(a.tp) // a.tp
    return _norm_and_linear_input_bytes(model, a) + e * local_seq(model, a) * a.micro_batch * vocab


def head_transient_bytes(model: ModelConfig, a: ActivationSetup) -> float:
    """Live only during the loss: the logits (e), plus, in the bf16 reference loss, their fp32
    copy and the fp32 exp (2 x 4). The fused kernel reads the logits in place and writes the
    saved gradient directly; an fp32 reference loss works in the logits and the gradient."""
    e = 2 if a.bf16 else 4
    extra = 8 if a.bf16 and not a.fused_kernels else 0
    return ((e + extra) * local_seq(model, a) * a.micro_batch * model.padded_vocab_size(a.tp)
            // a.tp)


def layer_backward_bytes(model: ModelConfig, a: ActivationSetup) -> float:
    """What one layer's backward allocates beside the activations it saved, at its fullest:
    the incoming gradient [s(/t), b, h] and, in the MLP's backward, two [s, b, f/t]-sized
    tensors at once: the down projection's input gradient beside its weight gradient
    [f/t, h], then SwiGLU's two input gradients (the saved ones go as they are used).
    --fp8-recipe rowwise requantizes each weight along its other dim there: the gate/up
    weight's fp32 copy and its e4m3 result, 5 bytes an element, at once."""
    e = 2 if a.bf16 else 4
    tokens = local_seq(model, a) * a.micro_batch
    shard = a.tp if (a.sequence_parallel and a.tp > 1) else 1
    h, f = model.hidden_size, model.ffn_hidden_size / a.tp
    requantized = 5 * h * 2 * f if a.fp8_rowwise else 0
    return e * (tokens * h / shard + tokens * f + max(tokens, h) * f) + requantized


def output_weight_grad_bytes(model: ModelConfig, a: ActivationSetup) -> float:
    """The output layer's weight gradient, [V/t, h] in the parameters' dtype, made in the
    head's backward; tied to the embedding it waits there for the embedding's own."""
    return (2 if a.bf16 else 4) * model.padded_vocab_size(a.tp) // a.tp * model.hidden_size


def head_backward_bytes(model: ModelConfig, a: ActivationSetup) -> float:
    """The head's backward beside its saved activations: the output layer's weight gradient
    and its input gradient [s, b, h] (the logits gradient it reads is the saved one)."""
    e = 2 if a.bf16 else 4
    return (output_weight_grad_bytes(model, a)
            + e * local_seq(model, a) * a.micro_batch * model.hidden_size)


def chunk_activation_bytes(model: ModelConfig, a: ActivationSetup, layers: int,
                           rc: Recompute) -> tuple[float, float]:
    """(saved bytes per micro-batch, what recomputation adds to them at its peak) for `layers`
    layers. Uniform: the top group is rerun while every group's input is still kept. Block:
    the first N layers are rerun one by one after the layers above them have freed at least
    a layer's activations, so nothing is added unless all are checkpointed."""
    full = layer_activation_bytes(model, a)
    if rc.granularity == "selective":
        return layers * layer_activation_bytes(model, a, selective=True), 0.0
    if rc.granularity != "full":
        return layers * full, 0.0
    n = max(1, min(rc.num_layers, layers))
    kept = layer_input_bytes(model, a)
    if rc.method == "block":
        return n * kept + (layers - n) * full, full if n == layers else 0.0
    return math.ceil(layers / n) * kept, n * full


def in_flight(pp: int, stage: int, chunks: int, microbatches: int,
              schedule: str | None = None) -> int:
    """Peak micro-batch chunks whose activations a stage holds at once (`Schedule.in_flight`).

    Zero-bubble schedules hold a micro-batch from its F to its W (the queued weight GEMMs keep
    the linears' inputs and output gradients, counted here as the chunk's activations): ZB-H1
    p on every stage (1F1B's first-stage peak), ZBV 2p chunks of half a stage (the same bytes).
    """
    return schedules.get(schedule, chunks).in_flight(pp, stage, chunks, microbatches)


def zero3_peak_bytes(model: ModelConfig, spec: StageSpec, saved: float, ids: float,
                     head: float, layer_step: float) -> float:
    """ZeRO-3's activation peak (pp = 1, one micro-batch in flight): the fullest moment of a
    micro-batch's step, each with what optim/zero3.py keeps gathered and optimizer.py's
    gradient buckets hold then. `saved`: the layers' activations, `head`: the head's,
    `layer_step`: a layer's backward working set (`stage_memory`).

    - the loss: every activation and the logits; gathered the head (tied: and the embedding,
      gathered from its forward to its backward all along);
    - the head's backward: the output layer's gradients instead of the logits, the last layer
      prefetched; untied, its weight gradient beside its bucket (the head's own unit);
    - layer j's backward (from the top): the activations of layers 0..j, the working set,
      tied: the output layer's weight gradient, held for the embedding's; gathered layer j
      and the prefetched one below; the bucket accumulating beside the inputs of the
      reduce-scatters still in flight (ZERO3_GRAD_BUCKETS - 1, the newest);
    - the embedding's backward: its weight gradient (tied: beside the output layer's and
      their sum), then its bucket.

    With several micro-batches the previous one's last reduce-scatters still hold their
    inputs when the next begins. Recomputation changes only `saved` and `layer_step`.
    """
    a = spec.act
    pb, gb, _ = grad_state_bytes(a.bf16, spec.grad_bf16)
    emb, _, head_unit = zero3_units(model, spec.tp)
    layers = [sum(d) + sum(e) for d, e in zero3_layer_params(model, spec.tp, spec.moe, spec.ep)]
    tied, n = not model.untie_embeddings_and_output_weights, model.num_layers
    kept = emb if tied else 0
    weight_grad = output_weight_grad_bytes(model, a)
    units = zero3_grad_buckets(model, spec.tp, spec.bucket_size, spec.moe, spec.ep)
    flying = ZERO3_GRAD_BUCKETS - 1
    held = [b for unit in units for b in unit][-flying:] if spec.microbatches > 1 else []

    def buckets_bytes(buckets: list[int]) -> float:
        """The most gradient bytes while `buckets` accumulate and are reduce-scattered."""
        most = 0
        for size in buckets:
            most = max(most, size + sum(held[-flying:]))
            held.append(size)
        return gb * most

    acts = saved + ids
    gathered_head = pb * (head_unit + kept + (layers[-1] if n else 0))
    moments = [acts + head + head_transient_bytes(model, a) + pb * (head_unit + kept)
               + gb * sum(held),
               acts + head + head_backward_bytes(model, a) + gathered_head + gb * sum(held)]
    head_grads = buckets_bytes(units[0])
    moments.append(acts + (0 if tied else weight_grad) + gathered_head + head_grads)
    for j in reversed(range(n)):
        below = layers[j - 1] if j else (0 if tied else emb)
        moments.append(ids + saved * (j + 1) / n + layer_step
                       + pb * (kept + layers[j] + below) + buckets_bytes(units[n - j]))
    before = gb * sum(held[-flying:])
    sums = 3 * weight_grad if tied else weight_grad
    moments.append(ids + pb * emb + max(sums + before, weight_grad + buckets_bytes(units[-1])))
    return max(moments)


# ---------------------------------------------------------------------------------------------
# Per-rank memory


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one rank of one pipeline stage (no allocator or communication allowance)."""

    stage: int
    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes_per_microbatch: float
    """Saved-for-backward bytes of one micro-batch through all of this stage's chunks (what
    saved_tensors_hooks measure), including the head on the last stage."""
    in_flight: int
    """Peak micro-batch chunks alive at once (see `in_flight`)."""
    activation_bytes: float
    """Peak: in-flight chunks x per-chunk bytes + the fullest moment of the step: one layer's
    backward working set and the group being recomputed, or on the last stage the head with
    the loss's transient logits or the output layer's gradients (ZeRO-3: `zero3_peak_bytes`)."""

    teacher_bytes: float = 0.0
    """Distillation (`teacher_bytes`): the frozen teacher's weights on this rank and the
    loss's vocabulary-sized buffers; 0 without a teacher."""
    fp8_state_bytes: int = 0
    """The delayed FP8 recipe's amax tables (`fp8_scaling_state_bytes`); 0 without it."""

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        return (self.state_bytes + self.activation_bytes + self.teacher_bytes
                + self.fp8_state_bytes)


@dataclass(frozen=True)
class StageSpec:
    """One layout as the memory model needs it."""

    tp: int
    pp: int
    dp: int
    """Data-parallel size (ZeRO-1 shards over dp x act.cp)."""
    chunks: int
    microbatches: int
    sharding: str
    """--data-parallel-sharding-strategy."""
    recompute: Recompute
    act: ActivationSetup
    schedule: str | None = None
    """--pipeline-schedule (None: 1F1B or interleaved by `chunks`); ZBV holds the head on
    stage 0."""
    full_grad_accumulator: bool = False
    """--sharded-grad-accumulation full-buffer (ZeRO-2 only)."""
    grad_bf16: bool = False
    """--grad-reduce-in-bf16: gradients stored and reduced in bf16."""
    bucket_size: int = ddp_bucket_size(ParallelConfig(), 1)
    """--ddp-bucket-size (ZeRO-3's gradient buckets in flight)."""
    moe_params: tuple[tuple[int, int], ...] = ()
    """Per stage, `moe_stage_params` (); empty: a dense model."""
    ep: int = 1
    """--expert-model-parallel-size: the experts' states are sharded over DP x CP / ep."""
    moe_saved: tuple[float, ...] = ()
    """Per stage, `moe_saved_bytes` of one micro-batch (); empty: a dense model."""
    fp8_copies: tuple[int, ...] = ()
    """Per stage, `fp8_gathered_params`: their fp8 copy (1 byte each; under ZeRO-3 sharded
    over DP x CP) replaces all but the owned slices of their model copy under ZeRO-1/2;
    empty: no --fp8-param-gather."""
    moe: MoEConfig | None = None
    """The MoE layers' shape (ZeRO-3's units, `zero3_layer_params`); None: a dense model."""


def stage_memory(model: ModelConfig, spec: StageSpec, stage: int, layers: int) -> MemoryEstimate:
    """Memory of one rank of `stage`, which holds `layers` layers split over spec.chunks."""
    sched = schedules.get(spec.schedule, spec.chunks)
    n = stage_params(model, spec.tp, spec.pp, stage, layers, sched.v_shape)
    dense_change, routed = spec.moe_params[stage] if spec.moe_params else (0, 0)
    n += dense_change
    accumulator = spec.full_grad_accumulator and spec.microbatches > 1
    pb, gb, ob = state_bytes(n, spec.dp * spec.act.cp, spec.sharding, spec.act.bf16,
                             accumulator, spec.grad_bf16)
    if spec.fp8_copies:  # the FP8 weights' fp8 copy: ZeRO-3 keeps its owned slices, ZeRO-1/2
        copies, owners = spec.fp8_copies[stage], spec.dp * spec.act.cp  # the whole of it, and
        if sharding_table.get(spec.sharding).params:  # of the model's copy the owned slices
            pb += math.ceil(copies / owners)
        else:
            pb += copies - (copies - math.ceil(copies / owners)) * (2 if spec.act.bf16 else 4)
    if routed:  # the experts' own sync group: their replicas over expert-DP
        etp = expert_tp(spec.moe, spec.tp) if spec.moe else spec.tp
        edp = spec.dp * spec.act.cp * spec.tp // (spec.ep * etp)
        epb, egb, eob = state_bytes(routed, edp, spec.sharding,
                                    spec.act.bf16, accumulator, spec.grad_bf16)
        n, pb, gb, ob = n + routed, pb + epb, gb + egb, ob + eob
    per_chunk, recompute_peak = chunk_activation_bytes(model, spec.act, layers // spec.chunks,
                                                       spec.recompute)
    if spec.moe_saved and spec.recompute.granularity != "full":
        per_chunk += spec.moe_saved[stage] / spec.chunks
    holds_head = stage == sched.head_stage(spec.pp)
    # Zero-bubble: each micro-batch between its F and its W keeps the head's saved input and
    # logits gradient (the output layer's W needs them).
    heads = min(spec.pp, spec.microbatches) if sched.split_backward else 1
    head = heads * head_activation_bytes(model, spec.act) if holds_head else 0.0
    # the embedding's int64 ids, plus with TP its bool mask of ids outside this rank's slice
    id_bytes = 8 + (spec.tp > 1)
    ids = id_bytes * local_seq(model, spec.act) * spec.act.micro_batch if stage == 0 else 0
    flying = in_flight(spec.pp, stage, spec.chunks, spec.microbatches, spec.schedule)
    # The peak is the fullest of the step's moments, each on top of the in-flight chunks'
    # activations: a layer's backward (the other zero-bubble heads waiting for their W), or,
    # on the head's stage, the loss (the logits) and the head's backward (the output layer's
    # weight gradient). A tied output layer on the embedding's stage keeps that gradient
    # through the layers' backward, until the embedding's own is added to it.
    layer_step = layer_backward_bytes(model, spec.act) + recompute_peak
    head_step = 0.0
    if holds_head:
        layer_step += head - head_activation_bytes(model, spec.act)
        if not model.untie_embeddings_and_output_weights and stage == 0:
            layer_step += output_weight_grad_bytes(model, spec.act)
        head_step = head + max(head_transient_bytes(model, spec.act),
                               head_backward_bytes(model, spec.act))
    if sharding_table.get(spec.sharding).params:
        peak = zero3_peak_bytes(model, spec, per_chunk, ids, head, layer_step)
    else:
        others = (flying - 1) * per_chunk + ids * min(flying, spec.microbatches)
        peak = others + per_chunk + max(layer_step, head_step)
        if stage == 0:  # the embedding's backward: its weight gradient (tied: + the head's, sum)
            tied = holds_head and not model.untie_embeddings_and_output_weights
            peak = max(peak, others + (3 if tied else 1) * output_weight_grad_bytes(
                model, spec.act))
    return MemoryEstimate(stage, n, pb, gb, ob, spec.chunks * per_chunk + head + ids, flying,
                          peak)


def _recompute_from(cfg: Config) -> Recompute:
    """The recompute fields wherever config.py puts them (none while they do not exist)."""
    found = {}
    for section in dataclasses.fields(cfg):
        for name in ("recompute_granularity", "recompute_method", "recompute_num_layers"):
            value = getattr(getattr(cfg, section.name), name, None)
            if value is not None:
                found[name.removeprefix("recompute_")] = value
    return Recompute(**found)


KD_VOCAB_BUFFERS = 6
"""fp32 [tokens, V/t] tensors alive during the distillation loss: the teacher's shifted
logits, log-probabilities and probabilities, the student's upcast and shifted logits and
their exp (distill.vocab_parallel_kl)."""


def teacher_bytes(teacher: ModelConfig, a: ActivationSetup) -> float:
    """A frozen teacher beside one-stage student (distillation runs on one pipeline stage):
    its weights in the run's dtype, its logits, and the KL's fp32 buffers."""
    e = 2 if a.bf16 else 4
    tokens = local_seq(teacher, a) * a.micro_batch
    vocab = teacher.padded_vocab_size(a.tp) // a.tp
    return (e * stage_params(teacher, a.tp, 1, 0, teacher.num_layers)
            + (e + 4 * KD_VOCAB_BUFFERS) * tokens * vocab)


def _moe_stages(model: ModelConfig, moe: MoEConfig | None, act: ActivationSetup, ep: int,
                counts: list[int], chunks: int
                ) -> tuple[tuple[tuple[int, int], ...], tuple[float, ...]]:
    """Per stage: `moe_stage_params` and `moe_saved_bytes` (both empty for a dense model)."""
    if moe is None:
        return (), ()
    pattern = moe_layer_pattern(moe.moe_layer_freq, model.num_layers)
    ids = [stage_layer_ids(counts, chunks, i) for i in range(len(counts))]
    return (tuple(moe_stage_params(model, moe, act.tp, ep, i) for i in ids),
            tuple(moe_saved_bytes(model, moe, act, sum(pattern[j] for j in i), ep) for i in ids))


def _fp8_copies(model: ModelConfig, moe: MoEConfig | None, tp: int, counts: list[int],
                chunks: int, train: TrainConfig) -> tuple[int, ...]:
    """`StageSpec.fp8_copies` for stages of `counts` layers (empty: no --fp8-param-gather)."""
    if train.fp8_format is None or not train.fp8_param_gather:
        return ()
    bf16_layers = fp8_bf16_layers(train, model.num_layers)
    return tuple(fp8_gathered_params(model, moe, tp, stage_layer_ids(counts, chunks, i),
                                     bf16_layers) for i in range(len(counts)))


def estimate_memory(cfg: Config, world_size: int, *, stage: int | None = None,
                    fused_kernels: bool | None = None, device_type: str = "cuda",
                    teacher: ModelConfig | None = None) -> MemoryEstimate:
    """Per-rank memory estimate for `cfg` on `world_size` ranks.

    `stage` picks a pipeline stage (default: the stage with the largest total). `fused_kernels`
    defaults to `--triton-kernels != off`; pass False for CPU runs with `auto`. `teacher`: the
    shape of a distillation teacher (`teacher_bytes`), on the head's stage.
    """
    model, parallel = cfg.model, cfg.parallel
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    counts = stage_layer_counts(model.num_layers, pp, parallel.decoder_first_pipeline_num_layers,
                                parallel.decoder_last_pipeline_num_layers)
    per_chunk = parallel.num_layers_per_virtual_pipeline_stage
    schedule = pipeline_schedule(parallel)
    chunks = schedule_in_effect(parallel).stage_chunks(counts[0] // per_chunk if per_chunk
                                                       else 1)
    fused = cfg.model.triton_kernels != "off" if fused_kernels is None else fused_kernels
    cp = parallel.context_parallel_size
    act = ActivationSetup(cfg.train.micro_batch_size, tp, parallel.sequence_parallel,
                          cfg.train.bf16, fused, fp32_attention_core=device_type == "cpu",
                          cp=cp, fp8=cfg.train.fp8_format is not None,
                          fp8_param_gather=cfg.train.fp8_param_gather,
                          fp8_rowwise=cfg.train.fp8_recipe == "rowwise")
    ep = cfg.moe.expert_model_parallel_size
    moe_params, moe_saved = _moe_stages(model, cfg.moe if cfg.moe.num_experts else None, act,
                                        ep, counts, chunks)
    fp8_copies = _fp8_copies(model, cfg.moe if cfg.moe.num_experts else None, tp, counts,
                             chunks, cfg.train)
    spec = StageSpec(tp, pp, world_size // (tp * cp * pp), chunks,
                     num_microbatches(cfg, world_size),
                     parallel.data_parallel_sharding_strategy, _recompute_from(cfg), act, schedule,
                     parallel.sharded_grad_accumulation == "full-buffer",
                     parallel.grad_reduce_in_bf16,
                     ddp_bucket_size(parallel, world_size // (tp * cp * pp)), moe_params, ep,
                     moe_saved, fp8_copies, cfg.moe if cfg.moe.num_experts else None)
    fp8_state = fp8_scaling_state_bytes(cfg.train, model.num_layers)
    estimates = [dataclasses.replace(stage_memory(model, spec, i, n), fp8_state_bytes=fp8_state)
                 for i, n in enumerate(counts)]
    if teacher is not None:
        last = len(estimates) - 1
        estimates[last] = dataclasses.replace(estimates[last], teacher_bytes=teacher_bytes(
            dataclasses.replace(teacher, seq_length=model.seq_length), act))
    if stage is not None:
        return estimates[stage]
    return max(estimates, key=lambda est: est.total_bytes)


# ---------------------------------------------------------------------------------------------
# Cluster, layouts and step time


DEFAULT_DEVICE = "H100 SXM 80 GB"
"""The device `Cluster`'s defaults describe (plan_time.PRESETS["h100-sxm"])."""

_H100 = plan_time.PRESETS["h100-sxm"]


@dataclass(frozen=True)
class Cluster:
    """Hardware assumptions (defaults: `DEFAULT_DEVICE`, 8 per node, 400 Gb/s NIC per GPU;
    `from_hardware` takes another plan_time preset). The step-time model is plan_time's."""

    gpus: int
    gpus_per_node: int = 8
    gpu_memory_gib: float = _H100.gpu_memory_gib
    peak_tflops: float = _H100.peak_tflops
    """Dense bf16 peak per GPU."""
    gemm_efficiency: float = _H100.gemm_efficiency
    """e_max: fraction of peak the largest GEMMs reach (plan_time.A100_FIT)."""
    gemm_half_dim: float = _H100.gemm_half_dim
    """d_half: the smallest GEMM dimension at which efficiency is e_max / 2."""
    intra_node_gbps: float = _H100.intra_node_gbps
    """Achieved collective bus bandwidth per GPU inside a node (NVLink), GB/s."""
    inter_node_gbps: float = _H100.inter_node_gbps
    """Achieved bus bandwidth per GPU across nodes (400 Gb/s NIC at 80%), GB/s."""
    latency_us: float = _H100.latency_us
    """Fixed cost per collective or p2p transfer."""
    hbm_gbps: float = _H100.hbm_gbps
    """Achieved memory bandwidth of memory-bound kernels and the optimizer step, GB/s."""
    op_us: float = _H100.op_us
    """Fixed cost per kernel (launch interval; CPU: dispatch, added to the work)."""
    attention_tflops: float = _H100.attention_tflops
    """Measured attention-kernel rate (plan_time.Hardware.attention_tflops); 0: the GEMM curve."""
    allowance_gib: float = 3.0
    """Not modelled elsewhere: CUDA context + NCCL buffers (~1 GiB), gradient buckets,
    allocator fragmentation."""
    dp_overlap: bool = True
    """--overlap-grad-reduce / --overlap-param-gather: DP collectives hide behind the last
    micro-batch's backward (grads) and the first micro-batch's forward (params)."""
    tp_overlap: bool = False
    """--tp-comm-overlap: TP collectives hide behind the layers' GEMMs (else exposed)."""
    host_bound: bool = False
    """A CPU: ops run one after another on the host, their fixed costs add up."""

    @classmethod
    def from_hardware(cls, gpus: int, hw: plan_time.Hardware, **overrides) -> Cluster:
        """A cluster of `gpus` devices of `hw` (a plan_time preset or calibration)."""
        shared = {f: getattr(hw, f) for f in plan_time.hardware_fields()}
        return cls(gpus=gpus, **{**shared, "host_bound": hw.host_bound, **overrides})

    @property
    def hardware(self) -> plan_time.Hardware:
        return plan_time.Hardware(**{f: getattr(self, f) for f in plan_time.hardware_fields()},
                                  host_bound=self.host_bound)


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    chunks: int
    """Virtual pipeline chunks per stage v (1 = plain 1F1B)."""
    micro_batch: int
    sharding: str
    """--data-parallel-sharding-strategy (`SHARDING`)."""
    recompute: Recompute
    sequence_parallel: bool
    schedule: str | None = None
    """zb-h1 (chunks 1) or zbv (chunks 2); None: 1F1B, or interleaved when chunks > 1."""
    cp: int = 1
    """Context-parallel size (ranks between TP and DP in the grid)."""
    ep: int = 1
    """Expert-parallel size, carved out of the DP x CP replicas (MoE only)."""

    @property
    def schedule_name(self) -> str:
        """The --pipeline-schedule this layout runs."""
        return schedules.get(self.schedule, self.chunks).name

    @property
    def zero_stage(self) -> int:
        return sharding_table.get(self.sharding).zero_stage


@dataclass(frozen=True)
class Plan:
    layout: Layout
    microbatches: int
    memory: MemoryEstimate
    """The rank with the largest total."""
    need_gib: float
    """Memory total including the allowance."""
    step_s: float
    compute_s: float
    """GEMMs of the slowest stage's micro-batches."""
    tp_comm_s: float
    """Exposed TP collectives."""
    p2p_s: float
    """Pipeline transfers plus the exposed part of the CP ring's K/V transfers."""
    bubble_s: float
    dp_exposed_s: float
    optimizer_s: float
    tokens_per_s: float
    flops_per_token: float
    """Model FLOPs per token the MFU counts: `training_flops_per_token` at this layout's TP,
    attention causal (the work the step-time model charges: a causal kernel skips the masked
    half)."""
    mfu: float
    """tokens/s x flops_per_token / (GPUs x peak): the training log's `mfu_causal`; never
    above the largest efficiency the time model allows (`efficiency_bound`)."""
    days: float
    fits: bool
    reason: str
    memory_s: float = 0.0
    """Memory-bound kernels of the slowest stage's micro-batches."""
    overhead_s: float = 0.0
    """What the fixed cost per kernel adds."""
    mfu_noncausal: float = 0.0
    """MFU with attention counted as if not causal (12·l·q·s, the log's `mfu`, PaLM's
    convention): it counts the masked half, so it can exceed what the GPU runs at long
    sequences."""
    hfu: float = 0.0
    """MFU plus the forward FLOPs that recomputation reruns (hardware FLOPs), causal."""
    hfu_noncausal: float = 0.0
    ep_comm_s: float = 0.0
    """MoE token dispatch over EP (`moe_dispatch_s`) of the slowest stage's micro-batches."""


def _recompute_layers(lay: Layout, layers: int) -> tuple[int, bool]:
    """(layers whose whole forward is rerun, attention cores rerun) of a stage's micro-batch:
    full uniform reruns every layer, full block the first N of each chunk."""
    rc = lay.recompute
    if rc.granularity == "full":
        per_chunk = layers // lay.chunks
        n = per_chunk if rc.method == "uniform" else min(rc.num_layers, per_chunk)
        return n * lay.chunks, False
    return 0, rc.granularity == "selective"


def _work(model: ModelConfig, lay: Layout, opts: RunOptions) -> plan_time.Work:
    return plan_time.Work(model.seq_length // lay.cp * lay.micro_batch, model.seq_length,
                          lay.tp, lay.sequence_parallel, opts.dtype_bytes, opts.attention,
                          lay.cp)


def _stage_time(model: ModelConfig, lay: Layout, c: Cluster, layers: int, stage: int,
                opts: RunOptions = RunOptions()) -> tuple[float, float, float, plan_time.Costs]:
    """(compute, exposed TP comm, p2p, compute by kind) seconds for one micro-batch through
    all chunks of a stage (plan_time.microbatch_costs).

    Under CP a rank computes s/cp tokens, each still attending over the whole sequence (the
    zigzag split gives every rank the same causal work). Ring attention sends the local K/V
    cp - 1 times in forward and K/V plus fp32 dK/dV again in backward (layers/attention.py);
    the transfers overlap the blocks' attention, so only the excess over that attention's
    time is charged, in p2p."""
    shape, hw = model_shape(model, lay.tp, opts.block), c.hardware
    w = _work(model, lay, opts)
    tokens, e = w.tokens, w.e
    rerun, selective = _recompute_layers(lay, layers)
    head = stage == schedules.get(lay.schedule, lay.chunks).head_stage(lay.pp)
    costs = plan_time.microbatch_costs(shape, w, hw, layers, rerun, selective, head, stage == 0)
    tp_bw = c.intra_node_gbps if lay.tp <= c.gpus_per_node else c.inter_node_gbps
    # per layer: fwd 2 + bwd 2 all-reduce-sized collectives (SP: all-gather + reduce-scatter
    # pairs, same bytes); full recompute reruns the 2 forward ones; +1 for embedding or head
    colls = 4 * layers + 2 * rerun + (stage == 0) + head
    tp_comm = colls * plan_time.collective_s(e * tokens * model.hidden_size, lay.tp, tp_bw,
                                             c.latency_us, "all_reduce")
    if c.tp_overlap:
        tp_comm = max(0.0, tp_comm - costs.gemm)
    p2p = 0.0
    if lay.pp > 1:
        pp_bw = c.inter_node_gbps if lay.tp * lay.dp >= c.gpus_per_node else c.intra_node_gbps
        act = e * tokens * model.hidden_size
        split = lay.sequence_parallel or opts.p2p_scatter_gather
        p2p = plan_time.collective_s(act / lay.tp if split else act, 1, pp_bw, c.latency_us,
                                     "p2p")
        if opts.p2p_scatter_gather and not lay.sequence_parallel:
            p2p += plan_time.collective_s(act, lay.tp, tp_bw, c.latency_us, "all_gather")
        p2p *= 2 * lay.chunks
    if lay.cp > 1:
        cp_bw = c.intra_node_gbps if lay.tp * lay.cp <= c.gpus_per_node else c.inter_node_gbps
        kv = e * tokens * 2 * shape.query_groups * shape.head_dim / lay.tp  # this TP rank's
        # forward K/V, backward K/V + fp32 dK/dV, for each of cp - 1 steps
        ring = (lay.cp - 1) * ((kv + kv + 2 * kv) / (cp_bw * 1e9) + 3 * c.latency_us * 1e-6)
        p2p += layers * max(0.0, ring - plan_time.attention_s(shape, w, hw))
    return costs.total, tp_comm, p2p, costs


def moe_dispatch_s(model: ModelConfig, moe: MoEConfig, lay: Layout, c: Cluster,
                   moe_layers: int, e: int = 2) -> float:
    """Seconds of one micro-batch's token dispatch over EP through `moe_layers` MoE layers.

    Every TP rank dispatches all b·s/cp tokens of its replica (under SP gathered over TP
    first). alltoall: the tokens x top-k x h x e bytes go to their experts' ranks and the
    outputs come back, forward and backward (4 all-to-alls); allgather: the EP group's
    tokens are all-gathered and the outputs reduce-scattered, forward and backward (4
    collectives of ep x tokens x h x e). Over NVLink when TP x EP ranks fit in a node (the EP
    group's ranks are TP apart), else over the network; the per-expert counts and router
    outputs are small and only their latency is counted."""
    if lay.ep == 1 or not moe_layers:
        return 0.0
    tokens = model.seq_length // lay.cp * lay.micro_batch
    bw = c.intra_node_gbps if lay.tp * lay.ep <= c.gpus_per_node else c.inter_node_gbps
    row = e * tokens * model.hidden_size
    if moe.moe_token_dispatcher_type == "alltoall":
        one = plan_time.collective_s(row * moe.moe_router_topk, lay.ep, bw, c.latency_us,
                                     "all_to_all") + c.latency_us * 1e-6  # the counts
        per_layer = 4 * one
    else:
        volume = row * lay.ep
        per_layer = 2 * (plan_time.collective_s(volume, lay.ep, bw, c.latency_us, "all_gather")
                         + plan_time.collective_s(volume, lay.ep, bw, c.latency_us,
                                                  "reduce_scatter"))
    return moe_layers * per_layer


def moe_compute_delta(shape: ModelShape, w: plan_time.Work, hw: plan_time.Hardware,
                      moe_layers: int) -> plan_time.Costs:
    """What `moe_layers` MoE layers cost beyond dense ones: each token's MLP is its top-k
    experts' (and the shared expert's) SwiGLU width instead of the dense one (a grouped GEMM
    timed as one GEMM of that width)."""
    if not moe_layers:
        return plan_time.Costs()
    mixed = dataclasses.replace(shape, ffn_hidden=shape.moe_active_ffn)
    one = [plan_time.microbatch_costs(s, w, hw, 1, 0, False, False, False)
           for s in (mixed, shape)]
    return (one[0] + one[1].scale(-1)).scale(moe_layers)


def _dp_time(groups: list[tuple[int, int]], lay: Layout, c: Cluster, stage_s: float,
             microbatches: int, grad_bytes: int = 4) -> tuple[float, float]:
    """(exposed DP communication, optimizer step) seconds, grads reduced in `grad_bytes`, for
    parameter `groups` of (count, replicas): the dense ones over DP x CP, with EP the experts
    over expert-DP (DP x CP / EP: fewer ranks, the same node span under parallel folding).

    ZeRO-2 reduce-scatters every micro-batch (its default accumulation), hidden behind each
    micro-batch's backward; ZeRO-3 also all-gathers the bf16 parameters twice per
    micro-batch (forward, backward), hidden behind the whole micro-batch. Both groups'
    reductions share one backward to hide behind.
    """
    span = lay.tp * lay.dp * lay.cp
    bw = c.intra_node_gbps if span <= c.gpus_per_node else c.inter_node_gbps
    zero, m = lay.zero_stage, microbatches
    grads = params = 0.0
    for n_params, replicas in groups:
        def ring(nbytes: float, kind: str, n: int = replicas) -> float:
            return plan_time.collective_s(nbytes, n, bw, c.latency_us, kind)

        if zero == 0:
            grads += ring(grad_bytes * n_params, "all_reduce")
        else:
            grads += ring(grad_bytes * n_params, "reduce_scatter") * (m if zero >= 2 else 1)
            params += ring(2 * n_params, "all_gather") * (2 * m if zero == 3 else 1)
    if c.dp_overlap:
        # a chunk's gradients are final after its last backward; interleaved, stage 0 runs
        # the last p micro-batches of chunk j (1/v of a stage each) j·p/v stage backwards
        # before the end (Megatron's order), so the reduction overlaps that cool-down too
        v = lay.chunks if lay.pp > 1 and lay.schedule is None else 1
        hide = m * stage_s if zero >= 2 else stage_s * (1 + (v - 1) * lay.pp / v)
        grads = max(0.0, grads - 2 / 3 * hide)
        params = max(0.0, params - (hide if zero == 3 else 1 / 3 * stage_s))
    owned = sum(n / r if zero else n for n, r in groups)
    # read+write master, m, v (24 B), read grad (4) twice (norm, update), write bf16 param (2)
    optimizer = 34 * owned / (c.hbm_gbps * 1e9)
    return grads + params, optimizer


def pipeline_op_costs(model: ModelConfig, tp: int = 1) -> tuple[float, float, float]:
    """Relative time of one layer's F, B and W per token, from FLOPs (what the zero-bubble
    timelines are built with, and what splits a stage's time in `bubble_time`): F = the
    matmuls (2N) + causal attention forward; B = the matmuls' input gradients (2N) + the
    attention backward (twice its forward, and all in B: attention has no weights);
    W = the matmuls' weight gradients (2N)."""
    shape = ModelShape.from_config(model, tp)
    gemm = 2 * matmul_params_per_layer(shape)
    attention = attention_flops_per_layer(shape, model.seq_length, causal=True) / 3
    return gemm + attention, gemm + 2 * attention, gemm


def bubble_time(pp: int, stage_s: float, chunks: int, schedule: str,
                op_costs: tuple[float, float, float]) -> float:
    """Idle seconds per step of a stage whose micro-batch takes `stage_s` (F + B + W), the
    formula of `Schedule.bubble`. The simulator (tests/pipeline) gets exactly these at
    F = B = W."""
    return schedules.get(schedule, chunks).bubble(pp, stage_s, chunks, op_costs)


def recompute_flops_per_token(shape: ModelShape, seq_length: int, lay: Layout,
                              causal: bool = False) -> float:
    """Forward FLOPs per token that recomputation reruns (the HFU numerator's extra, counted
    the MFU's way: a third of the rerun layers' training FLOPs)."""
    rerun, selective = _recompute_layers(lay, shape.layers)
    attention = attention_flops_per_layer(shape, seq_length, causal)
    layer = 6 * matmul_params_per_layer(shape) + attention
    return (rerun * layer + (shape.layers * attention if selective else 0.0)) / 3


def evaluate(model: ModelConfig, lay: Layout, c: Cluster, global_batch: int,
             train_tokens: float, opts: RunOptions = RunOptions()) -> Plan:
    """Memory and step time of one layout (assumed structurally valid, see `layouts`)."""
    mem_model = gpt_memory_stand_in(model) if opts.block == "gpt" else model
    mbs = global_batch // (lay.dp * lay.micro_batch)
    fp8 = opts.fp8 if opts.fp8 is not None and opts.fp8.fp8_format else None
    act = ActivationSetup(lay.micro_batch, lay.tp, lay.sequence_parallel, True, True, cp=lay.cp,
                          fp8=fp8 is not None,
                          fp8_param_gather=fp8 is not None and fp8.fp8_param_gather,
                          fp8_rowwise=fp8 is not None and fp8.fp8_recipe == "rowwise")
    per_stage = model.num_layers // lay.pp
    moe = opts.moe if opts.moe is not None and opts.moe.num_experts else None
    moe_params, moe_saved = _moe_stages(model, moe, act, lay.ep, [per_stage] * lay.pp,
                                        lay.chunks)
    spec = StageSpec(lay.tp, lay.pp, lay.dp, lay.chunks, mbs, lay.sharding, lay.recompute, act,
                     lay.schedule, grad_bf16=opts.grad_reduce_bytes == 2,
                     moe_params=moe_params, ep=lay.ep, moe_saved=moe_saved,
                     fp8_copies=_fp8_copies(model, moe, lay.tp, [per_stage] * lay.pp,
                                            lay.chunks, fp8) if fp8 is not None else (),
                     moe=moe)
    fp8_state = fp8_scaling_state_bytes(fp8, model.num_layers) if fp8 is not None else 0
    mems = [dataclasses.replace(stage_memory(mem_model, spec, i, per_stage),
                                fp8_state_bytes=fp8_state) for i in range(lay.pp)]
    worst = max(mems, key=lambda est: est.total_bytes)
    times = [_moe_stage_time(model, lay, c, per_stage, i, opts) for i in range(lay.pp)]
    compute, tp_comm, p2p, costs, ep_comm = max(times, key=lambda t: sum(t[:3]) + t[4])
    stage_s = compute + tp_comm + p2p + ep_comm
    bubble = bubble_time(lay.pp, stage_s, lay.chunks, lay.schedule_name,
                         pipeline_op_costs(mem_model, lay.tp))
    heaviest = max(range(lay.pp), key=lambda i: mems[i].params)
    routed = moe_params[heaviest][1] if moe_params else 0
    replicas = lay.dp * lay.cp
    groups = [(mems[heaviest].params - routed, replicas)] + (
        [(routed, replicas // lay.ep)] if routed else [])
    dp_s, opt_s = _dp_time(groups, lay, c, stage_s, mbs, opts.grad_reduce_bytes)
    step = mbs * stage_s + bubble + dp_s + opt_s
    tokens_s = global_batch * model.seq_length / step
    shape = model_shape(model, lay.tp, opts.block, moe)
    causal = training_flops_per_token(shape, model.seq_length, causal=True)
    full = training_flops_per_token(shape, model.seq_length)
    per_gpu = tokens_s / c.gpus / 1e12 / c.peak_tflops
    rerun = {k: recompute_flops_per_token(shape, model.seq_length, lay, causal=k)
             for k in (True, False)}
    need = worst.total_bytes / GIB + c.allowance_gib
    fits = need <= c.gpu_memory_gib
    reason = "" if fits else (
        f"needs {need:.1f} > {c.gpu_memory_gib:g} GiB (stage {worst.stage}: states "
        f"{worst.state_bytes / GIB:.1f} + activations {worst.activation_bytes / GIB:.1f} + "
        f"allowance {c.allowance_gib:g})")
    return Plan(lay, mbs, worst, need, step, mbs * costs.gemm, mbs * tp_comm, mbs * p2p, bubble,
                dp_s, opt_s, tokens_s, causal, per_gpu * causal, train_tokens / tokens_s / 86400,
                fits, reason, memory_s=mbs * costs.memory, overhead_s=mbs * costs.overhead,
                mfu_noncausal=per_gpu * full, hfu=per_gpu * (causal + rerun[True]),
                hfu_noncausal=per_gpu * (full + rerun[False]), ep_comm_s=mbs * ep_comm)


def _moe_stage_time(model: ModelConfig, lay: Layout, c: Cluster, layers: int, stage: int,
                    opts: RunOptions) -> tuple[float, float, float, plan_time.Costs, float]:
    """`_stage_time` plus, with `opts.moe`, the MoE layers' extra expert compute
    (`moe_compute_delta`) and their token dispatch over EP (`moe_dispatch_s`, last)."""
    compute, tp_comm, p2p, costs = _stage_time(model, lay, c, layers, stage, opts)
    moe = opts.moe
    if moe is None or not moe.num_experts:
        return compute, tp_comm, p2p, costs, 0.0
    pattern = moe_layer_pattern(moe.moe_layer_freq, model.num_layers)
    on = sum(pattern[i] for i in stage_layer_ids([layers] * lay.pp, lay.chunks, stage))
    extra = moe_compute_delta(model_shape(model, lay.tp, opts.block, moe),
                              _work(model, lay, opts), c.hardware, on)
    dispatch = moe_dispatch_s(model, moe, lay, c, on, opts.dtype_bytes)
    return compute + extra.total, tp_comm, p2p, costs + extra, dispatch


def efficiency_bound(c: Cluster) -> float:
    """The largest fraction of peak any work reaches in the time model: the GEMM curve's
    e_max, or a measured attention kernel's rate if faster. No layout's MFU or HFU (causal
    FLOPs over charged time) exceeds it."""
    return max(c.gemm_efficiency, c.attention_tflops / c.peak_tflops)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: ModelConfig, c: Cluster, global_batch: int) -> list[Layout]:
    """Structurally valid layouts without recompute (the memory search adds recompute).

    TP is a power of two within a node dividing heads, query groups, ffn and any
    --padded-vocab-size; PP divides the layers; v divides the layers per stage, needs pp > 1
    and micro-batches a multiple of pp; micro-batches m >= pp; every sharding strategy with
    dp x cp > 1 (optim_grads_params only with pp = 1, as the run refuses it with PP); SP always
    on with TP (same traffic, less memory). With pp > 1 also the zero-bubble schedules: ZB-H1,
    and ZBV where 2p divides the layers. CP (a power of two) only for long sequences: each rank
    keeps at least 8192 tokens (so seq 8192 never splits), and 2·cp·tp divides the sequence.
    """
    out = []
    tps = [t for t in (1, 2, 4, 8, 16, 32) if t <= min(c.gpus_per_node, c.gpus)
           and not (model.num_attention_heads % t or model.num_query_groups % t
                    or model.ffn_hidden_size % t
                    or (model.padded_vocab is not None and model.padded_vocab % t))]
    cps = [cp for cp in (1, 2, 4, 8, 16, 32, 64) if cp == 1 or model.seq_length // cp >= 8192]
    for tp, cp, pp in ((tp, cp, pp) for tp in tps for cp in cps
                       for pp in _divisors(model.num_layers)):
        if c.gpus % (tp * cp * pp) or (cp > 1 and model.seq_length % (2 * cp * tp)):
            continue
        dp = c.gpus // (tp * cp * pp)
        options: list[tuple[int, str | None]] = [
            (v, None) for v in (_divisors(model.num_layers // pp) if pp > 1 else [1])]
        if pp > 1:
            options += [(s.stage_chunks(1), s.name) for s in schedules.SCHEDULES.values()
                           if s.split_backward and not s.flag_errors(pp, None, False,
                                                                     model.num_layers, False)]
        for v, schedule in options:
            for mb in (1, 2, 4, 8, 16, 32):
                if global_batch % (dp * mb):
                    continue
                n_mb = global_batch // (dp * mb)
                if n_mb < pp or (schedules.get(schedule, v).microbatches_multiple_of_pp
                                 and n_mb % pp):
                    continue
                shardings = SHARDING[:4 if pp == 1 else 3] if dp * cp > 1 else SHARDING[:1]
                for sharding in shardings:
                    out.append(Layout(tp, pp, dp, v, mb, sharding, Recompute(), tp > 1,
                                      schedule, cp))
    return out


def expert_parallel_sizes(moe: MoEConfig | None, lay: Layout) -> list[int]:
    """EP sizes the search tries for a layout: 1 for a dense model; for a MoE model the
    powers of two dividing both the experts and the DP x CP replicas, or only
    --expert-model-parallel-size when it is given (> 1)."""
    if moe is None or not moe.num_experts:
        return [1]
    if moe.expert_model_parallel_size > 1:
        fixed = moe.expert_model_parallel_size
        return [fixed] if (lay.dp * lay.cp) % fixed == 0 else []
    return [ep for ep in (1, 2, 4, 8, 16, 32, 64, 128, 256)
            if moe.num_experts % ep == 0 and (lay.dp * lay.cp) % ep == 0]


def recompute_options(model: ModelConfig, lay: Layout) -> list[Recompute]:
    """none, selective, full uniform N=1, and full block N for N < layers per chunk."""
    per_chunk = model.num_layers // (lay.pp * lay.chunks)
    opts = [Recompute(), Recompute("selective"), Recompute("full", "uniform", 1)]
    opts += [Recompute("full", "block", n) for n in range(1, per_chunk)]
    return opts


def search(model: ModelConfig, c: Cluster, global_batch: int, train_tokens: float,
           keep=lambda lay: True, opts: RunOptions = RunOptions()) -> list[Plan]:
    """Every layout (filtered by `keep`) with its cheapest fitting recompute, best first.

    For each layout the recompute options are tried from cheapest to most recompute; the
    fastest fitting one is kept, or, when none fits, the one with the least memory (with its
    reason). Fitting plans come first, by tokens/s.
    """
    plans = []
    for base in (dataclasses.replace(lay, ep=ep) for lay in layouts(model, c, global_batch)
                 for ep in expert_parallel_sizes(opts.moe, lay)):
        tried = [evaluate(model, dataclasses.replace(base, recompute=rc), c, global_batch,
                          train_tokens, opts) for rc in recompute_options(model, base)]
        tried = [p for p in tried if keep(p.layout)]
        if not tried:
            continue
        fitting = [p for p in tried if p.fits]
        plans.append(max(fitting, key=lambda p: p.tokens_per_s) if fitting
                     else min(tried, key=lambda p: p.need_gib))
    return sorted(plans, key=lambda p: (not p.fits, -p.tokens_per_s, p.need_gib))


def variant_flags(model: ModelConfig) -> list[str | int | float]:
    """The flags of the dense variants a model uses (head dim, biases, qk-norm, padded rows;
    RoPE scaling changes no cost but is part of the model)."""
    flags: list[str | int | float] = []
    if model.kv_channels != model.hidden_size // model.num_attention_heads:
        flags += ["--kv-channels", model.head_dim]
    flags += [flag for flag, on in (("--add-qkv-bias", model.add_qkv_bias),
                                    ("--qk-layernorm", model.qk_layernorm)) if on]
    if model.use_rope_scaling:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", model.rope_scaling_factor]
    if model.padded_vocab is not None:
        flags += ["--padded-vocab-size", model.padded_vocab]
    return flags


def pretrain_flags(model: ModelConfig, plan: Plan, global_batch: int) -> list[str]:
    """The plan as pretrain.py flags (Megatron names)."""
    lay = plan.layout
    flags = ["--num-layers", model.num_layers, "--hidden-size", model.hidden_size,
             "--ffn-hidden-size", model.ffn_hidden_size, "--num-attention-heads",
             model.num_attention_heads, "--num-query-groups", model.num_query_groups,
             "--seq-length", model.seq_length, "--vocab-size", model.vocab_size, "--bf16",
             "--tensor-model-parallel-size", lay.tp, "--pipeline-model-parallel-size", lay.pp,
             *(["--context-parallel-size", lay.cp] if lay.cp > 1 else []),
             "--micro-batch-size", lay.micro_batch, "--global-batch-size", global_batch]
    if model.untie_embeddings_and_output_weights:
        flags.append("--untie-embeddings-and-output-weights")
    flags += variant_flags(model)
    if lay.schedule is not None:
        flags += ["--pipeline-schedule", lay.schedule]
    elif lay.chunks > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage",
                  model.num_layers // (lay.pp * lay.chunks)]
    if lay.sequence_parallel:
        flags.append("--sequence-parallel")
    if lay.sharding == sharding_table.OPTIM:
        flags.append("--use-distributed-optimizer")
    elif lay.sharding != sharding_table.NO_SHARD:
        flags += ["--data-parallel-sharding-strategy", lay.sharding]
    flags += lay.recompute.flags()
    return [str(f) for f in flags]


PRESETS: dict[str, tuple[str, ModelConfig, int]] = {
    "125M": ("GPT-3 Small dims (12 x 768, 12 heads) as a Llama: SwiGLU 2048, GPT-2 vocab, tied",
             ModelConfig(num_layers=12, hidden_size=768, num_attention_heads=12,
                         ffn_hidden_size=2048, seq_length=2048, vocab_size=50257), 256),
    "1B": ("Llama 3.2 1B (16 x 2048, 32 heads / 8 KV, SwiGLU 8192, vocab 128256, tied)",
           ModelConfig(num_layers=16, hidden_size=2048, num_attention_heads=32,
                       num_query_groups=8, ffn_hidden_size=8192, seq_length=8192,
                       vocab_size=128256), 512),
    "8B": ("Llama 3.1 8B (32 x 4096, 32 heads / 8 KV, SwiGLU 14336, vocab 128256)",
           ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32,
                       num_query_groups=8, ffn_hidden_size=14336, seq_length=8192,
                       vocab_size=128256, untie_embeddings_and_output_weights=True), 512),
    "70B": ("Llama 3.1 70B (80 x 8192, 64 heads / 8 KV, SwiGLU 28672, vocab 128256)",
            ModelConfig(num_layers=80, hidden_size=8192, num_attention_heads=64,
                        num_query_groups=8, ffn_hidden_size=28672, seq_length=8192,
                        vocab_size=128256, untie_embeddings_and_output_weights=True), 512),
    "405B": ("Llama 3.1 405B (126 x 16384, 128 heads / 8 KV, SwiGLU 53248, vocab 128256)",
             ModelConfig(num_layers=126, hidden_size=16384, num_attention_heads=128,
                         num_query_groups=8, ffn_hidden_size=53248, seq_length=8192,
                         vocab_size=128256, untie_embeddings_and_output_weights=True), 2048),
}
"""name -> (description, shape at seq 8192 (125M: 2048), default global batch in sequences:
0.5M tokens for 125M, 4.2M for 1B-70B, 16.8M for 405B as in Llama 3's final stage)."""
