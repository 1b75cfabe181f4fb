"""Run configuration: dataclasses that are the single source of truth for every flag.

Each field has a type, a default and a one-line docstring under it; `arguments.py` turns them
into argparse flags (names follow Megatron-LM; `metadata={"flag": ...}` overrides the name).
Local invariants are checked in `__post_init__`; cross-field checks that need the world size
live in `validate()`, which runs before any process group or tensor is created.

Glossary: tp/pp/dp = tensor/pipeline/data parallel; "stage" = pp rank; "chunk" = virtual stage;
"axis" = a parallel axis, "dim" = a tensor dimension; batch sizes are in samples, tokens in tokens.
This module imports nothing from megatron_lite (stdlib only).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the flag(s) and the fix."""


@dataclass
class ModelConfig:
    """Shape of the Llama-style decoder."""

    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Model width h."""
    ffn_hidden_size: int | None = None
    """SwiGLU inner width; default 8h/3 rounded up to a multiple of 64 (Llama's sizing)."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; default = num_attention_heads (plain MHA)."""
    seq_length: int = 64
    """Training sequence length in tokens."""
    max_position_embeddings: int | None = None
    """Longest sequence the RoPE tables cover; default = seq_length."""
    vocab_size: int = 256
    """Tokenizer vocabulary size (before padding); taken from the tokenizer when one is given."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the tensor-parallel size."""
    init_method_std: float = 0.02
    """Std of the normal weight init; output projections use std / sqrt(2 * num_layers)."""
    untie_embeddings_and_output_weights: bool = False
    """Use a separate output layer instead of reusing the input embedding."""
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon."""
    rotary_base: float = 10000.0
    """RoPE base frequency theta."""
    triton_kernels: str = field(default="auto", metadata={"choices": ["auto", "on", "off"]})
    """Fused Triton kernels: auto = on with CUDA, off on CPU; on = also on CPU (interpreter)."""

    def __post_init__(self) -> None:
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 64 * math.ceil(8 * self.hidden_size / 3 / 64)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "vocab_size", "ffn_hidden_size", "num_query_groups"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{_dash(name)} must be positive, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp_size: int) -> int:
        """Vocab rounded up so each TP rank holds an equal, aligned slice."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return multiple * math.ceil(self.vocab_size / multiple)


@dataclass
class ParallelConfig:
    """How ranks are laid out: world = pp x dp x tp, tp innermost."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size t (ranks that split each layer's matrices)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size p (ranks that split the layer stack)."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per virtual chunk for the interleaved schedule; None = plain 1F1B."""
    decoder_first_pipeline_num_layers: int | None = None
    """Layers on the first pipeline stage when it should differ from the even split."""
    decoder_last_pipeline_num_layers: int | None = None
    """Layers on the last pipeline stage when it should differ from the even split."""
    sequence_parallel: bool = False
    """Split activations outside the TP regions along the sequence (needs t > 1 to matter)."""
    use_distributed_optimizer: bool = False
    """ZeRO-1: shard fp32 master weights and Adam state over data-parallel ranks."""
    overlap_grad_reduce: bool = False
    """Start each gradient bucket's reduction as soon as its gradients are ready."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the next forward."""
    ddp_bucket_size: int = 40_000_000
    """Gradient bucket size in elements."""
    grad_reduce_in_bf16: bool = False
    """Reduce gradients in bf16 instead of fp32 (halves DP traffic, loses precision)."""
    distributed_backend: str = field(
        default="auto", metadata={"choices": ["auto", "nccl", "gloo", "cuda:gloo"]})
    """Collective backend; auto = nccl with CUDA, gloo on CPU; cuda:gloo = gloo over CUDA
    tensors only (refuses host tensors like NCCL; lets several ranks share one GPU)."""
    distributed_timeout_minutes: float = 10.0
    """Timeout for every collective before the job fails instead of hanging."""
    world_size: int | None = None
    """With --dry-run: check the layout for this many ranks instead of the launched ones."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{_dash(name)} must be >= 1, got {getattr(self, name)}")


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    lr_warmup_iters: int = 0
    """Iterations of linear warm-up from 0 to --lr."""
    lr_decay_iters: int | None = None
    """Iterations over which the LR decays to --min-lr; default = --train-iters."""
    lr_decay_style: str = field(
        default="cosine", metadata={"choices": ["cosine", "linear", "constant", "wsd"]}
    )
    """Shape of the decay after warm-up."""
    lr_wsd_decay_iters: int | None = None
    """For --lr-decay-style wsd: length of the final decay phase (default 10% of decay iters)."""
    weight_decay: float = 0.01
    """Decoupled weight decay, applied to weights with >= 2 dims only (not norms)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm; 0 disables clipping."""


@dataclass
class TrainConfig:
    """Batch hierarchy, iterations, precision and evaluation."""

    micro_batch_size: int = 2
    """Samples per forward/backward on one rank."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all DP ranks; default = micro x dp (no accumulation)."""
    train_iters: int = 20
    """Optimizer steps to run."""
    seed: int = 1234
    """Seed for weights, data order and mock data."""
    bf16: bool = False
    """bf16 weights and activations with fp32 master weights and fp32 gradient reduction."""
    eval_interval: int = 1000
    """Evaluate on the validation split every this many iterations (and at the end)."""
    eval_iters: int = 10
    """Micro-batch rounds per evaluation."""
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
    dry_run: bool = False
    """Validate the config, print the rank grid, stage partition, parameters per rank and the
    memory estimate, and exit without creating process groups (see --world-size); with
    --dry-run-ranks, also run one real training step of those ranks on the meta device."""
    dry_run_ranks: list[str] = field(default_factory=list)
    """With --dry-run: global ranks (or `all`) whose real model, optimizer and training step
    run on the meta device under a fake process group of --world-size ranks: collectives
    checked and matched, memory measured against the planner."""

    def __post_init__(self) -> None:
        if self.recompute_granularity == "full":
            self.recompute_method = self.recompute_method or "uniform"
            self.recompute_num_layers = self.recompute_num_layers or 1
            if self.recompute_num_layers < 1:
                raise ConfigError("--recompute-num-layers must be >= 1, got "
                                  f"{self.recompute_num_layers}")
        elif self.recompute_method is not None or self.recompute_num_layers is not None:
            raise ConfigError(
                "--recompute-method/--recompute-num-layers apply only with "
                f"--recompute-granularity full (got {self.recompute_granularity}); add "
                "--recompute-granularity full or drop them")


@dataclass
class DataConfig:
    """Where samples come from."""

    mock_data: bool = False
    """Synthetic learnable token sequences, a deterministic function of --seed and sample index."""
    data_path: list[str] = field(default_factory=list)
    """Shard prefixes or manifests, optionally weighted: `0.7 pathA 0.3 pathB`."""
    split: str = "969,30,1"
    """Train,valid,test proportions of the documents."""
    tokenizer_model: str | None = None
    """sentencepiece .model file; sets the vocab size and EOD id."""
    data_sharding: str = field(default="global", metadata={"choices": ["global", "node-local"]})
    """global = shared storage, global shuffle; node-local = each DP rank reads its own shards."""
    num_workers: int = 1
    """Training steps of micro-batches a background thread prepares ahead (0 = none)."""
    data_cache_path: str | None = None
    """Directory for cached sample/shuffle indices (default: next to the data)."""
    eod_mask_loss: bool = False
    """Do not train on predicting the token after an end-of-document token."""
    verify_checksums: bool = False
    """Before training, compare every shard this rank reads with its manifest sha256 (reads all)."""


@dataclass
class LoggingConfig:
    """What is printed and recorded."""

    log_interval: int = 1
    """Print a log line every this many iterations."""
    log_rank_grid: bool = False
    """Print every group of the rank grid at start-up and in --dry-run (summarized beyond a
    screenful otherwise)."""
    log_jsonl: str | None = None
    """Write one JSON object per logged iteration and per evaluation to this file."""
    peak_tflops: float | None = None
    """Device peak TFLOP/s for MFU; default from the GPU name, or measured on CPU."""
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
    straggler_threshold: float = 0.10
    """Warn when a rank's forward-backward time is this fraction above the median rank's."""
    straggler_intervals: int = 3
    """Log intervals in a row a rank must stay that slow before the warning (one is noise)."""


@dataclass
class CheckpointConfig:
    """Saving, resuming and exiting (see megatron_lite/checkpoint)."""

    save: str | None = None
    """Directory for checkpoints (iter_XXXXXXX/ subdirectories and a `latest` pointer)."""
    load: str | None = None
    """Checkpoint directory to resume from; default --save (a restarted job resumes itself)."""
    save_interval: int | None = None
    """Save every this many iterations (and always at the end with --save)."""
    save_interval_minutes: float | None = None
    """Also save when this many wall-clock minutes have passed since the last save."""
    save_keep_last: int | None = None
    """Keep only the newest K checkpoints; older ones are deleted after a new one is complete."""
    async_save: bool = False
    """Write checkpoint files in a background thread while training continues."""
    exit_interval: int | None = None
    """Save and exit cleanly when the iteration is a multiple of this (splits a run into jobs)."""
    ckpt_step: int | None = None
    """Load this iteration instead of the one `latest` points to."""
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
        if self.async_save and not self.save:
            raise ConfigError("--async-save needs --save DIR")


@dataclass
class ReliabilityConfig:
    """Preemption, hangs, NaN/Inf and loss spikes (see megatron_lite/reliability)."""

    exit_duration_in_mins: float | None = None
    """Save and exit cleanly once this many minutes have passed since start (Slurm limits)."""
    hang_timeout_seconds: float | None = None
    """Dump every thread's stack and exit non-zero when one phase of an iteration (or a save)
    takes longer than this; set it above the slowest save. None = off."""
    check_for_nan_in_loss_and_grad: bool = True
    """Check the local loss and local gradients for NaN/Inf before any reduction."""
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
    p = cfg.parallel
    return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)


def num_microbatches(cfg: Config, world_size: int) -> int:
    """Gradient-accumulation steps = global batch / (micro batch x dp)."""
    dp = data_parallel_size(cfg, world_size)
    gbs = cfg.train.global_batch_size or cfg.train.micro_batch_size * dp
    return gbs // (cfg.train.micro_batch_size * dp)


def validate(cfg: Config, world_size: int) -> None:
    """Cross-field checks, run before anything is allocated. Raises ConfigError."""
    model, parallel, train = cfg.model, cfg.parallel, cfg.train
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    errors: list[str] = []
    if world_size % (tp * pp):
        errors.append(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp}; launch a multiple of {tp * pp} "
            "processes or change the parallel sizes"
        )
    if model.hidden_size % model.num_attention_heads:
        errors.append(
            f"--hidden-size {model.hidden_size} is not divisible by --num-attention-heads "
            f"{model.num_attention_heads}; pick heads that divide the width"
        )
    elif model.head_dim % 2:
        errors.append(f"head dim {model.head_dim} (= --hidden-size / --num-attention-heads) "
                      "must be even for rotary embeddings")
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
    if parallel.sequence_parallel and model.seq_length % tp:
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
    if not world_size % (tp * pp):
        dp = world_size // (tp * pp)
        gbs = train.global_batch_size or train.micro_batch_size * dp
        if gbs % (train.micro_batch_size * dp):
            errors.append(
                f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
                f"{train.micro_batch_size} x data-parallel size {dp} = "
                f"{train.micro_batch_size * dp}; use a multiple of {train.micro_batch_size * dp}"
            )
    if not world_size % (tp * pp):
        errors += _pipeline_errors(cfg, num_microbatches(cfg, world_size))
    errors += _dry_run_errors(cfg, world_size)
    if parallel.overlap_param_gather and not parallel.use_distributed_optimizer:
        errors.append("--overlap-param-gather overlaps the distributed optimizer's parameter "
                      "all-gather; add --use-distributed-optimizer or drop it")
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))


def dry_run_rank_list(cfg: Config, world_size: int) -> list[int]:
    """--dry-run-ranks as sorted global ranks (`all` = every rank)."""
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
    if ranks == ["all"]:
        return []
    bad = [r for r in ranks if not r.isdigit() or int(r) >= world_size]
    if bad:
        return [f"--dry-run-ranks {' '.join(bad)}: each must be a global rank in 0.."
                f"{world_size - 1} (--world-size {world_size}), or the single word `all`"]
    return []


def _pipeline_errors(cfg: Config, microbatches: int) -> list[str]:
    """Layer split and micro-batch count rules of pipeline/partition.py and pipeline/schedule.py.

    Kept here (stdlib only) so a bad run fails before any process group exists; the pipeline
    modules raise the same errors when used directly, and a test checks the two agree.
    """
    p, layers = cfg.parallel, cfg.model.num_layers
    pp, lpv = p.pipeline_model_parallel_size, p.num_layers_per_virtual_pipeline_stage
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    errors: list[str] = []
    if pp == 1:
        if lpv is not None or first is not None or last is not None:
            errors.append(
                "--num-layers-per-virtual-pipeline-stage / --decoder-first-pipeline-num-layers / "
                "--decoder-last-pipeline-num-layers need --pipeline-model-parallel-size > 1; "
                "drop them for a single stage"
            )
        return errors
    fixed = [n for n in (first, last) if n is not None]
    rest_stages, rest_layers = pp - len(fixed), layers - sum(fixed)
    counts = fixed + [rest_layers // rest_stages] * rest_stages if rest_stages else fixed
    if any(n < 1 for n in fixed):
        errors.append(f"--decoder-first/last-pipeline-num-layers must be >= 1, got {fixed}")
    elif rest_stages == 0 and rest_layers != 0:
        errors.append(
            f"--decoder-first-pipeline-num-layers {first} + --decoder-last-pipeline-num-layers "
            f"{last} must equal --num-layers {layers} with --pipeline-model-parallel-size {pp}"
        )
    elif rest_stages and (rest_layers < rest_stages or rest_layers % rest_stages):
        errors.append(
            f"{rest_layers} layers (--num-layers {layers} minus uneven first/last stages) cannot "
            f"be split evenly over {rest_stages} pipeline stages (--pipeline-model-parallel-size "
            f"{pp}); use a multiple of {rest_stages} or change the uneven stage sizes"
        )
    elif lpv is not None:
        if lpv < 1 or layers % (pp * lpv):
            errors.append(
                f"--num-layers {layers} must be divisible by --pipeline-model-parallel-size {pp} "
                f"x --num-layers-per-virtual-pipeline-stage {lpv} = {pp * max(lpv, 1)}"
            )
        elif any(n % (layers // (pp * lpv)) for n in counts):
            errors.append(
                f"stage layer counts {counts} must each divide into the {layers // (pp * lpv)} "
                "virtual chunks per stage (--num-layers / (--pipeline-model-parallel-size x "
                "--num-layers-per-virtual-pipeline-stage)); adjust the uneven stage sizes"
            )
    if microbatches < pp:
        errors.append(
            f"{microbatches} micro-batches per step (--global-batch-size / (--micro-batch-size x "
            f"data-parallel size)) is fewer than --pipeline-model-parallel-size {pp}; the "
            f"pipeline would idle most of the step, raise --global-batch-size"
        )
    elif lpv is not None and microbatches % pp:
        errors.append(
            f"the interleaved schedule (--num-layers-per-virtual-pipeline-stage {lpv}) needs the "
            f"{microbatches} micro-batches per step to be a multiple of "
            f"--pipeline-model-parallel-size {pp}; adjust --global-batch-size"
        )
    return errors
