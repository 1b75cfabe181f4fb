"""`pretrain.py --dry-run`: a layout checked before any GPU is rented.

Without --dry-run-ranks: the planner's view (rank grid, partition, bytes per stage), no
tensors. With --dry-run-ranks R...: for each listed rank, in this one process, that rank's real
objects are built on the meta device under a fake process group of --world-size ranks (model
chunks, gradient buffers, optimizer with its ZeRO-1 shards, mock batches of the real shapes)
and one whole iteration of the real training loop runs through them, with the user's flags:
start-up report and epoch plan, the step (schedule, engine, gradient finalization, clipping,
optimizer step, parameter gather) with the guard's checks and decision, the log line's
reductions, an evaluation, a checkpoint save into a scratch directory (meta writes nothing).
The same code as a real run; meta tensors carry shapes and no values, so a 70B rank costs
seconds and no memory. Each record's `phases` says which of those parts ran.

Before any rank, the run's summary (`Summary`: iterations, accumulation steps, tokens per step,
the planner's largest rank against the device's memory) and a check of the data flags that reads
no shard (`data_problems`: each path and tokenizer file exists, --split and the blends parse)
and of the paths the run writes, without writing them (`output_problems`: --save, --log-jsonl,
TensorBoard and wandb directories writable or creatable); a problem there ends the dry run
with every one listed. The checkpoint flags (--async-save included) take part in the rank's
iteration: its save is assembled on meta into a scratch directory.

What it shows per rank: the bytes of the real allocations (parameters, gradients, optimizer
state, peak activations of the step) beside the planner's, every collective and p2p op
(refused when a tensor is not on the run's device, as NCCL would), and, with
`--dry-run-ranks all`, whether the ranks' ops match (`parallel/audit.match`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from megatron_lite.checkpoint import Checkpointer
from megatron_lite.config import (
    Config,
    ConfigError,
    ModelConfig,
    dry_run_rank_list,
    global_batch_at,
    num_microbatches,
    parse_blend,
    parse_split,
    schedule_in_effect,
    validate,
)
from megatron_lite.data.builder import build_loaders
from megatron_lite.data.format import (
    MANIFEST_SUFFIX,
    REGENERATE_HINT,
    ShardError,
    find_manifest,
    load_manifest,
)
from megatron_lite.data.loader import MicroBatchLoader
from megatron_lite.data.mock import MockDataset
from megatron_lite.distill import build_distiller, check_distillation, dry_run_note
from megatron_lite.kernels import resolve_use_triton
from megatron_lite.memory import LiveBytes, dry_run_report, fmt_bytes
from megatron_lite.metrics import MetricsLogger
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.audit import CommAudit, CommOp, match
from megatron_lite.parallel.host_syncs import MOE_SYNC_KIND, HostSyncCounter
from megatron_lite.parallel.rank_classes import full_world, representatives
from megatron_lite.parallel.state import ParallelState
from megatron_lite.planner import (
    DEFAULT_DEVICE,
    GIB,
    Cluster,
    Layout,
    RunOptions,
    _recompute_from,
    estimate_memory,
    evaluate,
)
from megatron_lite.profiling import StepHooks
from megatron_lite.reliability import Guard
from megatron_lite.training import (
    StartupTimes,
    StepRunner,
    Trainer,
    build_model,
    data_coordinator,
    log_memory,
    log_startup,
    plan_epochs,
    train_loop,
    train_step,
)

SUMMARY_KEYS = ("iters", "grad_acc", "tokens_per_step", "mem_gib", "device_gib", "fits",
                "data_errors")
"""The run's summary fields (`Summary`), in order, in each `--log-jsonl` record."""

RANK_KEYS = ("rank", "pp_rank", "tp_rank", "dp_rank", "params_bytes", "grads_bytes",
             "optimizer_bytes", "activation_bytes", "planner_params_bytes",
             "planner_grads_bytes", "planner_optimizer_bytes", "planner_activation_bytes",
             "collectives", "p2p_ops", "comm_bytes", "group_creations", "phases",
             "host_syncs_per_step", "moe_syncs_per_layer", "host_step_s")
"""A dry-run rank's own fields of its `--log-jsonl` record, in order."""

JSONL_KEYS = RANK_KEYS + SUMMARY_KEYS
"""The fields of one `--log-jsonl` record per dry-run rank, in order: the rank's, then the
run's summary (without --dry-run-ranks, or when the data check fails, the file holds one
record of `SUMMARY_KEYS` alone)."""


@dataclass
class Summary:
    """What the whole run will do and need, from the flags alone (no tensor, no shard read)."""

    iters: int
    """Optimizer steps: --train-iters, or derived from --train-samples (and the ramp-up)."""
    grad_acc: int
    """Gradient-accumulation steps: micro-batches per step per DP rank, at the full global
    batch."""
    grad_acc_start: int
    """The same at the first step (differs under --rampup-batch-size or
    --step-batch-size-schedule, whose largest batch `grad_acc` counts)."""
    tokens_per_step: int
    """Global batch x sequence length, at the full global batch."""
    mem_gib: float
    """The planner's bytes of the largest rank (its stage's states and peak activations) plus
    its allowance (CUDA context, NCCL buffers, fragmentation), in GiB."""
    device_gib: float
    """Memory of one device: --dry-run-device-memory-gb, or the planner's device."""
    device: str
    fits: bool
    data_errors: list[str]
    """`data_problems` and `output_problems`: what a run would refuse in the data flags, or
    fail to write (checkpoint and logging paths)."""
    iters_source: str = "--train-iters"
    stage: int = 0

    def record(self) -> dict:
        return {k: getattr(self, k) for k in SUMMARY_KEYS}


def summarize(cfg: Config, world_size: int, teacher: ModelConfig | None = None) -> Summary:
    """The run's iterations, batch, tokens and memory (with a distillation `teacher`'s)
    against the device; the data and output-path checks."""
    t = cfg.train
    mbs_per_step = num_microbatches(cfg, world_size)
    varies = t.rampup_batch_size or t.step_batch_size_schedule is not None
    first = global_batch_at(t, 0, cfg.model.seq_length) if varies else None
    per_micro = t.micro_batch_size * (world_size // _replica(cfg))
    est = estimate_memory(cfg, world_size, teacher=teacher)
    cluster = Cluster(gpus=world_size)
    given = t.dry_run_device_memory_gb
    device_gib = given or cluster.gpu_memory_gib
    need = est.total_bytes / GIB + cluster.allowance_gib
    gbs = mbs_per_step * per_micro
    return Summary(
        t.train_iters, mbs_per_step, first // per_micro if first else mbs_per_step,
        gbs * cfg.model.seq_length, round(need, 2), device_gib,
        "--dry-run-device-memory-gb" if given else DEFAULT_DEVICE, need <= device_gib,
        data_problems(cfg) + output_problems(cfg),
        f"from --train-samples {t.train_samples:,}" if t.train_samples is not None
        else "--train-iters", est.stage)


def _replica(cfg: Config) -> int:
    p = cfg.parallel
    return (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
            * p.context_parallel_size)


def format_summary(s: Summary) -> str:
    """The summary as the dry run prints it (field names as in `SUMMARY_KEYS`)."""
    acc = (f"{s.grad_acc_start} -> {s.grad_acc} (batch ramp)"
           if s.grad_acc_start != s.grad_acc else f"{s.grad_acc}")
    spare = s.device_gib - s.mem_gib
    verdict = (f"fits, {spare:.2f} GiB spare" if s.fits
               else f"DOES NOT FIT by {-spare:.2f} GiB")
    data = (f"{len(s.data_errors)} problem(s) in the data flags" if s.data_errors
            else "data flags ok (paths and split checked, no shard read)")
    return (f"dry run: iters {s.iters:,} ({s.iters_source}) | grad_acc {acc} micro-batches "
            f"per step per DP rank | tokens_per_step {s.tokens_per_step:,}\n"
            f"dry run: mem_gib {s.mem_gib:.2f} (planner, stage {s.stage}, with allowance) of "
            f"device_gib {s.device_gib:g} ({s.device}): {verdict} | {data}")


TOKENIZER_FILE_FLAGS = ("tokenizer_model", "vocab_file", "merge_file")
"""Config fields naming a tokenizer file the run opens (those the config has)."""


def _tokenizer_files(cfg: Config) -> list[tuple[str, str]]:
    """(flag, path) of every tokenizer file given, wherever config.py keeps its field."""
    found = []
    for section in dataclasses.fields(cfg):
        for name in TOKENIZER_FILE_FLAGS:
            value = getattr(getattr(cfg, section.name), name, None)
            if value:
                found.append(("--" + name.replace("_", "-"), value))
    return found


def _split_problem(split: str) -> str | None:
    """--split as the data module parses it (the one call that checks it here)."""
    try:
        parse_split(split)
    except ValueError as err:
        return str(err)
    return None


def _path_problems(flag: str, path: str, node_local: bool) -> list[str]:
    """One blend entry: its manifest (and, unless node-local, the shards it lists), or its
    .bin/.idx pair, as `format.resolve_prefixes` resolves it; existence only."""
    manifest_path = find_manifest(path)
    if manifest_path is None:
        missing = [path + ext for ext in (".bin", ".idx") if not Path(path + ext).is_file()]
        if len(missing) == 2:
            return [f"{flag} {path}: neither {path}{MANIFEST_SUFFIX} nor {path}.bin/.idx "
                    "exists; give the prefix (without .bin/.idx) or its manifest, or "
                    f"{REGENERATE_HINT}"]
        return [f"{flag} {path}: {missing[0]} is missing beside its pair; {REGENERATE_HINT}"
                ] if missing else []
    try:
        manifest = load_manifest(manifest_path)
    except ShardError as err:
        return [f"{flag} {path}: {err}"]
    if node_local:  # the shards are on each node's local disk, not here
        return []
    missing = [p + ext for p in (manifest.shard_prefix(i) for i in range(len(manifest.shards)))
               for ext in (".bin", ".idx") if not Path(p + ext).is_file()]
    if not missing:
        return []
    more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
    return [f"{flag} {path}: {len(missing)} shard file(s) listed in {manifest_path} are "
            f"missing: {', '.join(missing[:3])}{more}; {manifest.hint()}"]


def data_problems(cfg: Config) -> list[str]:
    """What a real run would refuse in the data flags, found without reading any shard:
    tokenizer files that do not exist, blends that do not parse, prefixes without their
    .bin/.idx or manifest (and the shard files a manifest lists), a --split that does not
    parse. With --mock-data the paths are not read, so only the tokenizer files count; with
    no data flag at all the dry run has nothing to check (it runs mock batches)."""
    d = cfg.data
    problems = [f"{flag} {path}: no such file or directory; pass the tokenizer's file"
                for flag, path in _tokenizer_files(cfg) if not Path(path).exists()]
    if d.mock_data:
        return problems
    for flag, blend in (("--data-path", d.data_path), ("--train-data-path", d.train_data_path),
                        ("--valid-data-path", d.valid_data_path),
                        ("--test-data-path", d.test_data_path)):
        if not blend:
            continue
        try:
            pairs = parse_blend(blend)
        except ValueError as err:
            problems.append(str(err))
            continue
        for _, path in pairs:
            problems += _path_problems(flag, path, d.data_sharding == "node-local")
    split = _split_problem(d.split) if d.data_path else None
    return problems + ([split] if split else [])


OUTPUT_DIR_FLAGS = (("--save", "checkpoint", "save"), ("--tensorboard-dir", "logging",
                    "tensorboard_dir"), ("--wandb-save-dir", "logging", "wandb_save_dir"))
"""(flag, config section, field) of the directories a run writes into."""


def _unwritable(flag: str, path: Path, what: str) -> str | None:
    """Why a run could not create or write `path` (a directory), or None: the path, or the
    nearest of its parents that exists, must be a directory this user can write."""
    if path.exists():
        if not path.is_dir():
            return f"{flag} {what}: {path} exists and is not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else (
            f"{flag} {what}: {path} is not writable by this user")
    parent = next(p for p in path.parents if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return (f"{flag} {what}: cannot create {path}: {parent} is not a writable directory; "
                "point the flag (or RUN_DIR / CKPT_DIR of the launch script) elsewhere")
    return None


def output_problems(cfg: Config) -> list[str]:
    """What a real run would fail to write, found without writing: the --save directory, the
    --log-jsonl file's directory, the TensorBoard and wandb directories must exist as writable
    directories or be creatable (the dry run saves into a scratch directory and writes its own
    records to --log-jsonl, so these are the run's paths, checked)."""
    problems = []
    for flag, section, name in OUTPUT_DIR_FLAGS:
        value = getattr(getattr(cfg, section), name)
        if value:
            problems.append(_unwritable(flag, Path(value), "directory"))
    if cfg.logging.log_jsonl:
        jsonl = Path(cfg.logging.log_jsonl)
        if jsonl.is_dir():
            problems.append(f"--log-jsonl {jsonl}: is a directory; give a file path")
        else:
            problems.append(_unwritable("--log-jsonl", jsonl.parent, f"{jsonl.name}'s directory"))
    return [p for p in problems if p]


def _write_jsonl(cfg: Config, records: list[dict]) -> None:
    if cfg.logging.log_jsonl:
        Path(cfg.logging.log_jsonl).parent.mkdir(parents=True, exist_ok=True)
        with open(cfg.logging.log_jsonl, "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")


@dataclass
class RankResult:
    """What one rank's dry run measured (bytes) and predicted (planner_*)."""

    rank: int
    pp_rank: int
    tp_rank: int
    dp_rank: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    planner_params_bytes: int
    planner_grads_bytes: int
    planner_optimizer_bytes: int
    planner_activation_bytes: int
    collectives: int
    p2p_ops: int
    comm_bytes: int
    save_growth_bytes: int
    """Device bytes allocated while the checkpoint state is assembled (should be 0)."""
    seconds: float
    ops: list[CommOp]
    group_creations: int = 0
    """Process-group creations this rank took part in at start-up (parallel/state.py)."""
    nccl_group_creations: int = 0
    """The same under NCCL with a bound device, where each is a world-wide split per kind."""
    phases: list[str] = field(default_factory=list)
    """The parts of the iteration that ran (`PHASES`): what this dry run proved."""
    host_syncs_per_step: int = 0
    """Device->host syncs of the training step (`host_syncs.HostSyncCounter`)."""
    host_step_s: float = 0.0
    """Host seconds of a second step with every recording mode off: the Python floor."""
    host_syncs_by_kind: dict[str, int] = dataclasses.field(default_factory=dict)
    phase_ops: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """Phase -> the (first, end) slice of `ops` it issued."""
    moe_syncs_per_layer: float = 0.0
    """MoE dispatch syncs of the step per MoE layer of this rank per micro-batch (moe.py:
    one read of the counts; recomputed forwards read again)."""

    def record(self) -> dict:
        return {k: getattr(self, k) for k in RANK_KEYS}


PHASES = ("startup", "epoch_plan", "train_step", "guard", "log", "eval", "checkpoint",
          "documents")
"""What a rank's dry run can prove ran, in the order it runs them; a record's `phases` lists
those that did (`documents`: the step's batches carried document ids and/or positions)."""

EOD_EVERY = 5
"""Mock samples in a dry run with documents end one at about every 1/EOD_EVERY of the
sequence (at shifting places, so documents cross micro-batch and CP-chunk boundaries)."""


def _mock_config(cfg: Config) -> Config:
    """The run's config reading mock batches on the calling thread (a dry run reads no data;
    document ids come from `_with_documents`, the builder refuses mock data with them)."""
    return dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, mock_data=True, num_workers=0, reset_position_ids=False,
        reset_attention_mask=False))


def _iteration_config(cfg: Config, save_dir: str) -> Config:
    """The user's config for one dry-run iteration: every flag as given, except what would
    touch the outside world (JSONL, wandb, TensorBoard, profiler, checkpoints go to
    `save_dir`, a scratch directory; nothing is loaded) and the loop's length (one iteration,
    which logs, evaluates (at most one batch) and saves, as the last iteration of a run does).
    """
    run = copy.copy(cfg)
    run.data = _mock_config(cfg).data
    run.train = copy.copy(cfg.train)  # no replace: --train-samples would be re-derived
    run.train.train_iters = 1
    run.train.eval_iters = min(cfg.train.eval_iters, 1)
    run.train.manual_gc = False  # gc.disable() would outlive the dry run in this process
    run.logging = dataclasses.replace(cfg.logging, log_jsonl=None, wandb_project=None,
                                      tensorboard_dir=None, profile=False)
    run.checkpoint = dataclasses.replace(cfg.checkpoint, save=save_dir, load=None)
    return run


class _DocumentsMock:
    """A mock dataset whose samples hold end-of-document tokens at synthetic places, so that
    --reset-attention-mask / --reset-position-ids run the document path on meta."""

    def __init__(self, base: MockDataset, eod_id: int) -> None:
        self.base, self.eod_id = base, eod_id

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> np.ndarray:
        sample = self.base[index].copy()
        step = max(2, len(sample) // EOD_EVERY)
        sample[index % step::step] = self.eod_id
        return sample


def _with_documents(cfg: Config, loader: MicroBatchLoader | None) -> None:
    """Give a mock loader the user's document flags and samples with EOD tokens."""
    d = cfg.data
    if loader is None or not (d.reset_attention_mask or d.reset_position_ids):
        return
    eod = cfg.model.vocab_size - 1
    loader.dataset = loader.streams[0] = _DocumentsMock(loader.dataset, eod)
    loader.eod_id = eod
    loader.layout = dataclasses.replace(loader.layout, reset_position_ids=d.reset_position_ids,
                                        reset_attention_mask=d.reset_attention_mask)


class _Phases:
    """Told by the loop as each part ends: which ran, and each one's peak device bytes beyond
    what was live when it began."""

    def __init__(self, live: LiveBytes, audit: CommAudit) -> None:
        self.live, self.audit, self.ran, self.peaks = live, audit, [], {}
        self._start = live.reset_peak()
        self._first_op = len(audit.ops)
        self.ops: dict[str, tuple[int, int]] = {}
        """Phase -> (first, end) index into the audit's ops of its first run."""
        self.syncs: HostSyncCounter | None = None
        self._syncs_before: Counter[str] = Counter()
        self.step_syncs: Counter[str] = Counter()
        """Device->host syncs by kind of the (first) training step alone."""

    def __call__(self, name: str) -> None:
        if self.syncs is not None:
            now = Counter(self.syncs.by_kind)
            if name == "train_step" and "train_step" not in self.ran:
                self.step_syncs = now - self._syncs_before
            self._syncs_before = now
        self.peaks[name] = max(self.peaks.get(name, 0), self.live.peak - self._start)
        self.ops.setdefault(name, (self._first_op, len(self.audit.ops)))
        self._first_op = len(self.audit.ops)
        if name not in self.ran:
            self.ran.append(name)
        self._start = self.live.reset_peak()


class _MeasuredCheckpointer(Checkpointer):
    """The real checkpointer, measuring the device bytes its state assembly allocates."""

    live: LiveBytes
    growth = 0

    def snapshot(self, copy: bool | None = None) -> list[tuple[str, dict[str, Tensor], dict]]:
        outer = self.live.peak
        start = self.live.reset_peak()
        items = super().snapshot(copy)
        self.growth = max(self.growth, self.live.peak - start)
        self.live.peak = max(outer, self.live.peak)
        return items


@dataclass
class _Iteration:
    """The pieces of one rank's training loop that `run_rank` reads back after it ran."""

    trainer: Trainer
    runner: StepRunner
    optimizer: Optimizer
    loader: MicroBatchLoader
    phases: _Phases
    checkpointer: _MeasuredCheckpointer
    state_bytes: tuple[int, int, int]
    """Parameter, gradient and optimizer-state device bytes, measured before any step."""


def run_rank(cfg: Config, world_size: int, rank: int, *, time_host: bool = True
             ) -> RankResult:
    """Build rank `rank` of a `world_size` job on meta and run one whole iteration of the
    training loop: start-up report and epoch plan, the step with the guard's checks and
    decision, the log line's reductions, an evaluation, a checkpoint save (into a scratch
    directory; meta tensors write nothing)."""
    start = time.perf_counter()
    validate(cfg, world_size)
    pstate = parallel_state.initialize_fake(cfg, world_size, rank)
    try:
        # every op's group is checked against this rank's group of the kind its call site names
        audit = CommAudit(pstate.device, pstate.ranks_by_kind())
        live = LiveBytes(pstate.device)
        # Syncs are counted (comms.host_scalar's reads, the ones a meta run skips); any other
        # read-back of a meta tensor fails and the audit names its line.
        with tempfile.TemporaryDirectory(prefix="dry-run-save-") as scratch, \
                HostSyncCounter(stand_in=False) as syncs, audit, live, ExitStack() as cleanup:
            run = _iteration_config(cfg, scratch)
            it = _build_iteration(cfg, run, pstate, live, audit, cleanup)
            it.phases.syncs = syncs
            train_loop(it.trainer)
            # a second step, with the recording modes off (skipped by callers that only
            # read memory or collectives: 40% of a 70B rank's dry run)
            host_step_s = (_host_step_seconds(it.runner, it.optimizer, it.loader, pstate, run)
                           if time_host else math.nan)
            layout = it.loader.layout
            if "train_step" in it.phases.ran and (layout.reset_attention_mask
                                                  or layout.reset_position_ids):
                it.phases.ran.append("documents")
        return _rank_result(cfg, world_size, pstate, it, audit, host_step_s, start)
    finally:
        parallel_state.destroy(pstate)


def _build_iteration(cfg: Config, run: Config, pstate: ParallelState, live: LiveBytes,
                     audit: CommAudit, cleanup: ExitStack) -> _Iteration:
    """Assemble the training loop as pretrain.py does, with the dry run's measuring doubles
    (checkpointer, phase clock) in place, and run its start-up part: the start-up report and
    the epoch plan are phases the dry run proves ran. `cfg` is the user's config (reports,
    document flags), `run` the one-iteration copy the loop runs on."""
    chunks = build_model(run, pstate)
    optimizer = Optimizer(run, chunks, pstate)
    cleanup.callback(optimizer.close)
    state_bytes = (live.bytes_of(optimizer.param_tensors()),
                   live.bytes_of(optimizer.grad_tensors()),
                   live.bytes_of([t for s in optimizer.shards
                                  for t in (s.master, s.exp_avg, s.exp_avg_sq)]))
    phases = _Phases(live, audit)
    loaders = build_loaders(run, pstate.dp_rank, pstate.dp_size,
                            coordinator=data_coordinator(run, pstate), cp_rank=pstate.cp_rank)
    for loader in (loaders.train, loaders.valid):
        _with_documents(cfg, loader)
    guard = Guard(run, pstate)
    checkpointer = _MeasuredCheckpointer(run, pstate, chunks, optimizer, loaders.train,
                                         extra_state={"reliability": guard})
    checkpointer.live = live
    peak = (cfg.logging.peak_tflops or math.nan, "dry run: no device to measure")
    log_startup(cfg, pstate, chunks, peak, "dry run")
    log_memory(cfg, pstate, chunks, optimizer)
    logger = MetricsLogger(run, pstate, peak_tflops=peak[0])
    cleanup.callback(logger.close)
    phases("startup")
    logger.samples_per_epoch = plan_epochs(cfg, pstate, loaders.train)
    phases("epoch_plan")
    checkpointer.on_save = logger.log_checkpoint
    guard.on_event = logger.log_event
    guard.attach(optimizer, checkpointer, loaders.train)
    runner = StepRunner(run, pstate, chunks, on_grads_ready=optimizer.start_grad_sync,
                        distiller=build_distiller(run, pstate, chunks))
    trainer = Trainer(run, pstate, runner, optimizer, loaders.train, loaders.valid,
                      logger, checkpointer, guard, StepHooks(run, pstate.rank, pstate.device),
                      StartupTimes(), on_phase=phases)
    return _Iteration(trainer, runner, optimizer, loaders.train, phases, checkpointer,
                      state_bytes)


def _rank_result(cfg: Config, world_size: int, pstate: ParallelState, it: _Iteration,
                 audit: CommAudit, host_step_s: float, start: float) -> RankResult:
    """The measured numbers of one rank's iteration next to the planner's for its stage."""
    est = estimate_memory(cfg, world_size, stage=pstate.pp_rank,
                          fused_kernels=resolve_use_triton(cfg.model.triton_kernels,
                                                           pstate.device))
    p2p = [op for op in audit.ops if op.op in ("send", "recv")]
    phases = it.phases
    return RankResult(
        pstate.rank, pstate.pp_rank, pstate.tp_rank, pstate.dp_rank, *it.state_bytes,
        phases.peaks.get("train_step", 0), est.param_bytes, est.grad_bytes,
        est.optimizer_bytes, int(est.activation_bytes), len(audit.ops) - len(p2p),
        len(p2p), sum(op.nbytes for op in audit.ops), it.checkpointer.growth,
        time.perf_counter() - start, audit.ops, pstate.group_creations,
        parallel_state.planned_creations(_group_lists(cfg, world_size), pstate.rank,
                                         world_size, split=True), phases.ran,
        phases.step_syncs.total(), host_step_s, dict(phases.step_syncs), phases.ops,
        _moe_syncs_per_layer(cfg, world_size, it.runner, phases.step_syncs))


def _moe_syncs_per_layer(cfg: Config, world_size: int, runner: StepRunner,
                         step_syncs: Counter[str]) -> float:
    """The step's MoE dispatch reads over (this rank's MoE layers x micro-batches); a MoE
    layer is a module with a router (`mlp.router`)."""
    layers = sum(name.endswith("mlp.router") for chunk in runner.chunks
                 for name, _ in chunk.named_modules())
    if not layers:
        return 0.0
    return step_syncs[MOE_SYNC_KIND] / (layers * num_microbatches(cfg, world_size))


def _host_step_seconds(runner: StepRunner, optimizer: Optimizer, loader, pstate,
                       cfg: Config) -> float:
    """One more training step with the recording modes off: what the host alone takes to
    issue a step (on meta no kernel runs, so this is the Python floor of a GPU step). Only
    a sync counter stays on: it is what lets a host read of a meta tensor return at all."""
    with _disable_current_modes(), HostSyncCounter():
        start = time.perf_counter()
        train_step(runner, optimizer, loader, pstate, cfg.optim.lr)
        return time.perf_counter() - start


def planner_step_s(cfg: Config, world_size: int) -> float | None:
    """The planner's step time for this layout (default cluster), None when it has none."""
    p, t = cfg.parallel, cfg.train
    tp, pp, cp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                  p.context_parallel_size)
    dp = world_size // (tp * pp * cp)
    try:
        chunks = (cfg.model.num_layers // pp // p.num_layers_per_virtual_pipeline_stage
                  if p.num_layers_per_virtual_pipeline_stage else 1)
        schedule = p.pipeline_schedule if schedule_in_effect(p).split_backward else None
        layout = Layout(tp, pp, dp, chunks, t.micro_batch_size,
                        p.data_parallel_sharding_strategy, _recompute_from(cfg),
                        p.sequence_parallel, schedule, cp, cfg.moe.expert_model_parallel_size)
        gbs = t.global_batch_size or t.micro_batch_size * dp
        moe = RunOptions(moe=cfg.moe) if cfg.moe.num_experts else RunOptions()
        return evaluate(cfg.model, layout, Cluster(gpus=world_size), gbs, 1.0, moe).step_s
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None


def host_syncs_line(r: RankResult, planner_s: float | None) -> str:
    """Syncs per step (by kind) and the host's floor beside the planner's step time."""
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(r.host_syncs_by_kind.items())) or "none"
    planned = f"{planner_s:.3g} s" if planner_s is not None else "-"
    moe = f", {r.moe_syncs_per_layer:.3g} per MoE layer per micro-batch" \
        if r.moe_syncs_per_layer else ""
    return (f"dry run: rank {r.rank} step: {r.host_syncs_per_step} device->host syncs "
            f"({kinds}){moe}; "
            f"host {r.host_step_s:.3g} s per step with recording off, planner step {planned}")


def comm_by_kind(ops: list[CommOp]) -> dict[tuple[str, str], tuple[int, int]]:
    """(what the call site meant, or the op without an identity; dtype) -> (ops, bytes): where
    the `comm` column's bytes go (e.g. --fp8-param-gather's uint8 gathers)."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for op in ops:
        key = (op.identity[0] if op.identity is not None else op.op, op.dtype)
        count, nbytes = out.get(key, (0, 0))
        out[key] = (count + 1, nbytes + op.nbytes)
    return out


def comm_line(r: RankResult) -> str:
    """This rank's communication by kind, largest first."""
    kinds = sorted(comm_by_kind(r.ops).items(), key=lambda kv: -kv[1][1])
    parts = [f"{kind} {dtype} {fmt_bytes(nbytes)} x {count}"
             for (kind, dtype), (count, nbytes) in kinds]
    return f"dry run: rank {r.rank} comm by kind: {', '.join(parts) or 'none'}"


def _group_lists(cfg: Config, world_size: int) -> dict[str, list[list[int]]]:
    """The groups `initialize` builds for this layout."""
    p = cfg.parallel
    return parallel_state.group_lists(parallel_state.rank_grid(
        world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
        p.context_parallel_size), *parallel_state.expert_sizes(cfg))


def group_creations_line(r: RankResult) -> str:
    """What start-up costs this rank in group creations, on the fake backend and on NCCL."""
    return (f"dry run: rank {r.rank} took part in {r.group_creations} process-group creations "
            f"at start-up ({r.nccl_group_creations} world splits under NCCL with device_id, "
            "one per group kind)")


def _ratio(measured: int, planned: int) -> str:
    return f"{measured / planned:.3f}" if planned else "-"


def format_table(results: list[RankResult]) -> str:
    """Per rank: measured bytes, the planner's, and their ratio; communication; timing."""
    head = (f"{'rank':>6} {'pp':>3} {'tp':>3} {'dp':>4} | {'params':>10} {'grads':>10} "
            f"{'optimizer':>10} {'activations':>11} | {'colls':>6} {'p2p':>5} {'comm':>10} | "
            f"{'save +':>7} {'s':>5}")
    lines = ["dry run on the meta device: bytes of the real allocations, the planner's, ratio",
             head, "-" * len(head)]
    for r in results:
        measured = (r.params_bytes, r.grads_bytes, r.optimizer_bytes, r.activation_bytes)
        planned = (r.planner_params_bytes, r.planner_grads_bytes, r.planner_optimizer_bytes,
                   r.planner_activation_bytes)
        cells = [fmt_bytes(n) for n in measured]
        lines.append(
            f"{r.rank:>6} {r.pp_rank:>3} {r.tp_rank:>3} {r.dp_rank:>4} | {cells[0]:>10} "
            f"{cells[1]:>10} {cells[2]:>10} {cells[3]:>11} | {r.collectives:>6} {r.p2p_ops:>5} "
            f"{fmt_bytes(r.comm_bytes):>10} | {fmt_bytes(r.save_growth_bytes):>7} "
            f"{r.seconds:>5.1f}")
        cells = [fmt_bytes(n) for n in planned]
        lines.append(f"{'planner':>19} | {cells[0]:>10} {cells[1]:>10} {cells[2]:>10} "
                     f"{cells[3]:>11} |")
        cells = [_ratio(a, b) for a, b in zip(measured, planned)]
        lines.append(f"{'ratio':>19} | {cells[0]:>10} {cells[1]:>10} {cells[2]:>10} "
                     f"{cells[3]:>11} |")
    lines.append("activations = peak bytes allocated during the training step beyond the states; "
                 "comm = bytes handed to collectives and p2p; save + = device bytes allocated "
                 "while the checkpoint state is assembled")
    return "\n".join(lines)


def dry_run(cfg: Config, world_size: int) -> int:
    """The whole --dry-run: planner report, then the listed ranks; exit status."""
    validate(cfg, world_size)
    teacher, teacher_note = None, None
    if cfg.train.export_kd_teacher_load is not None:
        teacher, teacher_ckpt = check_distillation(cfg, dry_run=True)
        teacher_note = dry_run_note(cfg, teacher_ckpt)
    print(dry_run_report(cfg, world_size), flush=True)
    summary = summarize(cfg, world_size, teacher)
    print(format_summary(summary), flush=True)
    if teacher_note:
        print(teacher_note, flush=True)
    if summary.data_errors:
        _write_jsonl(cfg, [summary.record()])
        raise ConfigError("the data, checkpoint or logging flags would stop the run "
                          "(checked without reading a shard or writing a file):\n  "
                          + "\n  ".join(summary.data_errors))
    classes = cfg.train.dry_run_ranks == ["classes"]
    ranks = (sorted(set(representatives(cfg, world_size).values())) if classes
             else dry_run_rank_list(cfg, world_size))
    if not ranks:
        _write_jsonl(cfg, [summary.record()])
        print("(add --dry-run-ranks 0 ... or `all` to run those ranks' real training step on "
              "the meta device)")
        return 0
    results, planned_s = [], planner_step_s(cfg, world_size)  # one layout: priced once
    for rank in ranks:
        results.append(run_rank(cfg, world_size, rank))
        print(f"dry run: rank {rank} done in {results[-1].seconds:.1f} s", flush=True)
        print(group_creations_line(results[-1]), flush=True)
        print(host_syncs_line(results[-1], planned_s), flush=True)
        print(comm_line(results[-1]), flush=True)
    print(format_table(results))
    _write_jsonl(cfg, [{**r.record(), **summary.record()} for r in results])
    return _match_line(cfg, world_size, {r.rank: r.ops for r in results}, classes)


def _match_line(cfg: Config, world_size: int, records: dict[int, list[CommOp]],
                classes: bool) -> int:
    """Match the ranks' ops (widened from the class representatives with `classes`)."""
    if classes:
        print(f"dry run: {len(records)} ranks run, {world_size - len(records)} stood in by "
              "the rank of their class (parallel/rank_classes.py)", flush=True)
        records = full_world(cfg, world_size, records)
    elif len(records) < world_size:
        print(f"collectives not matched: {len(records)} of {world_size} ranks were dry-run "
              "(--dry-run-ranks all or classes matches them)")
        return 0
    problem = match(records)
    if problem:
        print(f"collectives DO NOT match: {problem}")
        return 1
    print(f"collectives matched: {sum(len(ops) for ops in records.values())} ops on "
          f"{world_size} ranks")
    return 0
