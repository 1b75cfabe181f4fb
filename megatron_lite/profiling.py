"""What runs around each training step besides the step: the profiler window, Python's
garbage collector on a fixed schedule, and returning cached CUDA memory.

`--profile` records iterations [--profile-step-start, --profile-step-end) on each rank of
--profile-ranks with torch.profiler (CPU and, with a GPU, CUDA activities) and writes one
Chrome trace per rank, `trace_rank<R>.json`, into --profile-dir (default --tensorboard-dir);
it loads in chrome://tracing or Perfetto. `--manual-gc` turns the automatic collector off and
collects every --manual-gc-interval steps on every rank at the same step: an automatic
collection starts whenever one rank's allocation count says so, and a rank that collects
alone stalls every collective waiting for it.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from megatron_lite.config import Config


class StepHooks:
    """Called by the training loop before and after each step, and around evaluations."""

    def __init__(self, cfg: Config, rank: int, device: torch.device) -> None:
        lg, train = cfg.logging, cfg.train
        self.cfg, self.rank, self.cuda = cfg, rank, device.type == "cuda"
        self.trace_dir = Path(lg.profile_dir or lg.tensorboard_dir or ".")
        self.profiling = lg.profile and (not lg.profile_ranks or rank in lg.profile_ranks)
        self.profiler: torch.profiler.profile | None = None
        if train.manual_gc:
            gc.disable()
            gc.collect()

    def before_step(self, iteration: int) -> None:
        lg = self.cfg.logging
        if self.profiling and iteration == lg.profile_step_start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()

    def after_step(self, iteration: int) -> None:
        train = self.cfg.train
        if self.profiler is not None and iteration + 1 >= self.cfg.logging.profile_step_end:
            self.stop_profiler()
        interval = train.manual_gc_interval
        if train.manual_gc and interval and iteration % interval == 0:
            gc.collect()
        if self.cuda and train.empty_unused_memory_level >= 1:
            torch.cuda.empty_cache()

    def after_evaluation(self) -> None:
        if self.cfg.train.manual_gc:
            gc.collect()
        if self.cuda and self.cfg.train.empty_unused_memory_level >= 2:
            torch.cuda.empty_cache()

    def stop_profiler(self) -> None:
        """Write this rank's trace (also when the run ends inside the window)."""
        if self.profiler is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        path = self.trace_dir / f"trace_rank{self.rank}.json"
        self.profiler.export_chrome_trace(str(path))
        self.profiler = None
        print(f"profiler: rank {self.rank} wrote {path}", flush=True)

    def close(self) -> None:
        self.stop_profiler()
        if self.cfg.train.manual_gc:
            gc.enable()
