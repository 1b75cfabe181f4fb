"""MFU, per-rank timing and stragglers, the log line, the JSONL record and wandb.

FLOPs per token come from `planner.training_flops_per_token` (the convention is in the
planner's docstring), so the MFU logged here is the one `scripts/plan.py` predicts: `mfu`
counts attention as if not causal (6N + 12·l·q·s, the PaLM / nanoGPT / torchtitan headline),
`mfu_causal` halves the attention term (Megatron since 2025). Activation recomputation is
never counted: MFU measures useful work only.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import resource
import socket
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from megatron_lite.config import Config, ConfigError, LoggingConfig, TrainConfig
from megatron_lite.devices import EMULATED_BF16_SLOWDOWN, device_peak, measure_cpu_peak_tflops
from megatron_lite.parallel import comms
from megatron_lite.parallel.audit import group_kind, op_identity
from megatron_lite.parallel.state import ParallelState
from megatron_lite.planner import ModelShape, matmul_params, training_flops_per_token
from megatron_lite.unattended import job_id

JSONL_TRAIN_KEYS = ("iteration", "consumed_samples", "loss", "lr", "grad_norm", "iter_time_ms",
                    "tokens_per_sec", "tflops_per_device", "mfu", "data_wait_ms", "comm_wait_ms",
                    "tokens_seen", "epoch")
WANDB_MODES = ("online", "offline", "disabled")


def gemm_dtype(train: TrainConfig) -> torch.dtype:
    """The dtype the model's GEMMs run in, whose peak MFU divides by. FP8 GEMMs are counted
    against the bf16 peak (torchtitan's and Megatron's convention), and `peak_line` says so."""
    if train.fp64:
        return torch.float64
    return torch.bfloat16 if train.bf16 else torch.float32


def detect_peak_tflops(device: torch.device, train: TrainConfig,
                       given: float | None) -> tuple[float, str]:
    """(MFU's denominator, where it came from): the table's peak on a GPU, the measured matmul
    of the model's GEMM dtype on a CPU; a CPU whose bf16 matmul is emulated says so, with
    the slowdown measured, when the run asks for --bf16."""
    dtype = gemm_dtype(train)
    if device.type == "cuda" and dtype == torch.float64:
        return math.nan, "fp64: no fp64 peak in megatron_lite/devices.py; pass --peak-tflops"
    peak, source = device_peak(device, dtype, given)
    if device.type == "cpu" and train.bf16 and not given:
        slowdown = measure_cpu_peak_tflops(torch.float32) / peak
        if slowdown > EMULATED_BF16_SLOWDOWN:
            source += (f"; bf16 matmul is emulated on this CPU ({slowdown:.0f}x slower than "
                       "fp32): drop --bf16 for speed")
    return peak, source


def peak_line(peak: tuple[float, str], fp8: bool) -> str:
    """The startup line naming MFU's denominator. Under --fp8-format MFU stays relative to
    the bf16 dense peak (FP8's is twice that), unless --peak-tflops set another, and says so."""
    line = f"MFU peak: {peak[0]:.4g} TFLOP/s ({peak[1]})"
    if fp8 and peak[1] != "--peak-tflops":
        line += "; the FP8 GEMMs are counted against this bf16 peak (--peak-tflops for another)"
    return line


def memory_stats(device: torch.device) -> dict[str, float]:
    """GiB: CUDA max allocated / max reserved, or the process's resident set (now, peak) on CPU."""
    if device.type == "cuda":
        return {"max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "max_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    # /proc/self/status has this process's own peak (VmHWM). getrusage's ru_maxrss survives
    # exec, so a process started by a big parent would report the parent's peak.
    kib: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    kib[key] = float(value.split()[0])
    except OSError:
        pass
    rss = kib.get("VmRSS", float("nan")) / 2**20
    peak = kib.get("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 2**20
    return {"rss_gib": rss, "max_rss_gib": max(peak, rss)}


def _peak_gib(mem: dict[str, float]) -> float:
    return mem.get("max_allocated_gib", mem.get("max_rss_gib", float("nan")))


class ComputeTimer(comms.WaitClock):
    """Per-rank time spent in forward/backward, the part of a step that does not wait for other
    data-parallel ranks. Wall time per step is the same on every rank (the gradient all-reduce
    lines them up), so only this time can show which rank is slow. The same stream timing as
    `comms.WaitClock` (CUDA events time the stream, not the kernel launches), as start/stop."""

    def start(self) -> None:
        self.__enter__()

    def stop(self) -> None:
        self.__exit__(None, None, None)


@dataclass(frozen=True)
class RankSpread:
    """One log interval's per-rank times: min / median / max and who is slowest."""

    min_s: float
    median_s: float
    max_s: float
    slowest_rank: int
    slowest_host: str


def rank_spread(times: list[float], hosts: list[str]) -> RankSpread:
    slowest = max(range(len(times)), key=times.__getitem__)
    return RankSpread(min(times), statistics.median(times), times[slowest], slowest,
                      hosts[slowest])


class StragglerDetector:
    """Flags a rank that stays more than `threshold` slower than the median for `intervals`
    consecutive log intervals (one slow interval is noise: a GC pause, a host stall)."""

    def __init__(self, threshold: float, intervals: int) -> None:
        self.threshold, self.intervals = threshold, intervals
        self.streak: dict[int, int] = {}

    def update(self, times: list[float]) -> list[tuple[int, float, int]]:
        """(rank, fraction slower than the median, intervals in a row) to warn about now.

        Warns when a streak reaches `intervals` and again every `intervals` while it lasts."""
        median = statistics.median(times)
        if median <= 0:
            return []
        slow = [r for r, seconds in enumerate(times) if seconds > median * (1 + self.threshold)]
        self.streak = {r: self.streak.get(r, 0) + 1 for r in slow}
        return [(r, times[r] / median - 1, n) for r, n in sorted(self.streak.items())
                if n >= self.intervals and n % self.intervals == 0]


def _gather_floats(values: list[float], pstate: ParallelState) -> list[list[float]]:
    """Every rank's `values` (a collective: all ranks call it)."""
    if not pstate.distributed:
        return [values]
    local = torch.tensor(values, dtype=torch.float64, device=pstate.device)
    out = [torch.empty_like(local) for _ in range(pstate.world_size)]
    with op_identity("rank_values"), group_kind("world"):
        dist.all_gather(out, local, group=pstate.world_group)
    # a dry run: no values come back; each rank reads its own as everyone's
    return comms.host_value(torch.stack(out), [list(values) for _ in out])


def _gather_hosts(pstate: ParallelState) -> list[str]:
    host = socket.gethostname()
    if not pstate.distributed:
        return [host]
    return comms.all_gather_objects(host, pstate.world_group, pstate.device, kind="world")


def resolve_wandb_mode(flag: str | None, environ: dict[str, str] | os._Environ
                       ) -> tuple[str, str]:
    """(mode, why): --wandb-mode, else WANDB_MODE, else online only with credentials."""
    if flag:
        return flag, "--wandb-mode"
    if environ.get("WANDB_MODE") in WANDB_MODES:
        return environ["WANDB_MODE"], "WANDB_MODE"
    if environ.get("WANDB_API_KEY"):
        return "online", "WANDB_API_KEY is set"
    host = environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        if netrc.netrc().authenticators(host):
            return "online", f"~/.netrc has {host}"
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline", "no WANDB_API_KEY or ~/.netrc login"


@dataclass(frozen=True)
class StepRecord:
    """One iteration's telemetry as the training loop produces it, or a log interval's (the
    means over its steps, with the last step's position and LR), as `log_train` takes it."""

    iteration: int
    consumed_samples: int
    """Samples consumed after this step, over all DP ranks (the resume position)."""
    loss: float
    lr: float
    grad_norm: float
    iter_time_s: float
    """Wall time of the iteration."""
    tokens: int
    """Tokens in the global batch."""
    skipped: int
    """Iterations skipped so far in this run (not updated: NaN/Inf, spikes)."""
    compute_time_s: float | None = None
    """This rank's forward/backward time (None: `iter_time_s`), for the straggler check."""
    global_batch_size: int | None = None
    """The global batch size, shown where it changes (a ramp-up; None: not shown)."""
    scalars: dict[str, float] = field(default_factory=dict)
    """Extra values for the record (--log-params-norm, --log-num-zeros-in-grad,
    distillation's terms)."""
    data_wait_s: float = 0.0
    """Time blocked on the loader, this rank."""
    comm_wait_s: float = 0.0
    """Exposed communication, this rank (comms.WaitClock: token-count and loss all-reduces,
    DP gradient reductions, ZeRO-1 gathers, pipeline transfers; not TP collectives, the
    grad-norm or the guard's all-reduce; training._pop_comm_wait)."""


class MetricsLogger:
    """Prints the step line and writes JSONL / wandb on the logging rank (rank 0, which holds
    the world-reduced loss). `log_train` is a collective: every rank calls it, so the per-rank
    compute times and peak memory can be gathered."""

    def __init__(self, cfg: Config, pstate: ParallelState, *, peak_tflops: float) -> None:
        lg = cfg.logging
        if not lg.straggler_threshold > 0:
            raise ConfigError(f"--straggler-threshold must be > 0 (a fraction, 0.1 = 10%), got "
                              f"{lg.straggler_threshold}")
        if lg.straggler_intervals < 1:
            raise ConfigError(f"--straggler-intervals must be >= 1, got {lg.straggler_intervals}")
        self.cfg, self.pstate, self.peak_tflops = cfg, pstate, peak_tflops
        self.enabled = pstate.rank == 0
        shape = ModelShape.from_config(cfg.model, pstate.tp_size, cfg.moe)
        seq = cfg.model.seq_length
        self.flops_per_token = training_flops_per_token(shape, seq)
        self.flops_per_token_causal = training_flops_per_token(shape, seq, causal=True)
        self.hosts = _gather_hosts(pstate)
        self.stragglers = StragglerDetector(lg.straggler_threshold, lg.straggler_intervals)
        self.jsonl: IO[str] | None = None
        self.job = job_id()
        self.wandb: Any = None
        self.wandb_sync_hint = ""
        self.tensorboard: Any = None
        self.samples_per_epoch: int | None = None
        """Training samples in one pass over the corpus, all DP ranks' shards together (set
        by the loop once the data is known); `epoch` in the records is consumed / this."""
        if not self.enabled:
            return
        n = matmul_params(shape)
        print(f"FLOPs per token: 6N + 12*l*h*s = 6 x {n:,} + 12 x {shape.layers} x "
              f"{shape.heads * shape.head_dim} x {seq} = {self.flops_per_token:.4g} "
              f"(causal: 6N + 6*l*h*s = {self.flops_per_token_causal:.4g}); N = matmul weights "
              f"incl. the output layer, recompute not counted", flush=True)
        if lg.log_jsonl:
            Path(lg.log_jsonl).parent.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(lg.log_jsonl, "a", buffering=1)  # noqa: SIM115
        if lg.wandb_project:
            self._init_wandb(n)
        if lg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ConfigError("--tensorboard-dir needs tensorboard: pip install "
                                  "tensorboard") from err
            self.tensorboard = SummaryWriter(lg.tensorboard_dir)

    def _init_wandb(self, n_matmul: int) -> None:
        lg = self.cfg.logging
        mode, why = resolve_wandb_mode(lg.wandb_mode, os.environ)
        if mode == "disabled":
            return
        try:
            import wandb  # lazy: slow to import and only the logging rank needs it
        except ImportError as err:
            raise ConfigError("--wandb-project needs wandb: pip install wandb (or pass "
                              "--wandb-mode disabled)") from err
        derived = {"world_size": self.pstate.world_size, "matmul_params": n_matmul,
                   "flops_per_token": self.flops_per_token,
                   "flops_per_token_causal": self.flops_per_token_causal,
                   "peak_tflops": self.peak_tflops, "hosts": sorted(set(self.hosts))}
        if lg.wandb_save_dir:
            Path(lg.wandb_save_dir).mkdir(parents=True, exist_ok=True)
        self.wandb = wandb.init(project=lg.wandb_project, name=lg.wandb_exp_name,
                                dir=lg.wandb_save_dir, mode=mode,
                                config={**self.cfg.to_dict(), "derived": derived})
        self.wandb.define_metric("loss", summary="min")
        self.wandb.define_metric("eval_loss", summary="min")
        if mode == "offline":
            run_dir = Path(self.wandb.dir).parent
            self.wandb_sync_hint = f"wandb sync {run_dir}"
            print(f"wandb: offline ({why}); upload later with `{self.wandb_sync_hint}`",
                  flush=True)

    def _write(self, record: dict, extra: dict | None = None) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(self._tagged(record)) + "\n")
        if self.wandb is not None:
            values = {k: v for k, v in record.items() if k != "iteration"}
            self.wandb.log({**values, **(extra or {})}, step=record["iteration"])
        if self.tensorboard is not None:
            step = record["iteration"]
            for name, value in tensorboard_scalars(self.cfg.logging, {**record, **(extra or {})}
                                                   ).items():
                self.tensorboard.add_scalar(name, value, step)
            self.tensorboard.flush()

    def _tagged(self, record: dict) -> dict:
        """The JSONL copy of `record`, with the Slurm job that wrote it (a run's one file
        gathers every job's records; unattended.py reads them across jobs)."""
        return {**record, "job": self.job} if self.job else record

    def log_train(self, step: StepRecord) -> dict:
        """One log interval (`StepRecord`: means over it). A collective: this rank's compute
        time, peak memory and waits are gathered from every rank, for the spread, the
        straggler check and the waits in the record (the largest over all ranks, the one
        that held the step up). `tokens_seen` and `epoch` come from `consumed_samples`, the
        global position a checkpoint restores (samples of skipped steps count: they were
        consumed). Returns the JSONL record (on every rank)."""
        mem = memory_stats(self.pstate.device)
        own = step.iter_time_s if step.compute_time_s is None else step.compute_time_s
        gathered = _gather_floats([own, _peak_gib(mem), step.data_wait_s, step.comm_wait_s],
                                  self.pstate)
        tokens_seen = step.consumed_samples * self.cfg.model.seq_length
        epoch = (step.consumed_samples / self.samples_per_epoch if self.samples_per_epoch
                 else float("nan"))
        tokens_per_sec = step.tokens / step.iter_time_s
        tflops = tokens_per_sec * self.flops_per_token / self.pstate.world_size / 1e12
        causal = tflops * self.flops_per_token_causal / self.flops_per_token
        record = {"iteration": step.iteration, "consumed_samples": step.consumed_samples,
                  "loss": step.loss, "lr": step.lr, "grad_norm": step.grad_norm,
                  "iter_time_ms": step.iter_time_s * 1e3, "tokens_per_sec": tokens_per_sec,
                  "tflops_per_device": tflops, "mfu": tflops / self.peak_tflops,
                  "data_wait_ms": max(g[2] for g in gathered) * 1e3,
                  "comm_wait_ms": max(g[3] for g in gathered) * 1e3,
                  "tokens_seen": tokens_seen, "epoch": epoch}
        if step.global_batch_size is not None:
            record["global_batch_size"] = step.global_batch_size
        record.update(step.scalars)
        if not self.enabled:
            return record
        times = [g[0] for g in gathered]
        spread = rank_spread(times, self.hosts)
        mem_peak = max(range(len(gathered)), key=lambda r: gathered[r][1])
        line = self._train_line(step, record, causal) + f" | mem {_format_memory(mem)}"
        if len(times) > 1:
            line += (f" | max mem {gathered[mem_peak][1]:.2f} GiB (rank {mem_peak}) | rank fwd-bwd"
                     f" ms min/med/max {spread.min_s * 1e3:.1f}/{spread.median_s * 1e3:.1f}/"
                     f"{spread.max_s * 1e3:.1f} (slowest rank {spread.slowest_rank} on "
                     f"{spread.slowest_host})")
        print(line, flush=True)
        self._warn_stragglers(times)
        self._write(record, {
            "tflops_per_device_causal": causal, "mfu_causal": causal / self.peak_tflops,
            "skipped_iterations": step.skipped, **{f"memory/{k}": v for k, v in mem.items()},
            "memory/max_over_ranks_gib": gathered[mem_peak][1],
            "rank_time/min_ms": spread.min_s * 1e3, "rank_time/median_ms": spread.median_s * 1e3,
            "rank_time/max_ms": spread.max_s * 1e3, "rank_time/slowest_rank": spread.slowest_rank})
        return record

    def _train_line(self, step: StepRecord, record: dict, causal: float) -> str:
        """The step line up to the memory column."""
        batch = "" if step.global_batch_size is None else f"batch {step.global_batch_size} | "
        return (f"iter {step.iteration:>6}/{self.cfg.train.train_iters} | loss {step.loss:.4f} | "
                + "".join(f"{k} {record[k]:.4f} | " for k in (*DISTILL_TERMS, *MOE_TERMS)
                          if k in record)
                + f"{batch}lr {step.lr:.3e} | grad norm {step.grad_norm:.3f} | "
                f"{step.iter_time_s * 1e3:.1f} ms | {record['tokens_per_sec']:,.0f} tok/s | "
                f"{record['tflops_per_device']:.4g} TFLOP/s/dev (causal {causal:.4g}) | "
                f"MFU {100 * record['mfu']:.3g}% (causal {100 * causal / self.peak_tflops:.3g}%) | "
                f"data wait {record['data_wait_ms']:.1f} ms | comm wait "
                f"{record['comm_wait_ms']:.1f} ms | epoch {record['epoch']:.4g} "
                f"({record['tokens_seen']:,} tokens) | skipped {step.skipped}")

    def _warn_stragglers(self, times: list[float]) -> None:
        median = statistics.median(times)
        for rank, excess, streak in self.stragglers.update(times):
            print(f"warning: straggler: rank {rank} on host {self.hosts[rank]} has been "
                  f"{100 * excess:.0f}% slower than the median rank for {streak} log intervals "
                  f"(forward-backward {times[rank] * 1e3:.1f} ms vs {median * 1e3:.1f} ms; "
                  f"threshold {100 * self.stragglers.threshold:.0f}%); every other rank waits "
                  f"for it at the gradient all-reduce. Check that node's clocks/thermals, other "
                  f"processes on it, and its data loading.", flush=True)

    def log_event(self, record: dict) -> None:
        """A reliability event (`{"event", "iteration", "time", ...}`, reliability/guard.py):
        one JSONL line as it is, and wandb `events/<name>` = 1 with its numbers."""
        if not self.enabled:
            return
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(self._tagged(record)) + "\n")
        if self.wandb is not None:
            name = record["event"]
            numbers = {f"events/{name}/{k}": v for k, v in record.items()
                       if isinstance(v, int | float) and not isinstance(v, bool)
                       and k not in ("iteration", "time")}
            self.wandb.log({f"events/{name}": 1, **numbers}, step=record["iteration"])

    def log_eval(self, iteration: int, eval_loss: float, split: str = "eval") -> None:
        """An evaluation's loss; `split` "test" for the test set after training."""
        if not self.enabled:
            return
        ppl = math.exp(min(eval_loss, 50.0))
        print(f"{split} at iter {iteration} | {split} loss {eval_loss:.4f} | {split} ppl "
              f"{ppl:.3f}", flush=True)
        self._write({"iteration": iteration, f"{split}_loss": eval_loss, f"{split}_ppl": ppl})

    def log_checkpoint(self, iteration: int, seconds: float, gbytes: float) -> None:
        """Checkpoint save time and size (the checkpoint code calls this on every rank)."""
        if not self.enabled:
            return
        rate = gbytes / seconds if seconds > 0 else float("inf")
        print(f"checkpoint at iter {iteration} | saved {gbytes:.3f} GB in {seconds:.2f} s "
              f"({rate:.2f} GB/s)", flush=True)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(self._tagged({
                "iteration": iteration, "checkpoint_save_s": seconds,
                "checkpoint_gbytes": gbytes})) + "\n")
        if self.wandb is not None:
            self.wandb.log({"checkpoint/save_s": seconds, "checkpoint/gbytes": gbytes,
                            "checkpoint/gbytes_per_s": rate}, step=iteration)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
            if self.wandb_sync_hint:
                print(f"wandb: offline run saved; upload with `{self.wandb_sync_hint}`",
                      flush=True)


DISTILL_TERMS = ("total loss", "logits distillation loss", "intermediate distillation loss")
"""A distillation run's losses beside `loss` (the LM loss), Megatron's names (distill.py)."""

MOE_TERMS = ("load_balancing_loss", "z_loss", "moe_load_imbalance")
"""A MoE run's step values (layers/moe.py `MoEStep.end`): the router losses without their
coefficients and max / mean routed tokens per expert, each averaged over the MoE layers."""


def tensorboard_scalars(lg: LoggingConfig, record: dict) -> dict[str, float]:
    """The record's values that go to TensorBoard, under their JSONL names: losses, LR, grad
    norm, batch and position always; train records only every --tensorboard-log-interval;
    timers, memory, throughput and perplexity when their --log-*-to-tensorboard flag asks."""
    iteration = record["iteration"]
    if "loss" in record and iteration % lg.tensorboard_log_interval:
        return {}
    wanted = {"loss", "lr", "grad_norm", "global_batch_size", "consumed_samples",
              "skipped_iterations", "params_norm", "num_zeros_in_grad", "eval_loss",
              "test_loss", "tokens_seen", "epoch", *DISTILL_TERMS, *MOE_TERMS}
    prefixes = tuple(p for flag, group in (
        (lg.log_timers_to_tensorboard, ("iter_time_ms", "rank_time/", "data_wait_ms",
                                        "comm_wait_ms")),
        (lg.log_memory_to_tensorboard, ("memory/",)),
        (lg.log_throughput, ("tokens_per_sec", "tflops_per_device", "mfu")),
        (lg.log_validation_ppl_to_tensorboard, ("eval_ppl", "test_ppl"))) if flag for p in group)
    return {k: float(v) for k, v in record.items()
            if isinstance(v, int | float) and (k in wanted or k.startswith(prefixes))}


def _format_memory(mem: dict[str, float]) -> str:
    if "max_allocated_gib" in mem:
        return (f"max allocated {mem['max_allocated_gib']:.2f} GiB, max reserved "
                f"{mem['max_reserved_gib']:.2f} GiB")
    return f"rss {mem['rss_gib']:.2f} GiB (peak {mem['max_rss_gib']:.2f})"
