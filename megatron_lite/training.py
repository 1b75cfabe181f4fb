"""Composition root: builds everything from the Config, in order, and owns the training loop.

Read top-down: `run` (validate, process groups) -> `train` (build model, optimizer, data,
checkpointer, logger; resume) -> `train_loop` (one iteration: a reliability call before the
step, the step, logging/evaluation/checkpointing at their intervals, a reliability call after)
-> `train_step` (one optimizer step) -> `StepRunner` (the pipeline schedule over this rank's
chunks) -> `token_mean_loss` (why every layout gives the same loss) -> helpers.
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron_lite.checkpoint import Checkpointer
from megatron_lite.checkpoint import files as checkpoint_files
from megatron_lite.checkpoint.checkpointer import apply_checkpoint_args
from megatron_lite.config import (
    Config,
    fp8_bf16_layers,
    num_microbatches,
    pipeline_schedule,
    schedule_in_effect,
    validate,
)
from megatron_lite.data.builder import (
    Coordinator,
    build_loaders,
    data_notes,
    planned_samples,
    resolve_tokenizer,
    samples_per_epoch_of,
)
from megatron_lite.data.loader import MicroBatchLoader
from megatron_lite.distill import Distiller, build_distiller, check_distillation
from megatron_lite.errors import UserError, found_on_rank
from megatron_lite.kernels import KERNEL_NAMES, resolve_use_triton
from megatron_lite.layers import fp8
from megatron_lite.layers.attention import attention_plan
from megatron_lite.layers.context import LayerContext
from megatron_lite.layers.moe import MoEStep
from megatron_lite.memory import memory_report
from megatron_lite.metrics import (
    ComputeTimer,
    MetricsLogger,
    StepRecord,
    detect_peak_tflops,
    peak_line,
)
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.optim.clip import counts_toward_norm
from megatron_lite.optim.lr import step_lrs, weight_decay_at
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel import comms, determinism
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.launch import detect_launch_env
from megatron_lite.parallel.state import ParallelState, format_grid
from megatron_lite.pipeline import engine
from megatron_lite.pipeline.p2p import StageComm, boundary_shape
from megatron_lite.pipeline.partition import config_partition, stage_chunks
from megatron_lite.pipeline.schedule import stage_schedule
from megatron_lite.planner import pipeline_op_costs
from megatron_lite.profiling import StepHooks
from megatron_lite.provenance import git_commit
from megatron_lite.reliability import Guard, preflight, report_partial_checkpoints
from megatron_lite.startup_paths import check_paths
from megatron_lite.unattended import RunJournal

MAX_EPOCHS = 4
"""More passes over the training data than this draw a start-up warning."""


@dataclass
class TrainResult:
    """What a finished run reports back (tests and scripts read it)."""

    losses: list[float] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    iteration: int = 0
    test_loss: float | None = None
    """Loss on the test set after training (None without one, or with --eval-iters 0)."""


def run(cfg: Config) -> TrainResult:
    """Validate (before any process group exists), initialise, train, tear down."""
    env = detect_launch_env()
    check_paths(cfg)  # a bad --save or --log-jsonl found now, not after the run
    apply_checkpoint_args(cfg, env.world_size, env.rank)  # the model shape may come from there
    tokenizer = resolve_tokenizer(cfg)  # the vocab size comes from the tokenizer / manifests
    if env.rank == 0:
        for warning in tokenizer.warnings:
            print(f"warning: {warning}", flush=True)
    validate(cfg, env.world_size)
    if cfg.train.export_kd_teacher_load is not None:  # the teacher's checkpoint and loss file
        check_distillation(cfg)
    if cfg.train.deterministic_mode:  # before the first cuBLAS handle and NCCL communicator
        determinism.enable()
    if cfg.reliability.preflight == "quick":  # a bad node is named before it joins
        preflight.check_rank(env.local_rank)
    startup = StartupTimes()
    with startup.timed("rendezvous"):  # launch checks first: refused by name, not a hang
        pstate = parallel_state.initialize(cfg, env)
    try:
        with found_on_rank(pstate.rank):  # from here on a rank may find what the others do not
            return train(cfg, pstate, env.source, startup)
    finally:
        parallel_state.destroy(pstate)


@dataclass
class Trainer:
    """The loop's collaborators, built once by `train`."""

    cfg: Config
    pstate: ParallelState
    runner: StepRunner
    optimizer: Optimizer
    train_loader: MicroBatchLoader
    valid_loader: MicroBatchLoader | None
    logger: MetricsLogger
    checkpointer: Checkpointer
    guard: Guard
    hooks: StepHooks
    """Profiler window, manual GC, cache emptying (each a no-op unless asked for)."""
    startup: StartupTimes | None = None
    """Start-up phase times, reported after the first step (None: not reported)."""
    journal: RunJournal | None = None
    """The run's resume event after the first step (None: not written)."""
    on_phase: Callable[[str], None] | None = None
    """Told each part of an iteration once it has run ("train_step", "guard", "log", "eval",
    "checkpoint"): the dry run lists what it proved and measures each part's bytes."""


def train(cfg: Config, pstate: ParallelState, launch_source: str = "test",
          startup: StartupTimes | None = None) -> TrainResult:
    """Build model, optimizer, data, checkpointer and logger on an initialised `pstate`,
    resume from a checkpoint if there is one, and run the loop."""
    startup = startup or StartupTimes()
    torch.manual_seed(cfg.train.seed)
    with startup.timed("model build"):
        chunks = build_model(cfg, pstate)
        optimizer = Optimizer(cfg, chunks, pstate)
    with ExitStack() as cleanup:
        cleanup.callback(optimizer.close)  # frees model and process groups before shutdown
        coordinator = data_coordinator(cfg, pstate)
        loaders = build_loaders(cfg, pstate.dp_rank, pstate.dp_size, coordinator=coordinator,
                                cp_rank=pstate.cp_rank)
        startup.seconds.update(coordinator.prep.seconds)
        train_loader, valid_loader = loaders.train, loaders.valid
        if valid_loader is None and cfg.train.eval_iters > 0 and pstate.rank == 0:
            print(f"warning: no validation data (no --valid-data-path, or --split "
                  f"{cfg.data.split}'s validation part holds less than one sample of "
                  f"--seq-length {cfg.model.seq_length}): --eval-iters {cfg.train.eval_iters} "
                  "evaluates nothing", flush=True)
        guard = Guard(cfg, pstate)  # before the load: its spike/LR state is in the checkpoint
        with startup.timed("checkpoint load"):
            checkpointer, moe, amax_history = _checkpointer(cfg, pstate, chunks, optimizer,
                                                            train_loader, guard)
            if pstate.rank == 0:
                report_partial_checkpoints(checkpointer.load_dir)
            start_iteration = checkpointer.load()
        journal = RunJournal(cfg.logging.log_jsonl, pstate.rank)  # before the logger writes
        journal.start_iteration = start_iteration
        peak = detect_peak_tflops(pstate.device, cfg.train, cfg.logging.peak_tflops)
        log_startup(cfg, pstate, chunks, peak, launch_source)
        log_memory(cfg, pstate, chunks, optimizer, amax_history)
        logger = MetricsLogger(cfg, pstate, peak_tflops=peak[0])
        cleanup.callback(logger.close)
        logger.samples_per_epoch = plan_epochs(cfg, pstate, train_loader)
        checkpointer.on_save = logger.log_checkpoint
        guard.on_event = logger.log_event
        guard.attach(optimizer, checkpointer, train_loader)
        guard.start(hosts=logger.hosts)
        cleanup.callback(guard.close)
        runner = StepRunner(cfg, pstate, chunks, on_grads_ready=optimizer.start_grad_sync,
                            distiller=build_distiller(cfg, pstate, chunks), moe=moe,
                            amax_history=amax_history)
        hooks = StepHooks(cfg, pstate.rank, pstate.device)
        cleanup.callback(hooks.close)
        with guard.watch_peers():  # a lost peer is named, not a backend traceback
            result = train_loop(Trainer(cfg, pstate, runner, optimizer, train_loader,
                                        valid_loader, logger, checkpointer, guard, hooks,
                                        startup, journal), start_iteration)
        journal.train_end(result.iteration, cfg.train.train_iters, logger.log_event)
        if loaders.test is not None and cfg.train.eval_iters > 0:
            result.test_loss = evaluate(cfg, runner, loaders.test, pstate)
            logger.log_eval(result.iteration, result.test_loss, split="test")
    if pstate.rank == 0 and result.losses and not math.isfinite(result.losses[-1]):
        print("warning: the final loss is not finite", flush=True)
    return result


def _checkpointer(cfg: Config, pstate: ParallelState, chunks: list[LlamaChunk],
                  optimizer: Optimizer, loader: MicroBatchLoader, guard: Guard
                  ) -> tuple[Checkpointer, MoEStep | None, fp8.Fp8History | None]:
    """The run's checkpointer and the run state it keeps besides weights, optimizer and data:
    the guard's, the MoE expert biases, the FP8 amax histories (the last two when in use)."""
    moe = MoEStep(cfg.moe, cfg.model.num_layers, pstate, chunks) if cfg.moe.num_experts \
        else None
    amax_history = fp8.history(cfg, pstate, chunks)
    state = {"reliability": guard, "moe": moe, "fp8": amax_history}
    return Checkpointer(cfg, pstate, chunks, optimizer, loader, extra_state={
        key: obj for key, obj in state.items() if obj is not None}), moe, amax_history


def train_loop(trainer: Trainer, start_iteration: int = 0) -> TrainResult:
    """Iterations from `start_iteration` to --train-iters (or an earlier agreed exit)."""
    cfg, guard, loader = trainer.cfg, trainer.guard, trainer.train_loader
    result = TrainResult(iteration=start_iteration)
    window: list[StepRecord] = []  # the steps since the last log line
    skipped = 0
    iteration = start_iteration
    while iteration < cfg.train.train_iters:
        iteration += 1
        trainer.hooks.before_step(iteration)
        started = time.perf_counter()
        plan = guard.before_step(iteration, loader.consumed_samples)
        lr, decoupled_lr = _learning_rates(trainer, plan.lr_scale)
        if plan.skip_data:
            samples = loader.current_global_batch_size
            loader.next_step()
            step = StepOutcome(math.nan, math.nan, skipped=True, samples=samples)
        else:
            step = train_step(trainer.runner, trainer.optimizer, loader, trainer.pstate, lr,
                              guard, decoupled_lr, weight_decay_at(
                                  loader.scheduler_samples, loader.global_batch_size,
                                  cfg.optim, cfg.train))
            _phase_done(trainer, "train_step")
        skipped += step.skipped
        if not step.skipped:
            loader.scheduler_samples += step.samples
        window.append(_step_record(trainer, iteration, lr, step, started, skipped))
        if iteration == start_iteration + 1:
            _after_first_step(trainer, iteration, window[-1])
        result.losses.append(step.loss)
        if iteration % cfg.logging.log_interval == 0 or iteration == cfg.train.train_iters:
            trainer.logger.log_train(_interval_record(trainer, window))
            window.clear()
            _phase_done(trainer, "log")
        if _evaluation_due(cfg, iteration) and trainer.valid_loader is not None:
            _evaluate_in_training(trainer, trainer.valid_loader, iteration, result)
        trainer.hooks.after_step(iteration)
        result.iteration = iteration
        decision = guard.after_step(step)
        if not plan.skip_data:  # the step ran the guard's checks and its all-reduce
            _phase_done(trainer, "guard")
        if decision.rollback:
            iteration = result.iteration = _roll_back(trainer.checkpointer, guard, iteration,
                                                      loader)
            continue
        if (_save_if_due(trainer, iteration, started) or decision.exit_reason
                or decision.stop_reason):
            break
    guard.phase("checkpoint")
    trainer.checkpointer.finish(result.iteration)
    if trainer.checkpointer.save_dir is not None:  # the last iteration is saved by now
        _phase_done(trainer, "checkpoint")
    if guard.decision.exit_reason:
        guard.log_exit(result.iteration, guard.decision.exit_reason)
    if guard.decision.stop_reason:  # too many skipped steps: saved above, now fail loudly
        raise guard.log_stop(result.iteration)
    return result


def _after_first_step(trainer: Trainer, iteration: int, record: StepRecord) -> None:
    """The start-up line (its "first step" phase is this step) and the resume event."""
    if trainer.startup is not None:
        trainer.startup.seconds["first step"] = record.iter_time_s
        trainer.startup.report(trainer.pstate)
    if trainer.journal is not None:
        trainer.journal.first_step(iteration, trainer.logger.log_event)


def _evaluate_in_training(trainer: Trainer, loader: MicroBatchLoader, iteration: int,
                          result: TrainResult) -> None:
    """A periodic (or the final) validation pass, logged and appended to `result`."""
    trainer.guard.phase("evaluation")
    result.eval_losses.append(evaluate(trainer.cfg, trainer.runner, loader, trainer.pstate,
                                       eval_start(trainer.cfg, iteration,
                                                  loader.global_batch_size)))
    trainer.logger.log_eval(iteration, result.eval_losses[-1])
    trainer.hooks.after_evaluation()
    _pop_comm_wait(trainer)  # evaluation's pipeline waits are not the next step's
    _phase_done(trainer, "eval")


def _phase_done(trainer: Trainer, name: str) -> None:
    if trainer.on_phase is not None:
        trainer.on_phase(name)


@dataclass(frozen=True)
class StepOutcome:
    """One iteration's result, as the loop logs it."""

    loss: float
    """The global-batch loss (NaN when the batch was skipped unseen)."""
    grad_norm: float
    """Before clipping; NaN when no optimizer step ran."""
    skipped: bool
    """The weights were not updated."""
    samples: int = 0
    """Samples in this step's global batch (it grows during a batch-size ramp-up)."""
    extras: dict[str, float] = field(default_factory=dict)
    """Further global-batch losses to log (distillation's "total loss", ...)."""


def train_step(runner: StepRunner, optimizer: Optimizer, loader: MicroBatchLoader,
               pstate: ParallelState, lr: float, guard: Guard | None = None,
               decoupled_lr: float | None = None, weight_decay: float | None = None
               ) -> StepOutcome:
    """One optimizer step over the next global batch (`decoupled_lr`: --decoupled-lr's LR for
    the embedding and output weights; `weight_decay`: this step's, default --weight-decay).

    With a `guard` the local loss (and, through `optimizer.grad_check`, the local gradients)
    is checked before any reduction, and all ranks agree whether to update at all.
    """
    samples = loader.current_global_batch_size
    batches = loader.next_step()
    with optimizer.wait_clock:  # the first collective after the data: it waits for the slowest
        norm = loss_normalization(batches, pstate, runner.per_token_loss)
    optimizer.zero_grad(len(batches))
    local = runner(batches, norm)
    if guard is not None:
        local = guard.check_loss(local)
    optimizer.finalize_grads()
    with optimizer.wait_clock:
        loss = reduce_loss(local, pstate)
    if guard is not None and guard.decide(loss).skip:
        return StepOutcome(loss, math.nan, skipped=True, samples=samples)
    result = optimizer.step(lr, decoupled_lr, weight_decay)
    extras = {name: reduce_loss(v, pstate) for name, v in runner.extras.items()}
    if runner.moe is not None:  # aux losses, load imbalance; the expert-bias update
        extras.update(runner.moe.end(update_bias=not result.skipped))
    return StepOutcome(loss, result.grad_norm, result.skipped, samples, extras)


class StepRunner:
    """Runs one step's forward/backward over this stage's chunks with the pipeline schedule.

    Without pipelining the schedule is plain gradient accumulation; with it, 1F1B,
    interleaved 1F1B, or a zero-bubble schedule (--pipeline-schedule zb-h1/zbv, whose W's
    fill the bubble). Schedules are cached per (micro-batches, forward-only). Under
    --fp8-recipe delayed each training step starts with cleared amaxes and ends by folding
    them into the histories (`amax_history`, built from the chunks when not given).
    """

    def __init__(self, cfg: Config, pstate: ParallelState, chunks: list[LlamaChunk],
                 on_grads_ready: Callable[[int], None] | None = None,
                 distiller: Distiller | None = None, moe: MoEStep | None = None,
                 amax_history: fp8.Fp8History | None = None) -> None:
        self.pstate, self.chunks = pstate, chunks
        self.moe = moe
        self.amax_history = amax_history or fp8.history(cfg, pstate, chunks)
        # distillation: the chunks carry the teacher and the loss is the distillation loss
        self.distiller = distiller
        self.model_chunks: list = distiller.chunks if distiller is not None else chunks
        self.loss_fn = distiller.loss if distiller is not None else token_mean_loss
        self.extras: dict[str, Tensor] = {}
        """This step's local shares of the distillation terms (`Distiller`), summed like the
        loss."""
        # the head's loss dtype, so that stages without it all-reduce a zero of the same dtype
        self.loss_dtype = torch.float64 if cfg.train.fp64 else torch.float32
        self.per_token_loss = cfg.train.calculate_per_token_loss
        self.kind = pipeline_schedule(cfg.parallel)
        # zero-bubble timelines are built for the layers' F, B and W FLOP ratios
        self.op_costs = pipeline_op_costs(cfg.model, pstate.tp_size)
        self.on_grads_ready = on_grads_ready  # starts a chunk's DP reduction (overlap)
        self._schedules: dict[tuple[int, bool], list] = {}
        self.comm = None
        self.timer = ComputeTimer(pstate.device)  # this rank's training fwd/bwd, for stragglers
        if pstate.pp_size > 1:
            shape = boundary_shape(cfg.model.seq_length // pstate.cp_size,
                                   cfg.train.micro_batch_size,
                                   cfg.model.hidden_size, pstate.tp_size,
                                   cfg.parallel.sequence_parallel)
            self.comm = StageComm(pstate, shape, model_dtype(cfg),
                                  v_shape=schedule_in_effect(cfg.parallel).v_shape)

    def __call__(self, batches: list[dict[str, Tensor]], num_tokens: Tensor | MicroBatchMeans,
                 *, backward: bool = True) -> Tensor:
        """This rank's part of the step loss on the stage holding the head (the last; the
        first under ZBV), else 0: the sum over micro-batches of sum(token losses) divided by
        `num_tokens` (the global valid-token count, --calculate-per-token-loss) or by each
        micro-batch's own divisor (`MicroBatchMeans`, Megatron's default). Either way the value
        returned sums, over all ranks, to the global token-mean loss (what is logged); the
        gradients are those of the loss as normalized."""
        key = (len(batches), not backward)
        if key not in self._schedules:
            self._schedules[key] = stage_schedule(self.pstate.pp_size, self.pstate.pp_rank,
                                                  len(batches), len(self.chunks),
                                                  forward_only=not backward, kind=self.kind,
                                                  costs=self.op_costs)
        means = num_tokens if isinstance(num_tokens, MicroBatchMeans) else None
        divisors = (means.divisors.unbind() if means is not None
                    else [num_tokens] * len(batches))
        microbatches = [{**_to_device(b, self.pstate), "loss_divisor": d}
                        for b, d in zip(batches, divisors, strict=True)]
        if backward:
            self.timer.start()
            if self.moe is not None:
                self.moe.begin(len(batches))
            if self.amax_history is not None:
                self.amax_history.begin()
        losses = engine.forward_backward(
            self.model_chunks, self._schedules[key], microbatches, self.comm, self.loss_fn,
            on_grads_ready=self.on_grads_ready if backward else None, forward_only=not backward)
        if backward:
            self.timer.stop()
            if self.amax_history is not None:
                self.amax_history.fold()
        if self.distiller is not None:
            terms = self.distiller.pop_terms()
            self.extras = {name: self._step_share([t[name] for t in terms], means)
                           for name in (terms[0] if terms else {})}
        return self._step_share(losses, means)

    def _step_share(self, losses: list[Tensor], means: MicroBatchMeans | None) -> Tensor:
        """The step's local loss from its micro-batches' shares (see `__call__`)."""
        if not losses:
            return torch.zeros((), dtype=self.loss_dtype, device=self.pstate.device)
        if means is None:
            return torch.stack(losses).sum()
        # back to token sums: the logged loss is the token mean in both modes (as Megatron's)
        return (torch.stack(losses) * means.divisors).sum() / means.tokens


def token_mean_loss(token_losses: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
    """One micro-batch's share of the step loss: its masked token losses summed, divided by
    its "loss_divisor" (`loss_normalization`).

    Why every layout gives the same loss and gradients: with --calculate-per-token-loss the
    divisor is the valid-token count of the whole global batch, so the step loss is a plain
    sum of per-token terms over it. Gradient accumulation adds micro-batches, the DP reduction
    adds ranks (a sum, not a mean), TP and PP only split where each term is computed, so any
    TP x PP x DP x accumulation regrouping sums the same terms. Megatron's default divides by
    the micro-batch's own count (over its CP ranks) times the micro-batches of all DP ranks:
    still a sum of per-token terms, now weighted per micro-batch, and the same for any layout
    that forms the same micro-batches.
    """
    return (token_losses * batch["loss_mask"]).sum() / batch["loss_divisor"]


@dataclass(frozen=True)
class MicroBatchMeans:
    """Megatron's default loss normalization (no --calculate-per-token-loss), per step."""

    divisors: Tensor
    """[micro-batches] on the device: each micro-batch's valid tokens (summed over its CP
    ranks, at least 1, as Megatron clamps an all-masked one) times the micro-batches of the
    global batch, so the step loss is the mean over micro-batches of their token means."""
    tokens: Tensor
    """Valid tokens of the whole global batch (`global_token_count`), for the logged loss."""


def loss_normalization(batches: list[dict[str, Tensor]], pstate: ParallelState,
                       per_token_loss: bool) -> Tensor | MicroBatchMeans:
    """What the step's micro-batch losses are divided by: the global valid-token count
    (--calculate-per-token-loss), else each micro-batch's own (`MicroBatchMeans`).

    Megatron divides by a CP rank's own chunk count, so there a CP rank whose chunk has more
    masked tokens weighs its tokens more; here the count is the micro-batch's over its CP
    ranks, so CP does not change the loss (identical to Megatron's without CP, and with CP
    whenever the chunks hold as many valid tokens, e.g. without --eod-mask-loss)."""
    tokens = global_token_count(batches, pstate)
    if per_token_loss:
        return tokens
    counts = torch.stack([b["loss_mask"].sum() for b in batches]).to(pstate.device,
                                                                    torch.float32)
    if pstate.cp_size > 1:
        counts = comms.all_reduce_(counts, pstate.cp_group, kind="cp")
    return MicroBatchMeans(counts.clamp(min=1) * (len(batches) * pstate.dp_size), tokens)


def global_token_count(batches: list[dict[str, Tensor]], pstate: ParallelState) -> Tensor:
    """Valid (loss-masked) tokens in the whole global batch, summed over DP ranks (and CP
    ranks, each of which counts its own chunks)."""
    count = sum(b["loss_mask"].sum() for b in batches).to(pstate.device, torch.float32)
    return comms.all_reduce_(count, pstate.dp_cp_group if pstate.cp_size > 1 else pstate.dp_group,
                             kind="dp_cp")


def _to_device(batch: dict[str, Tensor], pstate: ParallelState) -> dict:
    """The micro-batch on the device, plus its attention plan, made here on the host from the
    host batch once per micro-batch and shared by every layer (no device->host syncs)."""
    batch = dict(batch)
    whole = batch.pop("sequence_documents", None)
    plan = None
    if pstate.cp_size > 1 and (whole is not None or "documents" not in batch):
        b, s = batch["tokens"].shape
        plan = attention_plan(s * pstate.cp_size, pstate.cp_size, pstate.cp_rank, b, whole)
    elif pstate.cp_size == 1 and "documents" in batch:
        b, s = batch["documents"].shape
        plan = attention_plan(s, 1, 0, b, batch["documents"])
    moved = {k: v.to(pstate.device, non_blocking=True) for k, v in batch.items()}
    return moved if plan is None else {**moved, "attention_plan": plan}


def reduce_loss(local: Tensor, pstate: ParallelState) -> float:
    """Global-batch loss from the per-DP-rank partial sums of the stage holding the head (the
    last one; the first under ZBV), on every rank. Other stages hold exact zeros."""
    owner = pstate.tp_rank == 0
    value = local.clone() if owner else torch.zeros_like(local)
    return comms.host_scalar(comms.all_reduce_(value, pstate.world_group, kind="world"))


def _learning_rates(trainer: Trainer, scale: float) -> tuple[float, float | None]:
    """This step's LR and --decoupled-lr's (None without it), both times the guard's scale."""
    loader = trainer.train_loader
    lr, decoupled = step_lrs(loader.scheduler_samples, loader.global_batch_size,
                             trainer.cfg.optim, trainer.cfg.train)
    return lr * scale, None if decoupled is None else decoupled * scale


def _evaluation_due(cfg: Config, iteration: int) -> bool:
    t = cfg.train
    periodic = t.eval_interval is not None and iteration % t.eval_interval == 0
    return t.eval_iters > 0 and (periodic or iteration == t.train_iters)


def _pop_comm_wait(trainer: Trainer) -> float:
    """This rank's exposed communication since the last call (comms.WaitClock): the global
    token count and loss all-reduces, the DP gradient reduction's finish, ZeRO-1 parameter
    gathers, pipeline transfer waits. Not counted: TP/SP collectives inside the layers, the
    grad-norm and reliability all-reduces. Popped after the step's loss is on the host, so
    reading the CUDA events does not stall the stream."""
    comm = trainer.runner.comm
    return trainer.optimizer.wait_clock.pop_seconds() + (
        comm.wait_clock.pop_seconds() if comm is not None else 0.0)


def _step_record(trainer: Trainer, iteration: int, lr: float, step: StepOutcome,
                 started: float, skipped: int) -> StepRecord:
    """This iteration's telemetry, its times and waits popped from their clocks."""
    return StepRecord(
        iteration=iteration, consumed_samples=trainer.train_loader.consumed_samples,
        loss=step.loss, lr=lr, grad_norm=step.grad_norm,
        iter_time_s=time.perf_counter() - started,
        tokens=step.samples * trainer.cfg.model.seq_length, skipped=skipped,
        compute_time_s=trainer.runner.timer.pop_seconds(), global_batch_size=step.samples,
        scalars=dict(step.extras), data_wait_s=trainer.train_loader.pop_wait_seconds(),
        comm_wait_s=_pop_comm_wait(trainer))


def _interval_record(trainer: Trainer, window: list[StepRecord]) -> StepRecord:
    """One log line / JSONL record: means over the steps since the last one, with the last
    step's position, LR and skip count."""
    n, last, lg = len(window), window[-1], trainer.cfg.logging

    def mean(name: str) -> float:
        return sum(getattr(record, name) for record in window) / n

    scalars = {}
    if lg.log_params_norm:
        scalars["params_norm"] = trainer.optimizer.params_norm()
    if lg.log_num_zeros_in_grad:
        scalars["num_zeros_in_grad"] = trainer.optimizer.num_zeros_in_grad()
    for name in last.scalars:  # distillation's terms
        scalars[name] = sum(record.scalars.get(name, math.nan) for record in window) / n
    samples = sum(record.global_batch_size or 0 for record in window) // n
    return replace(
        last, loss=mean("loss"), grad_norm=mean("grad_norm"), iter_time_s=mean("iter_time_s"),
        tokens=samples * trainer.cfg.model.seq_length, compute_time_s=mean("compute_time_s"),
        global_batch_size=last.global_batch_size if _variable_batch(trainer.cfg) else None,
        scalars=scalars, data_wait_s=mean("data_wait_s"), comm_wait_s=mean("comm_wait_s"))


def _variable_batch(cfg: Config) -> bool:
    return bool(cfg.train.rampup_batch_size) or cfg.train.step_batch_size_schedule is not None


def plan_epochs(cfg: Config, pstate: ParallelState, loader: MicroBatchLoader) -> int:
    """Samples in one pass over the training corpus (every DP rank's shards, node-local);
    rank 0 prints the planned epochs and warns above MAX_EPOCHS, or below one epoch with
    --expect-full-pass. Node-local ranks read only their shards, each at its own rate: the
    pass is the sum of their epochs, each rank's repetition its share over its own epoch
    (counting a node's local epoch as the corpus's is the under-training bug this prints)."""
    local = sum(samples_per_epoch_of(s) for s in loader.streams)
    node_local = loader.node_local and pstate.dp_size > 1
    per_rank = [local]
    if node_local:
        row = torch.zeros(pstate.dp_size, dtype=torch.float64, device=pstate.device)
        row[pstate.dp_rank] = local
        per_rank = [int(x) for x in comms.all_reduce_(row, pstate.dp_group, kind="dp").tolist()]
    total = sum(per_rank)
    planned = planned_samples(cfg, loader.global_batch_size)
    epochs = planned / total
    if pstate.rank != 0:
        return total
    text = (f"data: {planned:,} training samples planned ({cfg.train.train_iters} steps) over "
            f"{total:,} samples per epoch = {epochs:.3g} epochs")
    if node_local:
        share = planned / pstate.dp_size
        text += (f"; node-local: each of the {pstate.dp_size} DP ranks reads its own shards, "
                 f"{min(per_rank):,}-{max(per_rank):,} samples per epoch, so it sees them "
                 f"{share / max(per_rank):.3g}-{share / min(per_rank):.3g} times")
    print(text, flush=True)
    if epochs > MAX_EPOCHS:
        print(f"warning: the run would see its training data {epochs:.3g} times (more than "
              f"{MAX_EPOCHS}): repeated data gives little and invites memorisation; add data "
              "or lower --train-iters / --train-samples", flush=True)
    elif epochs < 1 and cfg.data.expect_full_pass:
        print(f"warning: --expect-full-pass, but the run covers only {epochs:.3g} of its "
              f"training data ({planned:,} of {total:,} samples); raise --train-iters to at "
              f"least {math.ceil(total / loader.global_batch_size)} (or --train-samples to "
              f"{total})", flush=True)
    return total


def _save_if_due(trainer: Trainer, iteration: int, step_started: float) -> bool:
    """Interval saves after a step; True when --exit-interval says stop now."""
    trainer.guard.phase("checkpoint")
    saving = time.perf_counter()
    stop = trainer.checkpointer.after_step(iteration)
    interval = trainer.cfg.checkpoint.save_interval
    if interval and iteration % interval == 0:
        trainer.guard.advise_interval(time.perf_counter() - saving, saving - step_started)
    return stop


def _roll_back(checkpointer: Checkpointer, guard: Guard, iteration: int,
               loader: MicroBatchLoader) -> int:
    """--on-spike rollback: reload the last checkpoint; the iteration to continue after."""
    consumed = loader.consumed_samples
    checkpointer.wait()
    if not checkpoint_files.list_iterations(checkpointer.save_dir):
        return iteration  # nothing saved yet: the spikes were skipped, keep going
    restored = checkpointer.load(restore_extra=False)
    guard.after_rollback(iteration, restored, consumed, loader)
    return restored


@torch.no_grad()
def evaluate(cfg: Config, runner: StepRunner, loader: MicroBatchLoader,
             pstate: ParallelState, start: int = 0) -> float:
    """Token-mean loss over the --eval-iters global batches starting at sample `start` (all
    valid tokens of them together, as Megatron's evaluation sums them); see `eval_start`."""
    chunks = runner.chunks
    for chunk in chunks:
        chunk.eval()
    loader.consumed_samples = start
    token_loss, tokens = 0.0, torch.zeros((), device=pstate.device)
    for _ in range(cfg.train.eval_iters):
        batches = loader.next_step()
        num_tokens = global_token_count(batches, pstate)
        local = runner(batches, num_tokens, backward=False)
        token_loss += reduce_loss(local * num_tokens, pstate)
        tokens += num_tokens
    for chunk in chunks:
        chunk.train()
    return token_loss / max(1.0, comms.host_scalar(tokens))


def eval_start(cfg: Config, iteration: int, global_batch_size: int) -> int:
    """First validation sample of the evaluation after `iteration`: Megatron's validation
    iterator moves on by --eval-iters global batches per evaluation (never back to the
    start), so evaluation k (from 0) reads batches k*E .. k*E+E-1. A function of the
    iteration, so a resumed run reads what the uninterrupted one would have."""
    t = cfg.train
    if t.eval_interval is None:
        return 0  # evaluated once, at the end
    done_before = iteration // t.eval_interval - (iteration % t.eval_interval == 0)
    return done_before * t.eval_iters * global_batch_size


def model_dtype(cfg: Config) -> torch.dtype:
    if cfg.train.fp64:
        return torch.float64
    return torch.bfloat16 if cfg.train.bf16 else torch.float32


def use_triton_kernels(cfg: Config, device: torch.device) -> bool:
    """`--triton-kernels` resolved for `device`; never under --fp64 (the kernels compute in
    fp32)."""
    return not cfg.train.fp64 and resolve_use_triton(cfg.model.triton_kernels, device)


def layer_context(cfg: Config, pstate: ParallelState) -> LayerContext:
    """The build context of this rank's layers (every chunk of the model shares it)."""
    return LayerContext.from_state(
        pstate, seed=cfg.train.seed, sequence_parallel=cfg.parallel.sequence_parallel,
        dtype=model_dtype(cfg), use_triton=use_triton_kernels(cfg, pstate.device),
        recompute_granularity=cfg.train.recompute_granularity,
        recompute_method=cfg.train.recompute_method or "uniform",
        recompute_num_layers=cfg.train.recompute_num_layers or 1,
        split_backward=schedule_in_effect(cfg.parallel).split_backward,
        moe=cfg.moe if cfg.moe.num_experts else None, fp8=fp8.recipe(cfg.train),
        fp8_bf16_layers=fp8_bf16_layers(cfg.train, cfg.model.num_layers))


def build_model(cfg: Config, pstate: ParallelState) -> list[LlamaChunk]:
    """This rank's model chunks: one per virtual stage (one without interleaving, two in
    ZBV's V, where stage 0's head reuses its embedding)."""
    ctx = layer_context(cfg, pstate)
    part = config_partition(cfg, pstate.pp_size)
    chunks: list[LlamaChunk] = []
    for spec in stage_chunks(part, pstate.pp_rank):
        tied = chunks[0].embedding.weight if part.v_shape and spec.post_process else None
        chunks.append(LlamaChunk(cfg.model, ctx, spec.layer_ids,
                                 pre_process=spec.pre_process, post_process=spec.post_process,
                                 head_on_stage=part.v_shape and spec.pre_process,
                                 tied_embedding=tied))
    if cfg.train.compile:
        for chunk in chunks:
            if pstate.tp_size == 1:
                # Nothing inside a chunk communicates and the loss traces to plain ops
                # (kernels/cross_entropy.py): one graph for embedding, layers, head and loss.
                chunk.compile()
                continue
            for layer in chunk.layers:
                layer.compile()
    return chunks


def parameter_count(chunks: list[nn.Module], pstate: ParallelState) -> int | float:
    """Parameters of the whole model (each counted once across TP and PP); NaN on the meta
    device (a dry run: the reduction runs, its value is not there)."""
    value = comms.host_scalar(reduced_parameter_count(chunks, pstate))
    return int(value) if math.isfinite(value) else value


def reduced_parameter_count(chunks: list[nn.Module], pstate: ParallelState) -> Tensor:
    """The count as a float64 tensor summed over the model-parallel group, on the run's
    device: an NCCL group has no CPU backend (a host tensor here once stopped every TP>1 or
    PP>1 GPU job at start-up)."""
    seen: set[int] = set()
    local = 0
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) not in seen and counts_toward_norm(p, pstate):
                seen.add(id(p))
                local += p.numel()
    count = torch.tensor(float(local), dtype=torch.float64, device=pstate.device)
    return comms.all_reduce_(count, pstate.mp_group, kind="mp")


STARTUP_PHASES = ("rendezvous", "data validation", "index", "model build", "checkpoint load",
                  "first step")


@dataclass
class StartupTimes:
    """Seconds this rank spent in each start-up phase; `report` prints, on rank 0, the
    slowest rank's time of each in one `startup:` line (at scale one slow rank sets the pace,
    and the line says which phase to look at). A reading rank's wait at the data barrier
    for the rank that prepares its files counts in no phase."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STARTUP_PHASES, 0.0))

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - started

    def report(self, pstate: ParallelState) -> None:
        """Collective (every rank calls it, after the first step)."""
        values = torch.tensor([self.seconds[p] for p in STARTUP_PHASES], dtype=torch.float64,
                              device=pstate.device)
        comms.all_reduce_(values, pstate.world_group, op=dist.ReduceOp.MAX, kind="world")
        if pstate.rank != 0:
            return
        parts = ", ".join(f"{phase} {comms.host_scalar(values[i]):.2f} s"
                          for i, phase in enumerate(STARTUP_PHASES))
        slowest = f" (slowest of {pstate.world_size} ranks each)" if pstate.world_size > 1 else ""
        print(f"startup: {parts}{slowest}", flush=True)


def data_coordinator(cfg: Config, pstate: ParallelState) -> Coordinator:
    """Who prepares (validates, indexes) the data files this rank reads, and the barrier where
    the others wait for it: global rank 0 over shared storage; with --data-sharding
    node-local, the first rank of this node that reads the same DP shards (ranks of a node are
    consecutive, so its TP and PP peers on the node share the files)."""
    preparer = 0
    if cfg.data.data_sharding == "node-local":
        per_dp = pstate.dp_size * pstate.tp_size
        preparer = next(r for r in range(pstate.rank - pstate.local_rank, pstate.rank + 1)
                        if r % per_dp // pstate.tp_size == pstate.dp_rank)
    minutes = cfg.parallel.distributed_timeout_minutes

    def wait(error: str | None) -> str | None:
        try:
            failed = comms.barrier(pstate.world_group, pstate.device, kind="world",
                                   status=0 if error is None else pstate.rank + 1,
                                   timeout_s=minutes * 60)
            if not failed:
                return None
            # only when a rank failed: every rank learns what, so each can name the file
            errors = comms.all_gather_objects(error, pstate.world_group, pstate.device,
                                              kind="world")
            return f"rank {failed - 1} could not prepare the data: {errors[failed - 1]}"
        except TimeoutError as e:
            whom = ("the other ranks" if preparer == pstate.rank else
                    f"rank {preparer}, which validates the shards and builds the index caches "
                    "this rank reads")
            raise UserError(
                f"data: rank {pstate.rank} waited at the start-up barrier for {whom}: {e}. See "
                f"that rank's output; a large corpus without a manifest takes long to scan the "
                f"first time (raise --distributed-timeout-minutes {minutes:g})") from e

    return Coordinator(pstate.rank, preparer, wait, world_size=pstate.world_size)


def log_startup(cfg: Config, pstate: ParallelState, chunks: list[nn.Module],
                peak: tuple[float, str], launch_source: str) -> None:
    """Rank 0: the resolved config, layout, batch hierarchy, sizes and provenance."""
    n_params = parameter_count(chunks, pstate)
    if pstate.rank != 0:
        return
    train_cfg, model_cfg = cfg.train, cfg.model
    nmb = num_microbatches(cfg, pstate.world_size)
    gbs = train_cfg.micro_batch_size * pstate.dp_size * nmb
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    device = (torch.cuda.get_device_name(pstate.device) if pstate.device.type == "cuda"
              else f"CPU ({platform.processor() or platform.machine()}, "
                   f"{torch.get_num_threads()} threads)")
    use_triton = use_triton_kernels(cfg, pstate.device)
    grid = format_grid(pstate.grid, full=cfg.logging.log_rank_grid)
    dims = "[pp][dp][cp]" if pstate.cp_size > 1 else "[pp][dp]"
    print("megatron_lite: resolved config\n" + json.dumps(cfg.to_dict(), indent=1), flush=True)
    print(f"launch: {launch_source}, world size {pstate.world_size}, backend "
          f"{pstate.backend or 'none (single process)'}; rank grid {dims} -> tp ranks:\n"
          f"{grid}\n"
          f"model: {n_params:,} parameters ({n_params / 1e6:.2f} M), vocab "
          f"{model_cfg.vocab_size} padded to {model_cfg.padded_vocab_size(pstate.tp_size)}\n"
          f"batch: micro {train_cfg.micro_batch_size} samples x {nmb} accumulation steps x dp "
          f"{pstate.dp_size} = global {gbs} samples = {gbs * model_cfg.seq_length:,} tokens per "
          f"step\n"
          f"kernels: {'triton ' + ', '.join(KERNEL_NAMES) if use_triton else 'torch reference'}"
          f"\nprovenance: git {git_commit()}, torch {torch.__version__}, triton "
          f"{triton_version}, python {platform.python_version()}, device {device}\n"
          f"{peak_line(peak, train_cfg.fp8_format is not None)}", flush=True)
    for note in data_notes(cfg):
        print(f"note: {note}", flush=True)


def log_memory(cfg: Config, pstate: ParallelState, chunks: list[LlamaChunk],
               optimizer: Optimizer, amax_history: fp8.Fp8History | None = None) -> None:
    """Rank 0: bytes held by parameters, gradients and optimizer (and the delayed FP8
    recipe's amax tables), measured vs planned."""
    report = optimizer.memory()
    # by storage: the parameters view their buffers, and a weight kept only as its fp8 copy
    # (--fp8-param-gather) views one of no bytes
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in optimizer.param_tensors()}
    text = memory_report(cfg, pstate, chunks, report.state_bytes, report.grad_buffer_bytes,
                         sum(storages.values()),
                         amax_history.nbytes if amax_history is not None else None)
    if pstate.rank == 0:
        print(report.describe() + "\n" + text, flush=True)
