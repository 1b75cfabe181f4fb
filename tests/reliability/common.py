"""Shared setup for the reliability tests: a tiny model, runs in-process on gloo ranks
(`tests.distributed.run_ranks`) or under torchrun as a subprocess, and loss readers."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_lite.arguments import parse_config
from megatron_lite.reliability import FAULT_ENV
from megatron_lite.training import train

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "97", "--make-vocab-size-divisible-by", "8",
        "--micro-batch-size", "2", "--lr", "2e-3", "--eval-iters", "0", "--peak-tflops", "1"]
"""Two DP ranks, global batch 4 samples."""
BASE = ["--train-iters", "20", "--save-interval", "5"]
"""The uninterrupted reference run (and the interrupted ones' schedule)."""
CORRUPTED = "optim_tp0_pp0_dp0.safetensors"
"""Hashed by rank 1 of 2 (files are shared out in name order): rank 0 learns of it only
through the agreement."""


@dataclass
class Outcome:
    """One in-process training run on one rank."""

    losses: list[float]
    iteration: int
    output: str
    """Everything the run printed (stdout and stderr) on this rank."""
    error: str | None = None


def run_train(pstate, flags: list[str], fault: str | None = None) -> Outcome:
    """Train on `pstate`, capturing what this rank prints; errors are returned, not raised."""
    out = io.StringIO()
    if fault:
        os.environ[FAULT_ENV] = fault
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            result = train(parse_config([*TINY, *flags]), pstate)
        return Outcome(result.losses, result.iteration, out.getvalue())
    except Exception as e:  # the scenario decides whether an error is expected
        return Outcome([], -1, out.getvalue(), f"{type(e).__name__}: {e}")
    finally:
        os.environ.pop(FAULT_ENV, None)


def jsonl_losses(path: Path) -> dict[int, float]:
    """iteration -> loss; a re-run iteration (after a restart) keeps its last value."""
    out = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["iteration"]] = record["loss"]
    return out


@dataclass
class Launch:
    returncode: int
    output: str
    seconds: float


def torchrun(flags: list[str], *, fault: str | None = None, max_restarts: int = 0,
             timeout: float = 120) -> Launch:
    """`torchrun --standalone --nproc_per_node 2 pretrain.py TINY+flags` as a subprocess."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(FAULT_ENV, None)
    if fault:
        env[FAULT_ENV] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--max-restarts={max_restarts}", "pretrain.py", *TINY, *flags]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return Launch(proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start)
