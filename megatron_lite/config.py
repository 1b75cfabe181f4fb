"""Run configuration: dataclasses that are the single source of truth for every flag.

Each field has a type, a default and a one-line docstring under it; `arguments.py` turns them
into argparse flags (names follow Megatron-LM; `metadata={"flag": ...}` overrides the name).
Local invariants are checked in `__post_init__`; cross-field checks that need the world size
live in `validate()`, which runs before any process group or tensor is created.

Glossary: tp/pp/dp = tensor/pipeline/data parallel; "stage" = pp rank; "chunk" = virtual stage;
"axis" = a parallel axis, "dim" = a tensor dimension; batch sizes are in samples, tokens in tokens.
This module imports only megatron_lite.errors and the leaves megatron_lite.schedules and
megatron_lite.layout from megatron_lite (stdlib only).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_lite import layout, schedules, sharding
from megatron_lite.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration that cannot run; the message names the flag(s) and the fix."""


@dataclass
class ModelConfig:
    """Shape of the Llama-style decoder."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Model width h."""
    ffn_hidden_size: int | None = None
    """SwiGLU inner width; default 8h/3 rounded down to a multiple of 64 (Megatron's --swiglu
    sizing: h=4096 gives 10880; Llama's own widths are set explicitly)."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; default = num_attention_heads (plain MHA),
    or 1 with --group-query-attention (Megatron's default there)."""
    group_query_attention: bool = False
    """Megatron's switch for grouped-query attention: with it an omitted --num-query-groups is
    1, as in Megatron. Here --num-query-groups alone also takes effect (Megatron ignores it
    without this switch and runs plain MHA)."""
    kv_channels: int | None = None
    """Head dim d: the q/k/v projections are heads x d and groups x d wide and the attention
    output projection maps heads x d back to --hidden-size (Qwen3: d = 128 at any width);
    default --hidden-size / --num-attention-heads."""
    add_qkv_bias: bool = False
    """A bias on the q, k and v projections only (Qwen2.5); column-parallel like their
    weights, initialised to zero, no weight decay."""
    qk_layernorm: bool = False
    """RMSNorm over each head's d channels of q and of k, before RoPE (Qwen3, OLMo-2); one
    d-wide weight each per layer, its gradient summed over TP as in Megatron."""
    seq_length: int = 64
    """Training sequence length in tokens."""
    max_position_embeddings: int | None = None
    """Longest sequence the RoPE tables cover; default = seq_length."""
    vocab_size: int = 256
    """Tokenizer vocabulary size (before padding); taken from the tokenizer when one is given."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the tensor-parallel size."""
    padded_vocab: int | None = field(default=None, metadata={"flag": "--padded-vocab-size"})
    """Rows of the embedding and output layer, replacing the --make-vocab-size-divisible-by
    rounding (Megatron's meaning; Qwen2.5 sets 151936). Must be >= the vocabulary and
    divisible by the TP size; rows past the vocabulary start at zero and are masked in the
    loss, like any padding here."""
    init_method_std: float = 0.02
    """Std of the normal weight init; output projections use std / sqrt(2 * num_layers)."""
    untie_embeddings_and_output_weights: bool = False
    """Use a separate output layer instead of reusing the input embedding."""
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon."""
    rotary_base: float = 10000.0
    """RoPE base frequency theta."""
    rotary_percent: float = 1.0
    """Partial RoPE (Megatron's meaning): only the first int(d x this) channels of each q/k
    head are rotated, with frequencies spaced over that rotary width; the rest pass through
    unrotated. 1.0 rotates the whole head."""
    use_rope_scaling: bool = False
    """Llama 3.1's RoPE frequency scaling: wavelengths above the original 8192-token context
    are stretched by --rope-scaling-factor, those below 8192/4 kept, and the band between
    interpolated smoothly (low_freq_factor 1, high_freq_factor 4, as Megatron fixes them)."""
    rope_scaling_factor: float = 8.0
    """With --use-rope-scaling: the stretch of the low frequencies (Llama 3.1: 8, 3.2: 32)."""
    triton_kernels: str = field(default="auto", metadata={"choices": ["auto", "on", "off"]})
    """Fused Triton kernels: auto = on with CUDA, off on CPU; on = also on CPU (interpreter)."""

    def __post_init__(self) -> None:
        if self.num_query_groups is None:
            self.num_query_groups = 1 if self.group_query_attention else self.num_attention_heads
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads == 0:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = swiglu_ffn_size(self.hidden_size)
            if self.ffn_hidden_size <= 0:
                raise ConfigError(f"--hidden-size {self.hidden_size}: the default SwiGLU width "
                                  "(8h/3 rounded down to a multiple of 64) is 0; pass "
                                  "--ffn-hidden-size")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "vocab_size", "ffn_hidden_size", "num_query_groups"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{_dash(name)} must be positive, got {getattr(self, name)}")

        if self.rope_scaling_factor <= 0:
            raise ConfigError(f"--rope-scaling-factor must be positive, got "
                              f"{self.rope_scaling_factor}")
        if not 0 < self.rotary_percent <= 1:
            raise ConfigError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")

    @property
    def head_dim(self) -> int:
        """--kv-channels (None only for a config that `validate` refuses)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates: int(head dim x --rotary-percent), as
        Megatron truncates it."""
        d = self.head_dim
        return d if self.rotary_percent >= 1 else int(d * self.rotary_percent)

    def padded_vocab_size(self, tp_size: int) -> int:
        """Vocab rounded up so each TP rank holds an equal, aligned slice (--padded-vocab-size
        when given)."""
        if self.padded_vocab is not None:
            if self.padded_vocab < self.vocab_size:  # a tokenizer read after `validate`
                raise ConfigError(f"--padded-vocab-size {self.padded_vocab} is smaller than "
                                  f"the vocabulary ({self.vocab_size} tokens); raise it")
            return self.padded_vocab
        multiple = self.make_vocab_size_divisible_by * tp_size
        return multiple * math.ceil(self.vocab_size / multiple)


def swiglu_ffn_size(hidden: int) -> int:
    """Megatron's --swiglu width without --ffn-hidden-size: 2/3 of 4h (the parameters of a
    4h GeLU MLP), floored to a multiple of 64."""
    return int(4 * hidden * 2 / 3 / 64) * 64


def ddp_bucket_size(parallel: ParallelConfig, dp_size: int) -> int:
    """Gradient bucket size in elements: --ddp-bucket-size, else Megatron's
    max(40M, 1M x data-parallel size)."""
    if parallel.ddp_bucket_size is not None:
        return parallel.ddp_bucket_size
    return max(40_000_000, 1_000_000 * dp_size)


SHARDING_STRATEGIES = sharding.NAMES
"""--data-parallel-sharding-strategy values (Megatron-FSDP's names), least to most sharded."""


@dataclass
class ParallelConfig:
    """How ranks are laid out: world = pp x dp x cp x tp, tp innermost."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size t (ranks that split each layer's matrices)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size p (ranks that split the layer stack)."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per virtual chunk for the interleaved schedule; None = plain 1F1B."""
    pipeline_schedule: str | None = field(
        default=None, metadata={"choices": list(schedules.NAMES)})
    """Pipeline schedule; default 1f1b, or interleaved with
    --num-layers-per-virtual-pipeline-stage. zb-h1 and zbv (zero bubble) split each backward
    into the input gradient and a deferred weight gradient; zbv runs two chunks per stage in
    a V, with the embedding and the head on the first stage."""
    decoder_first_pipeline_num_layers: int | None = None
    """Layers on the first pipeline stage when it should differ from the even split."""
    decoder_last_pipeline_num_layers: int | None = None
    """Layers on the last pipeline stage when it should differ from the even split."""
    sequence_parallel: bool = False
    """Split activations outside the TP regions along the sequence (needs t > 1 to matter)."""
    context_parallel_size: int = 1
    """Context-parallel size c: ranks that split every sequence into 2c chunks (rank i holds
    chunks i and 2c-1-i, which balances causal work) and pass K/V around a ring."""
    use_distributed_optimizer: bool = False
    """ZeRO-1: shard fp32 master weights and Adam state over data-parallel ranks (the same as
    --data-parallel-sharding-strategy optim; set by every sharding strategy but no_shard)."""
    data_parallel_sharding_strategy: str | None = field(
        default=None, metadata={"choices": list(SHARDING_STRATEGIES)})
    """What is split over data-parallel ranks: no_shard (nothing), optim (ZeRO-1: fp32 master
    weights and Adam state), optim_grads (ZeRO-2: also the gradients, reduce-scattered bucket
    by bucket during backward), optim_grads_params (ZeRO-3: also the parameters, gathered per
    layer); default optim with --use-distributed-optimizer, optim_grads_params with
    --use-megatron-fsdp (Megatron-FSDP's default), else no_shard."""
    sharded_grad_accumulation: str = field(
        default="reduce-scatter", metadata={"choices": ["reduce-scatter", "full-buffer"]})
    """How optim_grads accumulates micro-batches: reduce-scatter every micro-batch's buckets
    into the fp32 shard (no full-size gradient; gradient traffic x micro-batches), or add
    them into a full-size buffer in the parameter dtype and reduce-scatter once per step
    (ZeRO-1's traffic; 2 more bytes per parameter under --bf16)."""
    use_megatron_fsdp: bool = False
    """Megatron-FSDP's switch: sharding follows --data-parallel-sharding-strategy, whose
    default it makes optim_grads_params."""
    overlap_grad_reduce: bool = False
    """Start each gradient bucket's reduction as soon as its gradients are ready."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the next forward."""
    ddp_bucket_size: int | None = None
    """Gradient bucket size in elements; default max(40M, 1M x data-parallel size) (Megatron's)."""
    grad_reduce_in_bf16: bool = False
    """Reduce gradients in bf16 instead of fp32 (halves DP traffic, loses precision)."""
    distributed_backend: str = field(
        default="auto", metadata={"choices": ["auto", "nccl", "gloo", "cuda:gloo",
                                              "staged-gloo"]})
    """Collective backend; auto = nccl with CUDA, gloo on CPU; cuda:gloo = gloo over CUDA
    tensors only (refuses host tensors like NCCL; lets several ranks share one GPU);
    staged-gloo = every op, send/recv included, on host copies over gloo (several ranks on
    one GPU for the layouts cuda:gloo cannot run: PP, CP's ring, reduce-scatter)."""
    distributed_timeout_minutes: float = 10.0
    """Timeout for every collective before the job fails instead of hanging."""
    world_size: int | None = None
    """With --dry-run: check the layout for this many ranks instead of the launched ones."""
    allow_tp_across_nodes: bool = False
    """Let a tensor-parallel group span nodes (refused by default: its per-layer all-reduces
    would cross the network)."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{_dash(name)} must be >= 1, got {getattr(self, name)}")
        strategy = self.data_parallel_sharding_strategy
        if strategy == sharding.NO_SHARD and self.use_distributed_optimizer:
            raise ConfigError("--use-distributed-optimizer shards the optimizer but "
                              "--data-parallel-sharding-strategy no_shard shards nothing; "
                              "drop one of them")
        if strategy is None:
            strategy = (sharding.OPTIM_GRADS_PARAMS if self.use_megatron_fsdp else
                        sharding.OPTIM if self.use_distributed_optimizer else sharding.NO_SHARD)
        self.data_parallel_sharding_strategy = strategy
        self.use_distributed_optimizer = sharding.get(strategy).state

    @property
    def shard_grads(self) -> bool:
        """ZeRO-2 and 3: each rank keeps only its shard of the reduced gradient."""
        return sharding.get(self.data_parallel_sharding_strategy).grads

    @property
    def shard_params(self) -> bool:
        """ZeRO-3: each rank keeps only its shard of the parameters between uses."""
        return sharding.get(self.data_parallel_sharding_strategy).params


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    lr_warmup_iters: int = 0
    """Iterations of linear warm-up from --lr-warmup-init (the first step's LR) to --lr."""
    lr_decay_iters: int | None = None
    """Iterations over which the LR decays to --min-lr; default = --train-iters."""
    lr_warmup_samples: int = 0
    """Sample-based schedule (with --train-samples): samples of linear warm-up."""
    lr_decay_samples: int | None = None
    """Sample-based schedule: samples over which the LR decays; default = --train-samples."""
    lr_wsd_decay_samples: int | None = None
    """Sample-based schedule, --lr-decay-style WSD: samples of the final decay phase."""
    lr_warmup_fraction: float | None = None
    """Warm-up length as this fraction of the decay length (a fractional sample count, not
    rounded); replaces --lr-warmup-iters / --lr-warmup-samples."""
    lr_warmup_init: float = 0.0
    """LR of the first step; the warm-up rises linearly from it to --lr."""
    decoupled_lr: float | None = None
    """Peak LR of the embedding and output weights (same schedule shape); default --lr."""
    decoupled_min_lr: float | None = None
    """With --decoupled-lr: their LR at the end of decay; default --min-lr."""
    lr_decay_style: str = field(default="linear", metadata={
        "choices": ["constant", "linear", "cosine", "inverse-square-root", "WSD", "wsd"]})
    """Shape of the decay after warm-up (Megatron's OptimizerParamScheduler): inverse-square-root
    = --lr x sqrt(warm-up / samples), at least --min-lr; WSD = --lr until the last
    --lr-wsd-decay-iters/-samples, then --lr-wsd-decay-style down to --min-lr (wsd = WSD)."""
    lr_wsd_decay_style: str = field(default="exponential", metadata={
        "choices": ["exponential", "linear", "cosine", "minus_sqrt"]})
    """WSD's final decay, at fraction r of it: exponential 2 x 0.5^r - 1, linear 1 - r, cosine
    (1 + cos(pi r)) / 2, minus_sqrt 1 - sqrt(r), scaling --lr - --min-lr."""
    lr_wsd_decay_iters: int | None = None
    """Iteration-based schedule, --lr-decay-style WSD: iterations of the final decay phase."""
    weight_decay: float = 0.01
    """Decoupled weight decay, applied to weights with >= 2 dims only (not norms)."""
    start_weight_decay: float | None = None
    """With --weight-decay-incr-style linear/cosine: the weight decay of the first step."""
    end_weight_decay: float | None = None
    """With --weight-decay-incr-style linear/cosine: the weight decay at the end of training
    (--train-iters x --global-batch-size or --train-samples samples)."""
    weight_decay_incr_style: str = field(default="constant", metadata={
        "choices": ["constant", "linear", "cosine"]})
    """How the weight decay moves from --start-weight-decay to --end-weight-decay over the
    training samples, as Megatron's scheduler does (cosine: (1 - cos(pi r)) / 2 of the way at
    fraction r); constant = --weight-decay throughout."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2 (Megatron's default; Llama recipes set 0.95)."""
    adam_eps: float = 1e-8
    """Adam epsilon."""

    def __post_init__(self) -> None:
        if self.lr_decay_style == "wsd":
            self.lr_decay_style = "WSD"
        if self.lr_warmup_fraction is not None:
            if not 0 <= self.lr_warmup_fraction <= 1:
                raise ConfigError(f"--lr-warmup-fraction must be in [0, 1], got "
                                  f"{self.lr_warmup_fraction}")
            if self.lr_warmup_iters or self.lr_warmup_samples:
                raise ConfigError("--lr-warmup-fraction replaces --lr-warmup-iters / "
                                  "--lr-warmup-samples; pass only one of them")
        errors = optim_value_errors(self) + self._weight_decay_errors()
        if errors:
            raise ConfigError("; ".join(errors))

    def _weight_decay_errors(self) -> list[str]:
        """Megatron's rules: the start/end pair belongs to a moving style, and it only rises."""
        ends = (self.start_weight_decay, self.end_weight_decay)
        if self.weight_decay_incr_style == "constant":
            return ([] if ends == (None, None) else
                    ["--start-weight-decay / --end-weight-decay set the ends of a moving weight "
                     "decay: add --weight-decay-incr-style linear (or cosine), or use "
                     "--weight-decay for a constant one"])
        if None in ends:
            return [f"--weight-decay-incr-style {self.weight_decay_incr_style} needs both "
                    "--start-weight-decay and --end-weight-decay"]
        start, end = ends
        assert start is not None and end is not None
        if not (math.isfinite(start) and math.isfinite(end) and 0.0 <= start <= end):
            return [f"--start-weight-decay {start} and --end-weight-decay {end} must be finite "
                    "with 0 <= start <= end (Megatron's weight decay only rises)"]
        return []
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm; 0 disables clipping."""


def optim_value_errors(optim: OptimConfig) -> list[str]:
    """Optimizer values that would make the first update non-finite or wrong in sign (a NaN
    LR, eps 0 on a never-updated element: 0/0), refused before anything starts."""
    def bad(value: float | None, low: float, high: float = math.inf, *,
            open_low: bool = False, open_high: bool = False) -> bool:
        if value is None:
            return False
        return not (math.isfinite(value) and (value > low if open_low else value >= low)
                    and (value < high if open_high else value <= high))

    rules = [("lr", optim.lr, "a finite number >= 0", bad(optim.lr, 0.0)),
             ("min-lr", optim.min_lr, "a finite number >= 0", bad(optim.min_lr, 0.0)),
             ("lr-warmup-init", optim.lr_warmup_init, "a finite number >= 0",
              bad(optim.lr_warmup_init, 0.0)),
             ("decoupled-lr", optim.decoupled_lr, "a finite number >= 0",
              bad(optim.decoupled_lr, 0.0)),
             ("decoupled-min-lr", optim.decoupled_min_lr, "a finite number >= 0",
              bad(optim.decoupled_min_lr, 0.0)),
             ("weight-decay", optim.weight_decay, "a finite number >= 0",
              bad(optim.weight_decay, 0.0)),
             ("clip-grad", optim.clip_grad, "a finite number >= 0 (0 = no clipping)",
              bad(optim.clip_grad, 0.0)),
             ("adam-beta1", optim.adam_beta1, "in [0, 1)",
              bad(optim.adam_beta1, 0.0, 1.0, open_high=True)),
             ("adam-beta2", optim.adam_beta2, "in [0, 1)",
              bad(optim.adam_beta2, 0.0, 1.0, open_high=True)),
             ("adam-eps", optim.adam_eps, "a finite number > 0 (e.g. 1e-8: with 0 an element "
              "whose gradient has always been 0 updates by 0/0 = NaN)",
              bad(optim.adam_eps, 0.0, open_low=True))]
    return [f"--{flag} {value} must be {what}" for flag, value, what, wrong in rules if wrong]


@dataclass
class TrainConfig:
    """Batch hierarchy, iterations, precision and evaluation."""

    micro_batch_size: int = 2
    """Samples per forward/backward on one rank."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all DP ranks; default = micro x dp (no accumulation)."""
    train_iters: int | None = None
    """Optimizer steps to run (default 20); or give --train-samples."""
    train_samples: int | None = None
    """Samples to train on instead of --train-iters (Megatron's sample-based schedule; the
    LR then follows --lr-warmup-samples / --lr-decay-samples); needs --global-batch-size."""
    rampup_batch_size: list[int] = field(default_factory=list)
    """START INCREMENT SAMPLES: the global batch starts at START and grows by INCREMENT in
    equal steps over the first SAMPLES samples, up to --global-batch-size (Megatron's meaning
    before it deprecated the flag for --step-batch-size-schedule)."""
    step_batch_size_schedule: str | None = None
    """Global batch by position, Megatron's syntax: "THRESHOLD:BATCH ..." (space or comma
    separated; K/M/B/T suffixes = 1e3/1e6/1e9/1e12), thresholds in tokens (floor-divided by
    --seq-length into samples), the first 0: a step takes the batch of the last threshold at or
    below the samples consumed before it. Replaces --global-batch-size; with --train-iters the
    LR's iteration lengths count micro x dp samples per iteration, as in Megatron."""
    seed: int = 1234
    """Seed for weights, data order and mock data."""
    bf16: bool = False
    """bf16 weights and activations with fp32 master weights and fp32 gradient reduction."""
    calculate_per_token_loss: bool = False
    """Train on the mean over every valid token of the global batch. Without it, Megatron's
    default: each micro-batch's loss is averaged over its own valid tokens, then over the
    micro-batches of all DP ranks (the same unless --eod-mask-loss leaves micro-batches with
    different token counts). The logged loss is the token mean either way, as Megatron's."""
    fp64: bool = False
    """float64 weights, activations, gradients, reductions and optimizer state (torch
    reference kernels): exact math, so a layout can be checked against one process far below
    fp32's rounding noise (the equivalence tests run this way). Slow; for checking, not
    training."""
    fp8_format: str | None = field(default=None, metadata={"choices": ["e4m3", "hybrid"]})
    """FP8 GEMMs in the column- and row-parallel linears (layers/fp8.py): e4m3 for every
    operand, or hybrid: e4m3 activations and weights, e5m2 output gradients; and in the MoE
    experts' grouped GEMMs, e4m3 in both formats with rowwise current scaling (what
    torch._scaled_grouped_mm takes) whatever the recipe. Weights, master weights and the
    output layer stay in the model's dtype. Needs --fp8-recipe delayed (the default) or
    tensorwise."""
    fp8_recipe: str = field(default="delayed", metadata={
        "choices": ["tensorwise", "delayed", "rowwise", "mxfp8", "blockwise", "custom"]})
    """With --fp8-format: how scales are chosen. tensorwise: current scaling (each tensor's
    own amax, every GEMM). delayed (Megatron's default): from an amax history that gains one
    entry per optimizer step, the max over the step's micro-batches and the ranks holding the
    layer (Transformer Engine adds one per micro-batch), so scales do not depend on the DP or
    micro-batch split; the first step uses current amaxes. rowwise (ours, as torchao's float8
    rowwise; not in Megatron): current scaling with one scale per row or column along each
    GEMM's contraction, every operand e4m3, outputs in the model's dtype; no
    --fp8-param-gather.
    mxfp8, blockwise, custom: refused."""
    fp8_margin: int = 0
    """With --fp8-format: scale = fp8_max / amax / 2^margin (headroom against overflow)."""
    fp8_amax_history_len: int = 1
    """With --fp8-recipe delayed: steps of amax history each FP8 linear keeps per operand."""
    fp8_amax_compute_algo: str = field(default="most_recent",
                                       metadata={"choices": ["max", "most_recent"]})
    """With --fp8-recipe delayed: the scale's amax is the history window's max or its newest
    entry (the last step's)."""
    fp8_param_gather: bool = False
    """With --fp8-format and the distributed optimizer (ZeRO-1/2/3): the FP8 linears' weights
    are cast to e4m3 by the rank that owns them right after the update (with the scale the
    forward would take) and all-gathered in fp8, 1 byte per element instead of 2 (ZeRO-1/2's
    gather after the step, ZeRO-3's per unit); the forward uses those fp8 values as they are
    (optim/fp8_params.py). The model's own copy of such a weight then holds the dequantized
    fp8 values (under ZeRO-3 only inside a full gather for reading)."""
    first_last_layers_bf16: bool = False
    """With --fp8-format: keep the first --num-layers-at-start-in-bf16 and the last
    --num-layers-at-end-in-bf16 transformer layers out of FP8."""
    num_layers_at_start_in_bf16: int = 1
    """With --first-last-layers-bf16: transformer layers at the start kept out of FP8."""
    num_layers_at_end_in_bf16: int = 1
    """With --first-last-layers-bf16: transformer layers at the end kept out of FP8."""
    eval_interval: int | None = None
    """Evaluate on the validation split every this many iterations; None = only once, at the
    end of training (Megatron's default)."""
    eval_iters: int = 100
    """Global batches per evaluation; 0 = no evaluation."""
    manual_gc: bool = False
    """Turn off Python's automatic garbage collector and collect every --manual-gc-interval
    steps on all ranks at once, so no rank stalls alone in a collection."""
    manual_gc_interval: int = 0
    """With --manual-gc: steps between collections (0 = only at start-up and evaluations)."""
    empty_unused_memory_level: int = field(default=0, metadata={"choices": [0, 1, 2]})
    """Return cached, unused CUDA memory to the device: 1 = after each step, 2 = also after
    each evaluation (costs time; helps when another process shares the GPU)."""
    compile: bool = False
    """torch.compile each model chunk as one graph (each layer with TP > 1, whose collectives
    sit between layers); graph breaks only at communication points."""
    recompute_granularity: str | None = field(
        default=None, metadata={"choices": ["full", "selective"]})
    """Activation recomputation: full = rerun whole layers in backward, keeping only their
    inputs; selective = rerun only RoPE + the attention core."""
    recompute_method: str | None = field(default=None, metadata={"choices": ["uniform", "block"]})
    """Full recompute: uniform = checkpoint groups of --recompute-num-layers layers; block =
    checkpoint only the first --recompute-num-layers layers of each model chunk."""
    recompute_num_layers: int | None = None
    """Full recompute: layers per group (uniform) or layers recomputed per chunk (block)."""
    deterministic_mode: bool = False
    """Bit-identical reruns on GPU (CPU runs already are): torch's deterministic algorithms
    (flash / memory-efficient attention take their deterministic backward, no cuDNN attention,
    an op with no deterministic kernel stops the run by name), CUBLAS_WORKSPACE_CONFIG=:4096:8
    and NCCL_ALGO=Ring unless set to another deterministic value. Costs: a slower attention
    backward (dQ accumulated in a fixed order, more workspace) and Ring-only collectives, which
    lose NCCL's faster tree/NVLS algorithms across nodes."""
    dry_run: bool = False
    """Validate the config, print the rank grid, stage partition, parameters per rank and the
    memory estimate, and exit without creating process groups (see --world-size); then the
    summary: iters (steps), grad_acc (micro-batches per step per DP rank), tokens_per_step,
    mem_gib (the planner's largest rank plus allowance) against device_gib with fits, and
    data_errors (each --data-path / --*-data-path prefix or manifest and tokenizer file must
    exist and --split parse; none is read; a problem exits 2). With --dry-run-ranks, also run
    one real training step of those ranks on the meta device."""
    dry_run_ranks: list[str] = field(default_factory=list)
    """With --dry-run: global ranks (or `all`) whose real model, optimizer and training step
    run on the meta device under a fake process group of --world-size ranks: collectives
    checked and matched, memory measured against the planner."""
    dry_run_device_memory_gb: float | None = None
    """With --dry-run: memory of one device in GiB (2^30 bytes), which the planner's bytes per
    rank (plus its allowance for CUDA context, NCCL and fragmentation) must fit; default 80,
    the planner's device (H100 SXM 80 GB)."""
    export_kd_teacher_load: str | None = None
    """Knowledge distillation (Megatron's ModelOpt flag): a frozen teacher, read from this
    megatron_lite checkpoint directory (its shape from the checkpoint's metadata, laid out
    with this run's TP/CP), runs each micro-batch under no_grad and the student learns its
    logits: the loss becomes KL(teacher || student) per token (megatron_lite/distill.py);
    the logged loss stays the student's LM loss, the distillation terms are logged beside it."""
    export_kd_cfg: str | None = None
    """With --export-kd-teacher-load: ModelOpt's distillation YAML (logit_layers,
    intermediate_layer_pairs, skip_lm_loss, kd_loss_scale, logit_kl_temperature); default:
    logits only, skip_lm_loss true, scale and temperature 1."""

    def __post_init__(self) -> None:
        if self.dry_run_device_memory_gb is not None and self.dry_run_device_memory_gb <= 0:
            raise ConfigError("--dry-run-device-memory-gb must be positive (GiB of one device), "
                              f"got {self.dry_run_device_memory_gb:g}")
        if self.step_batch_size_schedule is not None:
            if self.global_batch_size is not None or self.rampup_batch_size:
                raise ConfigError("--step-batch-size-schedule sets the global batch; drop "
                                  "--global-batch-size / --rampup-batch-size")
            batch_schedule(self.step_batch_size_schedule, None)  # its syntax errors, early
        if self.train_samples is not None:
            if self.train_iters is not None:
                raise ConfigError("--train-samples replaces --train-iters; pass only one")
            if not self.global_batch_size and self.step_batch_size_schedule is None:
                raise ConfigError("--train-samples needs --global-batch-size (its iteration "
                                  "count depends on it)")
            if self.step_batch_size_schedule is None:  # else Config sets it (--seq-length)
                self.train_iters = iterations_for_samples(self, self.train_samples)
        elif self.train_iters is None:
            self.train_iters = 20
        if self.export_kd_cfg is not None and self.export_kd_teacher_load is None:
            raise ConfigError("--export-kd-cfg configures distillation: give the teacher with "
                              "--export-kd-teacher-load too")
        if self.rampup_batch_size:
            start, increment, samples = [*self.rampup_batch_size, 0, 0, 0][:3]
            gbs = self.global_batch_size or 0
            if (len(self.rampup_batch_size) != 3 or start < 1 or increment < 1 or samples < 1
                    or gbs <= start or (gbs - start) % increment):
                raise ConfigError(
                    f"--rampup-batch-size {' '.join(map(str, self.rampup_batch_size))}: give "
                    "START INCREMENT SAMPLES, all positive, with --global-batch-size "
                    f"({self.global_batch_size}) above START and reached from it in whole "
                    "INCREMENTs")
        self._resolve_recompute()

    def _resolve_recompute(self) -> None:
        if self.recompute_granularity == "full":
            self.recompute_method = self.recompute_method or "uniform"
            self.recompute_num_layers = self.recompute_num_layers or 1
            if self.recompute_num_layers < 1:
                raise ConfigError("--recompute-num-layers must be >= 1, got "
                                  f"{self.recompute_num_layers}")
        elif self.recompute_granularity is None:
            # Megatron reads them only under --recompute-granularity full; without a
            # granularity nothing is recomputed (start-up says they were ignored)
            self.recompute_method = self.recompute_num_layers = None
        elif self.recompute_method is not None or self.recompute_num_layers is not None:
            raise ConfigError(
                "--recompute-method/--recompute-num-layers apply only with "
                f"--recompute-granularity full (got {self.recompute_granularity}); add "
                "--recompute-granularity full or drop them")


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


@functools.cache
def batch_schedule(text: str, seq_length: int | None) -> tuple[tuple[int, int], ...]:
    """--step-batch-size-schedule as (threshold in samples, batch) pairs, sorted; thresholds
    are tokens divided by `seq_length` (None: already samples)."""
    def number(word: str) -> int:
        word = word.strip().upper()
        scale = _SUFFIXES.get(word[-1:], 1)
        try:
            return int(float(word[:-1] if scale > 1 else word) * scale)
        except ValueError:
            raise ConfigError(f"--step-batch-size-schedule {text!r}: {word!r} is not a "
                              "number (K/M/B/T suffixes allowed)") from None

    pairs = []
    for entry in text.replace(",", " ").split():
        threshold, colon, batch = entry.partition(":")
        if not colon:
            raise ConfigError(f"--step-batch-size-schedule {text!r}: entry {entry!r} is not "
                              "THRESHOLD:BATCH, e.g. \"0:256 100B:512\"")
        tokens = number(threshold)
        pairs.append((tokens if seq_length is None else tokens // seq_length, number(batch)))
    pairs.sort(key=lambda pair: pair[0])
    if not pairs or pairs[0][0] != 0:
        raise ConfigError(f"--step-batch-size-schedule {text!r}: the first threshold must be 0")
    for (before, _), (after, _) in itertools.pairwise(pairs):
        if after <= before:
            raise ConfigError(f"--step-batch-size-schedule {text!r}: thresholds must increase "
                              f"(in samples of --seq-length tokens: {before} then {after})")
    if any(batch < 1 for _, batch in pairs):
        raise ConfigError(f"--step-batch-size-schedule {text!r}: every batch must be positive")
    return tuple(pairs)


def largest_global_batch(train: TrainConfig) -> int | None:
    """The largest global batch of a --step-batch-size-schedule (None without one)."""
    if train.step_batch_size_schedule is None:
        return None
    return max(batch for _, batch in batch_schedule(train.step_batch_size_schedule, None))


def global_batch_at(train: TrainConfig, consumed_samples: int, seq_length: int | None = None
                    ) -> int:
    """The global batch of the step that starts after `consumed_samples` samples.

    --step-batch-size-schedule: the batch of the last threshold at or below the position
    (thresholds in tokens, `seq_length` tokens a sample; None: in samples).

    Megatron's ramp-up: with --rampup-batch-size START INCREMENT SAMPLES the batch is START,
    then grows by INCREMENT every SAMPLES / ((GBS - START) / INCREMENT) samples, and is GBS
    once more than SAMPLES samples are consumed. A pure function of the position, so a
    resumed run takes exactly the batches it would have taken.
    """
    if train.step_batch_size_schedule is not None:
        return [batch for threshold, batch in batch_schedule(
            train.step_batch_size_schedule, seq_length) if threshold <= consumed_samples][-1]
    gbs = train.global_batch_size
    if not train.rampup_batch_size or gbs is None:
        return gbs or 0
    start, increment, samples = train.rampup_batch_size
    if consumed_samples > samples:
        return gbs
    per_increment = samples / ((gbs - start) // increment)
    return min(gbs, start + int(consumed_samples / per_increment) * increment)


@dataclass(frozen=True)
class Lengths:
    """The schedule's lengths in samples: warm-up (fractional with --lr-warmup-fraction),
    decay, and WSD's final decay phase (None unless set)."""

    warmup: float
    decay: int
    wsd: int | None


def schedule_lengths(optim: OptimConfig, train: TrainConfig, global_batch_size: int) -> Lengths:
    """Lengths in samples: --train-samples runs take the *-samples flags, iteration runs the
    *-iters flags times `global_batch_size` (--global-batch-size, the batch after a ramp-up)."""
    if train.train_samples is not None:
        decay = optim.lr_decay_samples or train.train_samples
        warmup: float = optim.lr_warmup_samples
        wsd = optim.lr_wsd_decay_samples
    else:
        decay = (optim.lr_decay_iters or train.train_iters or 0) * global_batch_size
        warmup = optim.lr_warmup_iters * global_batch_size
        wsd = None if optim.lr_wsd_decay_iters is None else (
            optim.lr_wsd_decay_iters * global_batch_size)
    if optim.lr_warmup_fraction is not None:
        warmup = optim.lr_warmup_fraction * decay
    return Lengths(warmup, decay, wsd)


def lr_schedule_errors(optim: OptimConfig, train: TrainConfig, global_batch_size: int
                    ) -> list[str]:
    """What Megatron's scheduler refuses, as messages naming the flags."""
    errors = []
    by_samples = train.train_samples is not None
    mixed = ([f for f, v in (("--lr-decay-iters", optim.lr_decay_iters),
                             ("--lr-warmup-iters", optim.lr_warmup_iters),
                             ("--lr-wsd-decay-iters", optim.lr_wsd_decay_iters)) if v]
             if by_samples else
             [f for f, v in (("--lr-decay-samples", optim.lr_decay_samples),
                             ("--lr-warmup-samples", optim.lr_warmup_samples),
                             ("--lr-wsd-decay-samples", optim.lr_wsd_decay_samples)) if v])
    if mixed:
        errors.append(f"{', '.join(mixed)} {'do' if len(mixed) > 1 else 'does'} not apply to "
                      f"{'a --train-samples' if by_samples else 'an iteration-based'} run; use "
                      f"the {'*-samples' if by_samples else '*-iters'} flags")
    lengths = schedule_lengths(optim, train, global_batch_size)
    # Megatron also refuses a warm-up as long as the decay; allowed here (the LR then only
    # warms up), so a short smoke run of a script with a long warm-up still starts
    if lengths.decay <= 0:
        errors.append("the LR decay length must be positive (--lr-decay-iters / "
                      "--lr-decay-samples)")
    if optim.lr_decay_style == "WSD" and lengths.wsd is None:
        errors.append("--lr-decay-style WSD needs the length of its final decay: "
                      f"--lr-wsd-decay-{'samples' if by_samples else 'iters'}")
    if not 0.0 <= optim.min_lr <= optim.lr:
        errors.append(f"--min-lr {optim.min_lr} must be in [0, --lr {optim.lr}]")
    if optim.lr_warmup_init > optim.lr:
        errors.append(f"--lr-warmup-init {optim.lr_warmup_init} must not exceed --lr {optim.lr}")
    return errors


def iterations_for_samples(train: TrainConfig, samples: int, seq_length: int | None = None
                           ) -> int:
    """Steps --train-samples takes, as Megatron counts them: the ramp-up's steps while neither
    its samples nor `samples` are used up (the last one may overshoot `samples`), then whole
    global batches; under --step-batch-size-schedule, steps until `samples` are consumed."""
    if train.step_batch_size_schedule is not None:
        iterations = consumed = 0
        while consumed < samples:
            consumed += global_batch_at(train, consumed, seq_length)
            iterations += 1
        return iterations
    gbs = train.global_batch_size or 1
    if not train.rampup_batch_size:
        return samples // gbs
    iterations = consumed = 0
    while consumed <= train.rampup_batch_size[2] and consumed <= samples:
        consumed += global_batch_at(train, consumed)
        iterations += 1
    return iterations + max(0, samples - consumed) // gbs


def parse_split(split: str) -> tuple[float, float, float]:
    """Megatron's `--split`: up to three non-negative train,valid,test weights, normalized to
    sum to 1 ("99,1,0", "99 1 0", "99/1/0" and "0.98,0.02" alike; missing ones are 0).

    Megatron takes every run of digits and dots as a number, so "-1" or "1e-3" would silently
    read as other weights there; here any sign, exponent or letter is an error instead.
    """
    numbers = re.findall(r"[0-9.]+", split)
    leftover = re.sub(r"[0-9.]+", "", split)
    problem = None
    if re.search(r"[A-Za-z+\-]", leftover):
        problem = "only digits, dots and separators are allowed (no sign, exponent or word)"
    elif not numbers or len(numbers) > 3:
        problem = f"expected 1 to 3 weights, found {len(numbers)}"
    else:
        try:
            weights = [float(x) for x in numbers]
        except ValueError:
            weights = []
            problem = f"{' '.join(numbers)} are not all numbers"
        if weights and sum(weights) <= 0:
            problem = "the weights sum to 0"
    if problem:
        raise ConfigError(f"--split {split!r}: {problem}; give train,valid,test proportions "
                          "like 969,30,1 or 99,1,0")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    train, valid, test = (w / total for w in weights)
    return train, valid, test


def parse_blend(paths: Sequence[str], flag: str = "--data-path"
                ) -> list[tuple[float | None, str]]:
    """Megatron's blend syntax: `A` or `A B C` (unweighted: weight None, each source then
    counts as many samples as it has, see data.dataset) or `0.3 A 0.7 B` (weight, path pairs;
    weights need not sum to 1). A list with no number in it is unweighted; one with a number
    must be weight/path pairs throughout, and anything else is refused by what is wrong."""
    if not paths:
        return []
    given = f"{flag} {' '.join(paths)}"
    if not any(_is_number(p) for p in paths):
        return [(None, p) for p in paths]
    pairs = [(paths[i], paths[i + 1]) for i in range(0, len(paths) - 1, 2)]
    problem = next((f"`{w}` stands where a weight belongs" for w, _ in pairs
                    if not _is_number(w)), None)
    problem = problem or next((f"the path after weight {w} is the number `{p}`"
                               for w, p in pairs if _is_number(p)), None)
    if problem is None and len(paths) % 2:
        problem = f"{len(paths)} entries, not weight/path pairs: `{paths[-1]}` is left over"
    if problem is None:
        weights = [float(w) for w, _ in pairs]
        problem = next((f"weight {w:g} is not a finite number >= 0" for w in weights
                        if not (0 <= w < math.inf)), None)
        if problem is None and not 0 < sum(weights) < math.inf:
            problem = f"the weights sum to {sum(weights):g}, not a positive finite number"
    if problem:
        raise ConfigError(f"{given}: {problem}; give paths (`{flag} A B`, weighted by their "
                          f"sizes) or weight/path pairs (`{flag} 0.3 A 0.7 B`, weights >= 0, "
                          "not all 0)")
    return [(float(w), p) for w, p in pairs]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass
class DataConfig:
    """Where samples come from."""

    mock_data: bool = False
    """Synthetic learnable token sequences, a deterministic function of --seed and sample index."""
    data_path: list[str] = field(default_factory=list)
    """Shard prefixes or manifests: `pathA pathB` (weighted by their samples, as Megatron) or
    weight/path pairs `0.7 pathA 0.3 pathB`."""
    split: str = "969,30,1"
    """Train,valid,test proportions of the documents, in Megatron's spellings (99,1,0 or
    "99 1 0" or 99/1/0; missing parts are 0)."""
    tokenizer_model: str | None = None
    """The tokenizer file: a sentencepiece .model, a Hugging Face tokenizer.json or its directory
    (HuggingFaceTokenizer) or Megatron's tiktoken .json (TikTokenizer); sets vocab size and EOD."""
    tokenizer_type: str | None = field(default=None, metadata={"choices": [
        "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
        "HuggingFaceTokenizer", "GPT2BPETokenizer", "TikTokenizer", "NullTokenizer"]})
    """Megatron's tokenizer names (default: sentencepiece). HuggingFaceTokenizer: EOD = the
    eos_token of tokenizer_config.json; GPT2BPETokenizer: --vocab-file + --merge-file, EOD =
    <|endoftext|>; TikTokenizer: EOD = </s> (id 2); NullTokenizer has no file (vocab =
    --vocab-size, EOD = --null-tokenizer-eod-id). tokenizer/spec.py has the details."""
    vocab_file: str | None = None
    """GPT2BPETokenizer's vocab.json."""
    merge_file: str | None = None
    """GPT2BPETokenizer's merges.txt."""
    tiktoken_pattern: str | None = field(default=None, metadata={"choices": ["v1", "v2"]})
    """TikTokenizer's pre-tokenizer regex (Megatron's v1 or v2; default v2)."""
    tiktoken_num_special_tokens: int = 1000
    """TikTokenizer: ids below this are special tokens; the BPE ranks follow."""
    special_tokens: list[str] = field(default_factory=list,
                                      metadata={"flag": "--tokenizer-special-tokens"})
    """TikTokenizer's special tokens (default <unk> <s> </s> <mask> <pad> <cls> <sep>)."""
    null_tokenizer_eod_id: int | None = None
    """NullTokenizer's end-of-document id (default vocab - 1; Llama-3 shards: 128001)."""
    tokenizer_hf_no_include_special_tokens: bool = False
    """HuggingFaceTokenizer: encode without the post-processor's special tokens (e.g. BOS)."""
    train_data_path: list[str] = field(default_factory=list)
    """Training data only (blend syntax as --data-path), instead of --data-path + --split."""
    valid_data_path: list[str] = field(default_factory=list)
    """Validation data only (blend syntax), e.g. a held-out corpus."""
    test_data_path: list[str] = field(default_factory=list)
    """Test data only (blend syntax); evaluated once at the end of training."""
    data_sharding: str = field(default="global", metadata={"choices": ["global", "node-local"]})
    """global = shared storage, global shuffle; node-local = each DP rank reads its own shards."""
    expect_full_pass: bool = False
    """The run is meant to see all of its training data: warn at start-up when the planned
    samples cover less than one epoch (it prints the planned epochs either way)."""
    num_workers: int = 2
    """Training steps of micro-batches a background thread prepares ahead (0 = none)."""
    data_cache_path: str | None = None
    """Directory for cached sample/shuffle indices (default: next to the data)."""
    eod_mask_loss: bool = False
    """Do not train on predicting the token after an end-of-document token."""
    reset_position_ids: bool = False
    """Positions (RoPE) restart at 0 after each end-of-document token of a packed sample."""
    reset_attention_mask: bool = False
    """Tokens attend only within their own document of a packed sample (EOD ends one); as in
    Megatron, only with the dataloader's attention mask (see the next flag)."""
    create_attention_mask_in_dataloader: bool = True
    """Megatron's switch for the dataloader's attention mask: --no-create-attention-mask-in-
    dataloader leaves attention plainly causal, so --reset-attention-mask then has no effect
    (no [s, s] mask is ever built here; documents are kept apart inside attention)."""
    verify_checksums: bool = False
    """Before training, compare every shard this rank reads with its manifest sha256 (reads all)."""

    def __post_init__(self) -> None:
        if self.tokenizer_type == "NullTokenizer" and self.tokenizer_model:
            raise ConfigError("--tokenizer-type NullTokenizer reads no file (vocab = "
                              "--vocab-size); drop --tokenizer-model")
        if (self.tokenizer_type not in (None, "NullTokenizer", "GPT2BPETokenizer")
                and not self.tokenizer_model):
            raise ConfigError(f"--tokenizer-type {self.tokenizer_type} loads --tokenizer-model: "
                              "pass its file")
        if self.data_path and (self.train_data_path or self.valid_data_path
                               or self.test_data_path):
            raise ConfigError("--data-path (split by --split) and --train/valid/test-data-path "
                              "are two ways to give the data; pass one of them")
        if (self.valid_data_path or self.test_data_path) and not self.train_data_path:
            raise ConfigError("--valid-data-path / --test-data-path need --train-data-path")

    def all_paths(self) -> list[list[str]]:
        """Every blend given (--data-path, or the per-split ones)."""
        return [p for p in (self.data_path, self.train_data_path, self.valid_data_path,
                            self.test_data_path) if p]


@dataclass
class LoggingConfig:
    """What is printed and recorded."""

    log_interval: int = 100
    """Print a log line every this many iterations (and at the last one)."""
    log_rank_grid: bool = False
    """Print every group of the rank grid at start-up and in --dry-run (summarized beyond a
    screenful otherwise)."""
    log_jsonl: str | None = None
    """Write one JSON object per logged iteration and per evaluation to this file."""
    peak_tflops: float | None = None
    """Device peak TFLOP/s for MFU, in the model's GEMM dtype; default: the GPU's datasheet
    (megatron_lite/devices.py), or that dtype's matmul measured on a CPU."""
    wandb_project: str | None = None
    """Log to this wandb project (offline when no API key is set)."""
    wandb_exp_name: str | None = None
    """wandb run name."""
    wandb_save_dir: str | None = None
    """Directory for wandb files."""
    wandb_mode: str | None = field(
        default=None, metadata={"choices": ["online", "offline", "disabled"]}
    )
    """Force a wandb mode; default online with an API key, offline without."""
    tensorboard_dir: str | None = None
    """Write TensorBoard event files here (same scalar names as the JSONL)."""
    tensorboard_log_interval: int = 1
    """Write TensorBoard scalars every this many iterations."""
    log_timers_to_tensorboard: bool = False
    """Also write iteration and forward/backward times to TensorBoard."""
    log_memory_to_tensorboard: bool = False
    """Also write device memory statistics to TensorBoard."""
    log_validation_ppl_to_tensorboard: bool = False
    """Also write validation (and test) perplexity, exp(loss), to TensorBoard."""
    log_params_norm: bool = False
    """Compute the global L2 norm of the weights at each log line (one extra reduction)."""
    log_num_zeros_in_grad: bool = False
    """Count gradient elements that are exactly zero at each log line (one extra reduction)."""
    log_throughput: bool = False
    """Also write tokens/s, TFLOP/s and MFU to TensorBoard (the log line always has them)."""
    profile: bool = False
    """Record a torch.profiler trace (CPU and CUDA) of steps --profile-step-start..end."""
    profile_step_start: int = 10
    """First profiled iteration."""
    profile_step_end: int = 12
    """Iteration at which profiling stops (not profiled itself)."""
    profile_ranks: list[int] = field(default_factory=list)
    """Global ranks that profile (default: all of them); each writes its own trace file named
    by rank."""
    profile_dir: str | None = None
    """Directory for the traces; default --tensorboard-dir."""
    straggler_threshold: float = 0.10
    """Warn when a rank's forward-backward time is this fraction above the median rank's."""
    straggler_intervals: int = 3
    """Log intervals in a row a rank must stay that slow before the warning (one is noise)."""

    def __post_init__(self) -> None:
        if self.tensorboard_log_interval < 1:
            raise ConfigError(f"--tensorboard-log-interval must be >= 1, got "
                              f"{self.tensorboard_log_interval}")
        if not self.profile:
            return
        if self.profile_step_end <= self.profile_step_start:
            raise ConfigError(f"--profile-step-end {self.profile_step_end} must be above "
                              f"--profile-step-start {self.profile_step_start}")
        if not (self.profile_dir or self.tensorboard_dir):
            raise ConfigError("--profile writes its traces into --profile-dir or "
                              "--tensorboard-dir; pass one of them")


@dataclass
class CheckpointConfig:
    """Saving, resuming and exiting (see megatron_lite/checkpoint)."""

    save: str | None = None
    """Directory for checkpoints (iter_XXXXXXX/ subdirectories and a `latest` pointer)."""
    load: str | None = None
    """Checkpoint directory to resume from; default --save (a restarted job resumes itself)."""
    save_interval: int | None = field(default=None,
                                      metadata={"aliases": ["--persistent-save-interval"]})
    """Save every this many iterations (and always at the end with --save)."""
    save_interval_minutes: float | None = None
    """Also save when this many wall-clock minutes have passed since the last save."""
    save_keep_last: int | None = None
    """Keep only the newest K checkpoints; older ones are deleted after a new one is complete."""
    async_save: bool = False
    """Write checkpoint files in a background thread while training continues."""
    ckpt_staging_buffer_gb: float = 2.0
    """GiB of host staging buffer (pinned when the state is on a GPU) that a save streams
    through piece by piece, so pinned memory stays bounded however large the rank's state
    (a whole 8B rank's checkpoint on 8 GPUs would pin ~12 GB for the whole run); the files
    are byte-identical for any size. --async-save also needs a pageable host copy of the
    state (kept for the next save), which it fills through this buffer."""
    exit_interval: int | None = None
    """Save and exit cleanly when the iteration is a multiple of this (splits a run into jobs)."""
    ckpt_step: int | None = None
    """Load this iteration instead of the one `latest` points to."""
    no_load_optim: bool = False
    """Resume weights, position and RNG but start the optimizer (Adam moments, step) fresh."""
    no_load_rng: bool = False
    """Do not restore the RNG states saved in the checkpoint."""
    finetune: bool = False
    """Load only the weights: start at iteration 0 with a fresh optimizer and data position."""
    use_checkpoint_args: bool = False
    """Take the model shape (every model flag) from the config saved in the checkpoint."""
    use_checkpoint_opt_param_scheduler: bool = field(default=False, metadata={
        "flag": "--use-checkpoint-opt_param-scheduler",
        "aliases": ["--use-checkpoint-opt-param-scheduler"]})
    """Take the LR schedule (--lr*, --min-lr, --decoupled-*) from the checkpoint's config."""
    override_opt_param_scheduler: bool = field(default=False, metadata={
        "flag": "--override-opt_param-scheduler",
        "aliases": ["--override-opt-param-scheduler"]})
    """Resume on this run's LR and weight-decay schedule even where it differs from the
    checkpoint's (without it, or --use-checkpoint-opt_param-scheduler, a resume whose
    --lr, --min-lr, warm-up, decay length or style, or --weight-decay changed is refused)."""
    ckpt_fallback: bool = True
    """When the newest checkpoint fails verification (checksums, sizes, missing files), load
    the previous complete one; --no-ckpt-fallback stops with the error instead."""

    def __post_init__(self) -> None:
        for name in ("save_interval", "save_keep_last", "exit_interval"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{_dash(name)} must be >= 1, got {value}")
        if self.save_interval_minutes is not None and self.save_interval_minutes <= 0:
            raise ConfigError(f"--save-interval-minutes must be > 0, got "
                              f"{self.save_interval_minutes}")
        if not self.ckpt_staging_buffer_gb > 0:
            raise ConfigError(f"--ckpt-staging-buffer-gb must be > 0, got "
                              f"{self.ckpt_staging_buffer_gb}")
        if self.async_save and not self.save:
            raise ConfigError("--async-save needs --save DIR")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError("--override-opt_param-scheduler (this run's schedule) and "
                              "--use-checkpoint-opt_param-scheduler (the checkpoint's) "
                              "contradict each other; pass one")


@dataclass
class ReliabilityConfig:
    """Preemption, hangs, NaN/Inf and loss spikes (see megatron_lite/reliability)."""

    exit_duration_in_mins: float | None = None
    """Save and exit cleanly once this many minutes have passed since start (Slurm limits)."""
    hang_timeout_seconds: float | None = None
    """Dump every thread's stack and exit non-zero when one phase of an iteration (or a save)
    takes longer than this; set it above the slowest save. None = off."""
    check_for_nan_in_loss_and_grad: bool = True
    """Check the local loss and local gradients for NaN/Inf before any reduction, and skip an
    optimizer step whose update is not sure to leave the weights and Adam state finite."""
    on_nan: str = field(default="skip", metadata={"choices": ["skip", "stop"]})
    """On NaN/Inf: skip the step on every rank (no update), or stop the run."""
    spike_threshold: float | None = None
    """A loss above the mean of the last 50 accepted losses plus this many of their standard
    deviations (at least 1% of the mean) is a spike; needs 10 losses first. None = off."""
    on_spike: str = field(default="skip", metadata={"choices": ["skip", "rollback"]})
    """On a spike: skip the step, or after --spike-patience in a row roll back to the last
    checkpoint."""
    spike_patience: int = 3
    """Consecutive spikes that trigger a rollback (--on-spike rollback)."""
    spike_accept_after: int = 5
    """Spikes in a row after which the loss is taken as a new level (a genuine shift): the
    detector restarts its statistics from those losses and the step trains, instead of every
    later step being skipped. 0 = never (under --on-spike rollback, --spike-patience acts
    first when it is smaller)."""
    max_skipped_iterations_in_a_row: int = 10
    """Save and stop with a non-zero exit once this many steps in a row were skipped (NaN/Inf,
    loss spikes, non-finite gradient norm): a rank that keeps producing NaNs must not consume
    the data. 0 = no limit."""
    max_skipped_iterations: int = 100
    """Save and stop the same way once this many steps were skipped in all, counted across
    resumes (--skip-iterations are not counted). 0 = no limit."""
    error_injection_rate: int = 0
    """Megatron's fault drill: on each step a rank draws (R + its rank) mod N, R uniform in
    0..N-1, and on 0 its loss is made NaN, so the NaN guard's handling is exercised in a real
    run (0 = never). Megatron re-runs such a step to diagnose it; the guard here skips or stops
    it as --on-nan says."""
    error_injection_type: str = field(default="transient_error", metadata={
        "choices": ["correct_result", "transient_error", "persistent_error"]})
    """What a drill fault is: transient_error and correct_result spoil one step's loss;
    persistent_error (a faulty GPU) that step's and every later one's on that rank, so the
    guard stops after --max-skipped-iterations-in-a-row."""
    spike_skip_samples: int | None = None
    """After a rollback, skip this many samples past the spike (default: the spiking steps')."""
    spike_lr_factor: float = 0.5
    """After a rollback, multiply the LR by this for --spike-lr-iters iterations."""
    spike_lr_iters: int = 0
    """Iterations the lowered LR lasts after a rollback."""
    skip_iterations: list[int] = field(default_factory=list)
    """Consume these iterations' data without training on it (known bad batches)."""
    mtbf_hours: float | None = None
    """Job-level mean time between failures; logs the Young/Daly save interval next to yours."""
    preflight: str = field(default="off", metadata={"choices": ["off", "quick"]})
    """quick: before the rendezvous every rank checks its device with a short GEMM (result vs
    float64, rate vs the bf16 peak) and local rank 0 the nvidia-smi ECC counters; a failing
    host is named and the job exits 4 (reliability/preflight.py; the launch scripts then
    resubmit without it)."""

    def __post_init__(self) -> None:
        for name in ("exit_duration_in_mins", "hang_timeout_seconds", "spike_threshold",
                     "mtbf_hours"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"--{_dash(name)} must be > 0, got {value}")
        if self.spike_patience < 1:
            raise ConfigError(f"--spike-patience must be >= 1, got {self.spike_patience}")
        if not 0 < self.spike_lr_factor <= 1:
            raise ConfigError(f"--spike-lr-factor must be in (0, 1], got {self.spike_lr_factor}")
        if self.spike_skip_samples is not None and self.spike_skip_samples < 0:
            raise ConfigError(f"--spike-skip-samples must be >= 0, got {self.spike_skip_samples}")
        if self.spike_lr_iters < 0:
            raise ConfigError(f"--spike-lr-iters must be >= 0, got {self.spike_lr_iters}")
        if self.error_injection_rate < 0:
            raise ConfigError("--error-injection-rate must be >= 0 (0 = no injection), got "
                              f"{self.error_injection_rate}")
        for name in ("max_skipped_iterations_in_a_row", "max_skipped_iterations"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{_dash(name)} must be >= 0 (0 = no limit), got "
                                  f"{getattr(self, name)}")
        accept, in_a_row = self.spike_accept_after, self.max_skipped_iterations_in_a_row
        if accept == 1 or accept < 0:
            raise ConfigError(f"--spike-accept-after must be 0 (never) or >= 2, got {accept}")
        if self.spike_threshold is not None and accept and in_a_row and accept > in_a_row:
            raise ConfigError(f"--spike-accept-after {accept} can never act: the run stops "
                              f"after --max-skipped-iterations-in-a-row {in_a_row}; lower the "
                              "first or raise the second")


MOE_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
"""--moe-router-load-balancing-type values implemented here."""


@dataclass
class MoEConfig:
    """Mixture of experts (Megatron's --num-experts and --moe-* flags); dense without
    --num-experts."""

    num_experts: int | None = None
    """Routed experts in each MoE layer; None = a dense model (every layer a SwiGLU MLP)."""
    moe_layer_freq: str = "1"
    """Which layers are MoE (Megatron's meaning): an int N makes every Nth layer MoE, counting
    from layer 0; a Python list expression of 0/1 per layer, e.g. "([0]+[1]*23)", picks them
    one by one."""
    moe_ffn_hidden_size: int | None = None
    """SwiGLU inner width of each routed expert; default --ffn-hidden-size."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_shared_expert_intermediate_size: int | None = None
    """Inner width of the shared expert, a SwiGLU MLP every token passes through, added to the
    routed output (DeepSeek, Qwen2-MoE); None = no shared expert."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output per token by sigmoid(x . g), g a learned [h] vector
    (Qwen2-MoE's shared_expert_gate); needs --moe-shared-expert-intermediate-size."""
    moe_shared_expert_overlap: bool = False
    """Compute the shared expert while the alltoall dispatcher's token exchange is in flight
    (otherwise after the routed experts); the same numbers either way."""
    moe_expert_capacity_factor: float | None = None
    """Capacity of each expert as this factor x tokens x top-k / experts (rounded up); tokens
    over it are dropped (their routed output is zero). None = dropless."""
    moe_token_drop_policy: str = field(default="probs", metadata={
        "choices": ["probs", "position"]})
    """Which tokens an over-capacity expert keeps: the highest router probabilities, or the
    first in the sequence."""
    moe_pad_expert_input_to_capacity: bool = False
    """With a capacity: every expert computes exactly its capacity of rows, filled up with
    tokens of router weight zero (fixed shapes)."""
    moe_router_score_function: str = field(default="softmax", metadata={
        "choices": ["softmax", "sigmoid"]})
    """Router score: softmax over the experts, or an independent sigmoid per expert
    (DeepSeek-V3; the top-k scores are then normalised to sum to 1 when top-k > 1)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (the default takes the top-k logits and
    softmaxes those); needed for top-1 with softmax."""
    moe_router_topk_scaling_factor: float | None = None
    """Multiply the chosen experts' weights by this (DeepSeek-V3: 2.5)."""
    moe_router_num_groups: int | None = None
    """Group-limited routing: the experts form this many equal groups..."""
    moe_router_group_topk: int | None = None
    """...and each token picks its top-k experts inside its best groups only (a group's score:
    the sum of its top top-k/groups expert scores); None = no group limit."""
    moe_router_dtype: str | None = field(default=None, metadata={"choices": ["fp32", "fp64"]})
    """Router logits, scores and losses in this dtype; None = the model's dtype."""
    moe_router_load_balancing_type: str = field(default="aux_loss", metadata={
        "choices": list(MOE_LOAD_BALANCING)})
    """aux_loss: the Switch/GShard loss over each micro-batch; seq_aux_loss: the same per
    sequence, averaged (DeepSeek-V2/V3); none. Both act only with --moe-aux-loss-coeff > 0."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (0 = off)."""
    moe_z_loss_coeff: float | None = None
    """Weight of the router z-loss, mean of logsumexp(logits)^2 (ST-MoE); None = off."""
    moe_router_enable_expert_bias: bool = False
    """DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores for
    the top-k choice only, moved after every step by --moe-router-bias-update-rate towards
    equal load (from the step's token counts over all ranks). Saved in checkpoints."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update: bias += rate x sign(mean load - expert load)."""
    expert_model_parallel_size: int = 1
    """Expert parallelism: the routed experts split over this many ranks, carved out of a
    pipeline stage's TP x DP x CP ranks with the expert-TP ranks innermost (Megatron's MoE
    parallel folding); EP x expert-TP must divide them, EP --num-experts."""
    expert_tensor_parallel_size: int | None = None
    """TP size of the experts (default --tensor-model-parallel-size): each expert's weights
    split over this many consecutive TP ranks; a divisor of TP, and below TP it needs
    --sequence-parallel (each TP rank then routes its own tokens; 1 = whole experts, their
    tokens reaching them over EP instead of TP)."""
    moe_token_dispatcher_type: str = field(
        default="allgather", metadata={"choices": ["allgather", "alltoall"]})
    """How tokens reach the experts of other EP ranks: allgather (every EP rank receives all
    the group's tokens and runs its experts on the ones routed there; output reduce-scattered
    back) or alltoall (each token sent only to the ranks of its chosen experts, with the
    per-expert counts exchanged first)."""

    def __post_init__(self) -> None:
        if self.num_experts is not None:
            moe_layer_pattern(self.moe_layer_freq, None)  # a malformed expression fails here


def moe_layer_pattern(freq: str, num_layers: int | None) -> list[bool]:
    """--moe-layer-freq as one flag per layer (True = MoE): an int N marks layers 0, N, 2N, ...;
    a list expression (ints, lists, + and * only) is read without eval."""
    text = freq.strip()
    if re.fullmatch(r"\d+", text):
        n = int(text)
        if n < 1:
            raise ConfigError(f"--moe-layer-freq {freq}: an int must be >= 1")
        return [i % n == 0 for i in range(num_layers or 0)]
    try:
        values = _list_expr(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError) as e:
        raise ConfigError(f"--moe-layer-freq {freq!r}: not an int or a list expression of "
                          f"0/1 such as \"([0]+[1]*23)\" ({e})") from None
    if not isinstance(values, list) or any(v not in (0, 1) for v in values):
        raise ConfigError(f"--moe-layer-freq {freq!r} must give a list of 0 and 1, one per layer")
    if num_layers is not None and len(values) != num_layers:
        raise ConfigError(f"--moe-layer-freq {freq!r} has {len(values)} entries but "
                          f"--num-layers is {num_layers}; give one 0/1 per layer")
    return [bool(v) for v in values]


def _list_expr(node: ast.AST) -> int | list:
    """The value of an expression of int constants, lists, + and * (nothing else)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_list_expr(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _list_expr(node.left), _list_expr(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"{type(node).__name__} is not allowed")


def moe_errors(cfg: Config, world_size: int = 1) -> list[str]:
    """What a MoE run needs of the other flags (nothing when --num-experts is not given)."""
    moe, model = cfg.moe, cfg.model
    tp = cfg.parallel.tensor_model_parallel_size
    if moe.num_experts is None:
        if moe.expert_model_parallel_size > 1:
            return [f"--expert-model-parallel-size {moe.expert_model_parallel_size} needs "
                    "--num-experts (a dense model has no experts to split)"]
        return []
    errors = _expert_parallel_errors(cfg, world_size)
    etp = moe.expert_tensor_parallel_size or tp
    if tp % etp:
        errors.append(f"--expert-tensor-parallel-size {etp} does not divide "
                      f"--tensor-model-parallel-size {tp}: the experts are split over "
                      "consecutive TP ranks (a larger expert TP than TP is not implemented)")
    elif etp < tp and not cfg.parallel.sequence_parallel:
        errors.append(f"--expert-tensor-parallel-size {etp} below --tensor-model-parallel-size "
                      f"{tp} needs --sequence-parallel: without it every TP rank holds the "
                      "same tokens, which the experts would count once per rank")
    try:
        pattern = moe_layer_pattern(moe.moe_layer_freq, model.num_layers)
        if not any(pattern):
            errors.append(f"--moe-layer-freq {moe.moe_layer_freq} makes no layer MoE")
    except ConfigError as e:
        errors.append(str(e))
    errors += _moe_router_errors(moe)
    for name, width in (("--moe-ffn-hidden-size", moe_ffn_size(cfg)),
                        ("--moe-shared-expert-intermediate-size",
                         moe.moe_shared_expert_intermediate_size)):
        if width is not None and width % tp:
            errors.append(f"{name} {width} is not divisible by --tensor-model-parallel-size "
                          f"{tp}")
    if moe.moe_shared_expert_gate and not moe.moe_shared_expert_intermediate_size:
        errors.append("--moe-shared-expert-gate gates the shared expert: it needs "
                      "--moe-shared-expert-intermediate-size")
    if moe.moe_shared_expert_overlap and (not moe.moe_shared_expert_intermediate_size
                                          or moe.moe_token_dispatcher_type != "alltoall"):
        errors.append("--moe-shared-expert-overlap overlaps the shared expert with the token "
                      "all-to-all: it needs --moe-shared-expert-intermediate-size and "
                      "--moe-token-dispatcher-type alltoall")
    if moe.moe_pad_expert_input_to_capacity and moe.moe_expert_capacity_factor is None:
        errors.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    return errors


def _expert_parallel_errors(cfg: Config, world_size: int) -> list[str]:
    """--expert-model-parallel-size must split the experts, and EP x expert-TP a pipeline
    stage's ranks, evenly."""
    ep, experts = cfg.moe.expert_model_parallel_size, cfg.moe.num_experts
    par = cfg.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    etp = cfg.moe.expert_tensor_parallel_size or tp
    if ep == 1 and etp == tp:
        return []
    stage = world_size // pp if world_size % (tp * pp) == 0 else 0
    errors = []
    if experts % ep:
        errors.append(f"--expert-model-parallel-size {ep} does not divide --num-experts "
                      f"{experts}; pick a divisor of the experts")
    if stage and stage % (ep * etp):
        errors.append(f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size "
                      f"{etp} does not divide the {stage} ranks of a pipeline stage it is "
                      "carved out of (world size / PP); launch a multiple of EP x expert-TP "
                      "x PP ranks")
    return errors


def _moe_router_errors(moe: MoEConfig) -> list[str]:
    """The router flags' own rules (Megatron's)."""
    errors = []
    if moe.moe_router_topk > moe.num_experts:
        errors.append(f"--moe-router-topk {moe.moe_router_topk} exceeds --num-experts "
                      f"{moe.num_experts}")
    if (moe.moe_router_topk == 1 and moe.moe_router_score_function == "softmax"
            and not moe.moe_router_pre_softmax):
        errors.append("--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax "
                      "(a softmax over one chosen logit is 1 and gives the router no gradient)")
    groups, group_topk = moe.moe_router_num_groups, moe.moe_router_group_topk
    if group_topk is not None:
        if groups is None:
            errors.append("--moe-router-group-topk needs --moe-router-num-groups")
        elif moe.num_experts % groups or group_topk > groups or moe.moe_router_topk % group_topk:
            errors.append(f"group-limited routing needs --num-experts ({moe.num_experts}) "
                          f"divisible by --moe-router-num-groups ({groups}), "
                          f"--moe-router-group-topk ({group_topk}) <= the groups and dividing "
                          f"--moe-router-topk ({moe.moe_router_topk})")
    if moe.moe_router_enable_expert_bias and moe.moe_router_score_function != "sigmoid":
        errors.append("--moe-router-enable-expert-bias needs --moe-router-score-function "
                      "sigmoid (the bias shifts sigmoid scores, as in DeepSeek-V3 and Megatron)")
    return errors


def moe_ffn_size(cfg: Config) -> int | None:
    """Each routed expert's SwiGLU width (--moe-ffn-hidden-size, default --ffn-hidden-size)."""
    if cfg.moe.num_experts is None:
        return None
    return cfg.moe.moe_ffn_hidden_size or cfg.model.ffn_hidden_size


@dataclass
class Config:
    """Everything one run needs; frozen in spirit once validated (treat as read-only)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        t = self.train
        if t.step_batch_size_schedule is not None:
            batch_schedule(t.step_batch_size_schedule, self.model.seq_length)  # increasing?
            if t.train_samples is not None:
                t.train_iters = iterations_for_samples(t, t.train_samples, self.model.seq_length)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    f.name: globals()[f.type] if isinstance(f.type, str) else f.type
    for f in dataclasses.fields(Config)
}
"""Section name -> dataclass, in flag-group order."""


def _dash(name: str) -> str:
    return name.replace("_", "-")


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """Ranks holding different samples: the world over tp x cp x pp (CP ranks of one DP rank
    share its samples, each holding other chunks of them)."""
    return world_size // model_replica_size(cfg.parallel)


def model_replica_size(parallel: ParallelConfig) -> int:
    """tp x cp x pp: the ranks one data-parallel rank spans."""
    return (parallel.tensor_model_parallel_size * parallel.context_parallel_size
            * parallel.pipeline_model_parallel_size)


def num_microbatches(cfg: Config, world_size: int) -> int:
    """Gradient-accumulation steps = global batch / (micro batch x dp); the largest one of a
    --step-batch-size-schedule."""
    dp = data_parallel_size(cfg, world_size)
    gbs = (largest_global_batch(cfg.train) or cfg.train.global_batch_size
           or cfg.train.micro_batch_size * dp)
    return gbs // (cfg.train.micro_batch_size * dp)


def _fp64_errors(cfg: Config) -> list[str]:
    """--fp64 is all-float64 or nothing: a bf16 weight, a bf16 reduction or an fp32 kernel would
    bring back the rounding it exists to remove."""
    if not cfg.train.fp64:
        return []
    clashes = [flag for flag, on in (("--bf16", cfg.train.bf16),
                                     ("--grad-reduce-in-bf16", cfg.parallel.grad_reduce_in_bf16),
                                     ("--triton-kernels on", cfg.model.triton_kernels == "on"))
               if on]
    return [f"--fp64 computes everything in float64 but {flag} is set; drop one of them"
            for flag in clashes]


def _fp8_errors(cfg: Config) -> list[str]:
    """FP8 is built for tensorwise and rowwise current and delayed scaling, in bf16 or fp32
    models."""
    t = cfg.train
    if t.fp8_format is None:
        return (["--fp8-param-gather gathers the FP8 linears' weights in fp8, but no linear is "
                 "FP8: add --fp8-format hybrid (or e4m3)"] if t.fp8_param_gather else [])
    errors = []
    if t.fp8_recipe not in ("tensorwise", "delayed", "rowwise"):
        errors.append(f"--fp8-recipe {t.fp8_recipe} is not implemented (no mxfp8, blockwise "
                      "or custom scaling); use --fp8-recipe delayed, tensorwise or rowwise")
    if t.fp8_recipe == "rowwise" and t.fp8_param_gather:
        errors.append("--fp8-param-gather gathers each weight with one tensorwise scale, but "
                      "--fp8-recipe rowwise scales a weight per row in the forward and per "
                      "column in backward: drop --fp8-param-gather, or use --fp8-recipe "
                      "delayed or tensorwise")
    if t.fp64:
        errors.append("--fp8-format rounds GEMM operands to 8 bits but --fp64 is exact math; "
                      "drop one of them")
    errors += _fp8_param_gather_errors(cfg)
    return errors


def fp8_bf16_layers(train: TrainConfig, num_layers: int) -> frozenset[int]:
    """The transformer layers --first-last-layers-bf16 keeps out of FP8 (as in Megatron: the
    first and last N of the whole model, whatever stage holds them)."""
    if train.fp8_format is None or not train.first_last_layers_bf16:
        return frozenset()
    start = range(min(train.num_layers_at_start_in_bf16, num_layers))
    end = range(max(num_layers - train.num_layers_at_end_in_bf16, 0), num_layers)
    return frozenset(start) | frozenset(end)


FP8_LINEARS = ("attention.qkv", "attention.proj", "mlp.gate_up", "mlp.down",
               "mlp.shared.gate_up", "mlp.shared.down")
"""Where FP8 linears may sit in a transformer layer: the rows per layer of the delayed
recipe's amax tables (layers/fp8.Fp8History), whichever of them the layer has."""


def fp8_scaling_state_bytes(train: TrainConfig, num_layers: int) -> int:
    """Bytes every rank keeps for the delayed recipe (none for tensorwise): the whole model's
    fp32 amax histories [layers x len(FP8_LINEARS), --fp8-amax-history-len, 3 operands] and the
    step's running amaxes [layers x len(FP8_LINEARS), 3]."""
    if train.fp8_format is None or train.fp8_recipe != "delayed":
        return 0
    return 4 * num_layers * len(FP8_LINEARS) * 3 * (train.fp8_amax_history_len + 1)


def _fp8_param_gather_errors(cfg: Config) -> list[str]:
    """The FP8 gather replaces the distributed optimizer's parameter all-gathers (ZeRO-1/2's
    after the step, ZeRO-3's per unit); Megatron refuses it without one too."""
    if not cfg.train.fp8_param_gather:
        return []
    strategy = cfg.parallel.data_parallel_sharding_strategy
    if strategy == "no_shard":
        return ["--fp8-param-gather casts the distributed optimizer's parameter all-gather to "
                "fp8, but there is none: add --use-distributed-optimizer"]
    return []


def validate(cfg: Config, world_size: int) -> None:
    """Cross-field checks, run before anything is allocated. Raises ConfigError with every
    problem found (one per line), so a user fixes a command line in one go."""
    parallel, tp = cfg.parallel, cfg.parallel.tensor_model_parallel_size
    errors = _grid_errors(cfg, world_size)
    errors += _context_parallel_errors(cfg)
    errors += _fp64_errors(cfg)
    errors += _fp8_errors(cfg)
    errors += moe_errors(cfg, world_size)
    errors += _head_dim_errors(cfg.model)
    errors += _rotary_errors(cfg.model)
    errors += _padded_vocab_errors(cfg.model, tp)
    errors += _head_split_errors(cfg.model, tp)
    errors += _sequence_length_errors(cfg)
    errors += _batch_errors(cfg, world_size)
    errors += _schedule_errors(cfg)
    errors += _dry_run_errors(cfg, world_size)
    errors += layout.overlap_param_gather_errors(parallel.overlap_param_gather,
                                                 parallel.use_distributed_optimizer)
    errors += _sharding_errors(parallel, cfg.train.compile)
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))


def _grid_errors(cfg: Config, world_size: int) -> list[str]:
    """The world must tile into whole model replicas (tp x cp x pp); every per-replica check
    (`_batch_errors`) is skipped when it does not, as the data-parallel size is then undefined."""
    parallel = cfg.parallel
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    cp = parallel.context_parallel_size
    replica = model_replica_size(parallel)
    if not world_size % replica:
        return []
    return [f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            + (f"--context-parallel-size {cp} x " if cp > 1 else "")
            + f"--pipeline-model-parallel-size {pp} = {replica}; launch a multiple of "
            f"{replica} processes or change the parallel sizes"]


def _head_dim_errors(model: ModelConfig) -> list[str]:
    """The head dim must exist (width / heads, or --kv-channels) and be even and positive, as
    rotary embeddings rotate channel pairs."""
    if model.kv_channels is None:
        return [f"--hidden-size {model.hidden_size} is not divisible by --num-attention-heads "
                f"{model.num_attention_heads}; pick heads that divide the width or set the head "
                "dim with --kv-channels"]
    if model.kv_channels <= 0 or model.kv_channels % 2:
        return [f"head dim {model.kv_channels} (--kv-channels, default --hidden-size / "
                "--num-attention-heads) must be even and positive for rotary embeddings"]
    return []


def _head_split_errors(model: ModelConfig, tp: int) -> list[str]:
    """Each KV head serves whole query heads, and tensor parallelism splits heads, KV groups and
    the MLP width into equal whole parts per rank."""
    errors: list[str] = []
    if model.num_attention_heads % model.num_query_groups:
        errors.append(
            f"--num-attention-heads {model.num_attention_heads} is not divisible by "
            f"--num-query-groups {model.num_query_groups}; each KV head must serve whole query "
            "heads"
        )
    for name, value in (("num-attention-heads", model.num_attention_heads),
                        ("num-query-groups", model.num_query_groups),
                        ("ffn-hidden-size", model.ffn_hidden_size)):
        if value % tp:
            errors.append(
                f"--{name} {value} is not divisible by --tensor-model-parallel-size {tp}; "
                f"use a multiple of {tp} or a smaller tensor-parallel size"
            )
    return errors


def _sequence_length_errors(cfg: Config) -> list[str]:
    """Sequence parallelism splits the sequence evenly over TP, and RoPE's table ends at
    --max-position-embeddings."""
    model, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    errors: list[str] = []
    if cfg.parallel.sequence_parallel and model.seq_length % tp:
        errors.append(
            f"--sequence-parallel needs --seq-length ({model.seq_length}) divisible by "
            f"--tensor-model-parallel-size ({tp}); use --seq-length "
            f"{tp * math.ceil(model.seq_length / tp)}"
        )
    if model.seq_length > model.max_position_embeddings:
        errors.append(
            f"--seq-length {model.seq_length} exceeds --max-position-embeddings "
            f"{model.max_position_embeddings}; raise --max-position-embeddings or shorten sequences"
        )
    return errors


def _batch_errors(cfg: Config, world_size: int) -> list[str]:
    """The checks that need the data-parallel size (none when the grid does not tile, which
    `_grid_errors` reports): whole micro-batches per DP rank, the pipeline's micro-batch needs,
    the batch ramp-up and the LR schedule's sample counts."""
    replica, train = model_replica_size(cfg.parallel), cfg.train
    if world_size % replica:
        return []
    dp = world_size // replica
    gbs = train.global_batch_size or train.micro_batch_size * dp
    errors: list[str] = []
    if gbs % (train.micro_batch_size * dp):
        errors.append(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
            f"{train.micro_batch_size} x data-parallel size {dp} = "
            f"{train.micro_batch_size * dp}; use a multiple of {train.micro_batch_size * dp}"
        )
    errors += _pipeline_errors(cfg, num_microbatches(cfg, world_size))
    errors += _rampup_errors(cfg, dp)
    errors += lr_schedule_errors(cfg.optim, train, gbs)
    return errors


def _rotary_errors(model: ModelConfig) -> list[str]:
    """--rotary-percent must leave RoPE an even number of channels to pair (a head dim that is
    itself unusable is reported by `validate`)."""
    usable_head = model.kv_channels and model.kv_channels % 2 == 0
    if not usable_head or (model.rotary_dim > 0 and model.rotary_dim % 2 == 0):
        return []
    return [f"--rotary-percent {model.rotary_percent} of head dim {model.kv_channels} rotates "
            f"{model.rotary_dim} channels; RoPE pairs channels, so pick a percent that gives an "
            "even, positive count"]


def _padded_vocab_errors(model: ModelConfig, tp: int) -> list[str]:
    """--padded-vocab-size is the row count itself: it must hold the vocabulary and split
    evenly over TP."""
    rows = model.padded_vocab
    if rows is None:
        return []
    if rows < model.vocab_size:
        return [f"--padded-vocab-size {rows} is smaller than the vocabulary ({model.vocab_size} "
                "tokens, --vocab-size or the tokenizer's); raise it or drop it"]
    if rows % tp:
        return [f"--padded-vocab-size {rows} is not divisible by --tensor-model-parallel-size "
                f"{tp}; use a multiple of {tp} (or drop it: --make-vocab-size-divisible-by "
                "pads for the TP size)"]
    return []


def _context_parallel_errors(cfg: Config) -> list[str]:
    """CP splits each sequence into 2c equal chunks, and SP splits a rank's two chunks over TP."""
    parallel, seq = cfg.parallel, cfg.model.seq_length
    cp, tp = parallel.context_parallel_size, parallel.tensor_model_parallel_size
    errors = []
    if cp > 1 and seq % (2 * cp):
        errors.append(f"--context-parallel-size {cp} needs --seq-length ({seq}) divisible by "
                      f"2 x {cp} = {2 * cp} (each rank holds two of {2 * cp} equal chunks); use "
                      f"--seq-length {2 * cp * math.ceil(seq / (2 * cp))}")
    elif cp > 1 and parallel.sequence_parallel and tp > 1 and seq % (2 * cp * tp):
        unit = 2 * cp * tp
        errors.append(f"--sequence-parallel with --context-parallel-size {cp} needs --seq-length "
                      f"({seq}) divisible by 2 x {cp} x --tensor-model-parallel-size {tp} = "
                      f"{unit}; use --seq-length {unit * math.ceil(seq / unit)}")
    return errors


def _sharding_errors(parallel: ParallelConfig, compile_: bool) -> list[str]:
    pp = parallel.pipeline_model_parallel_size
    if parallel.shard_params and compile_:
        return ["--data-parallel-sharding-strategy optim_grads_params with --compile is not "
                "supported: ZeRO-3's hooks gather and free each layer's weights around its "
                "forward, which a compiled layer would trace into its graph; drop --compile "
                "or use optim_grads"]
    if parallel.shard_params and pp > 1:
        return ["--data-parallel-sharding-strategy optim_grads_params with "
                f"--pipeline-model-parallel-size {pp} is not supported: every stage would "
                "gather each layer's parameters again for every micro-batch (2 all-gathers "
                "per layer per micro-batch instead of per step); use optim_grads with "
                "pipeline parallelism"]
    return []


def _rampup_errors(cfg: Config, dp: int) -> list[str]:
    """Every batch of a ramp-up must split into whole micro-batches on every DP rank."""
    train, pp = cfg.train, cfg.parallel.pipeline_model_parallel_size
    interleaved = schedule_in_effect(cfg.parallel).microbatches_multiple_of_pp
    unit = train.micro_batch_size * dp
    if train.step_batch_size_schedule is not None:
        batches = [b for _, b in batch_schedule(train.step_batch_size_schedule, None)]
        if any(b % unit for b in batches):
            return [f"--step-batch-size-schedule batches {batches} must be multiples of "
                    f"--micro-batch-size x data-parallel size = {unit}"]
        odd = [b for b in batches if (b // unit) % pp]
        if interleaved and odd:
            return [f"--step-batch-size-schedule batch {odd[0]} gives {odd[0] // unit} "
                    "micro-batches per step; the interleaved schedule needs a multiple of "
                    f"--pipeline-model-parallel-size {pp}"]
        return []
    if not train.rampup_batch_size:
        return []
    start, increment, _ = train.rampup_batch_size
    if start % unit or increment % unit:
        return [f"--rampup-batch-size START {start} and INCREMENT {increment} must be multiples "
                f"of --micro-batch-size x data-parallel size = {unit}, so every batch of the "
                "ramp splits into whole micro-batches"]
    if interleaved and ((start // unit) % pp or (increment // unit) % pp):
        return [f"--rampup-batch-size START {start} INCREMENT {increment} give "
                f"{start // unit} + k x {increment // unit} micro-batches per step; the "
                "interleaved schedule needs multiples of --pipeline-model-parallel-size "
                f"{pp}"]
    return []


def dry_run_rank_list(cfg: Config, world_size: int) -> list[int]:
    """--dry-run-ranks as sorted global ranks (`all` = every rank; `classes` is resolved by
    parallel/rank_classes.py)."""
    ranks = cfg.train.dry_run_ranks
    if ranks == ["all"]:
        return list(range(world_size))
    return sorted({int(r) for r in ranks})


def _dry_run_errors(cfg: Config, world_size: int) -> list[str]:
    ranks = cfg.train.dry_run_ranks
    if not ranks:
        return []
    if not cfg.train.dry_run:
        return ["--dry-run-ranks needs --dry-run (it never trains); add --dry-run"]
    if ranks in (["all"], ["classes"]):
        return []
    bad = [r for r in ranks if not r.isdigit() or int(r) >= world_size]
    if bad:
        return [f"--dry-run-ranks {' '.join(bad)}: each must be a global rank in 0.."
                f"{world_size - 1} (--world-size {world_size}), or the single word `all` or "
                "`classes`"]
    return []


def pipeline_schedule(parallel: ParallelConfig) -> str:
    """The schedule in effect: --pipeline-schedule, else what --num-layers-per-virtual-
    pipeline-stage implies (interleaved with it, 1f1b without)."""
    return schedule_in_effect(parallel).name


def schedule_in_effect(parallel: ParallelConfig) -> schedules.Schedule:
    """The schedules.py row of `pipeline_schedule`."""
    return schedules.in_effect(parallel.pipeline_schedule,
                               parallel.num_layers_per_virtual_pipeline_stage)


def _schedule_errors(cfg: Config) -> list[str]:
    """What --pipeline-schedule needs of the other flags (the table's rules)."""
    p = cfg.parallel
    if p.pipeline_schedule is None:
        return []
    uneven = (p.decoder_first_pipeline_num_layers is not None
              or p.decoder_last_pipeline_num_layers is not None)
    return schedules.get(p.pipeline_schedule).flag_errors(
        p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage, uneven,
        cfg.model.num_layers, cfg.train.compile)


def _pipeline_errors(cfg: Config, microbatches: int) -> list[str]:
    """Layer split and micro-batch count rules (layout.py, which pipeline/partition.py and the
    planner use too), checked before any process group exists."""
    p = cfg.parallel
    pp, lpv = p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage
    return (layout.split_errors(cfg.model.num_layers, pp, lpv, p.decoder_first_pipeline_num_layers,
                                p.decoder_last_pipeline_num_layers)
            + layout.microbatch_errors(schedule_in_effect(p), pp, microbatches, lpv))


def stage_layer_counts(num_layers: int, pp: int, first: int | None = None,
                       last: int | None = None) -> list[int]:
    """Layers per stage (layout.py); raises ConfigError naming the flags when they cannot
    split."""
    errors = layout.split_errors(num_layers, pp, None, first, last)
    if errors:
        raise ConfigError(errors[0])
    return layout.stage_layer_counts(num_layers, pp, first, last)


# ---------------------------------------------------------------- numeric flag ranges

NUMERIC_RANGES: dict[str, dict[str, str]] = {
    "model": {
        "num_layers": ">=1", "hidden_size": ">=1", "ffn_hidden_size": ">=1",
        "num_attention_heads": ">=1", "num_query_groups": ">=1", "kv_channels": ">=1",
        "seq_length": ">=1", "max_position_embeddings": ">=1", "vocab_size": ">=1",
        "make_vocab_size_divisible_by": ">=1", "padded_vocab": ">=1",
        "init_method_std": ">=0", "norm_epsilon": ">0", "rotary_base": ">0",
        "rope_scaling_factor": ">0", "rotary_percent": ">0",
    },
    "parallel": {
        "tensor_model_parallel_size": ">=1", "pipeline_model_parallel_size": ">=1",
        "context_parallel_size": ">=1", "num_layers_per_virtual_pipeline_stage": ">=1",
        "decoder_first_pipeline_num_layers": ">=0", "decoder_last_pipeline_num_layers": ">=0",
        "ddp_bucket_size": ">=1", "distributed_timeout_minutes": ">0", "world_size": ">=1",
    },
    "train": {
        "micro_batch_size": ">=1", "global_batch_size": ">=1", "train_iters": ">=1",
        "train_samples": ">=1", "seed": ">=0", "eval_interval": ">=1", "eval_iters": ">=0",
        "manual_gc_interval": ">=0", "recompute_num_layers": ">=1",
        "dry_run_device_memory_gb": ">0",
        "fp8_margin": ">=0", "fp8_amax_history_len": ">=1",
        "num_layers_at_start_in_bf16": ">=0",
        "num_layers_at_end_in_bf16": ">=0",
    },
    "data": {"tiktoken_num_special_tokens": ">=0", "null_tokenizer_eod_id": ">=0",
             "num_workers": ">=0"},
    "logging": {
        "log_interval": ">=1", "peak_tflops": ">0", "tensorboard_log_interval": ">=1",
        "profile_step_start": ">=0", "profile_step_end": ">=1", "straggler_threshold": ">0",
        "straggler_intervals": ">=1",
    },
    "checkpoint": {
        "save_interval": ">=1", "save_interval_minutes": ">0", "save_keep_last": ">=1",
        "ckpt_staging_buffer_gb": ">0", "exit_interval": ">=1", "ckpt_step": ">=0",
    },
    "reliability": {
        "exit_duration_in_mins": ">0", "hang_timeout_seconds": ">0", "spike_threshold": ">0",
        "spike_patience": ">=1", "spike_accept_after": ">=0",
        "max_skipped_iterations_in_a_row": ">=0", "max_skipped_iterations": ">=0",
        "error_injection_rate": ">=0", "spike_skip_samples": ">=0", "spike_lr_iters": ">=0",
        "mtbf_hours": ">0",
    },
    "moe": {
        "num_experts": ">=1", "moe_ffn_hidden_size": ">=1", "moe_router_topk": ">=1",
        "moe_shared_expert_intermediate_size": ">=1", "moe_expert_capacity_factor": ">0",
        "moe_router_topk_scaling_factor": ">0", "moe_router_num_groups": ">=1",
        "moe_router_group_topk": ">=1", "moe_aux_loss_coeff": ">=0", "moe_z_loss_coeff": ">=0",
        "moe_router_bias_update_rate": ">=0", "expert_model_parallel_size": ">=1",
        "expert_tensor_parallel_size": ">=1",
    },
}
"""Section -> field -> the range every value given must lie in (None = not given is always
fine; floats must also be finite). The optimizer's hyperparameters (--lr, --adam-eps, ...)
have their own checks. tests/test_numeric_ranges.py fails on a numeric field missing here."""

_BOUNDS = {">=0": (0, True), ">=1": (1, True), ">0": (0, False)}


def _flag(section: str, name: str) -> str:
    """The command-line flag of a config field (its metadata's, else the dashed name)."""
    meta = next(f.metadata for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
    return meta.get("flag", f"--{_dash(name)}")


def numeric_range_errors(section: str, values: dict) -> list[str]:
    """One message per value of `section` (field -> given value) outside its range, checked
    before the dataclasses derive anything from them (a 0 there would divide by zero)."""
    errors = []
    for name, rule in NUMERIC_RANGES.get(section, {}).items():
        value = values.get(name)
        if value is None or isinstance(value, bool):
            continue
        low, inclusive = _BOUNDS[rule]
        if not ((value >= low if inclusive else value > low) and math.isfinite(value)):
            finite = "" if isinstance(value, int) else " and finite"
            errors.append(f"{_flag(section, name)} must be {rule[:-1]} {rule[-1]}{finite}, "
                          f"got {value}")
    return errors
