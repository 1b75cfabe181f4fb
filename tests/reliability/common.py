"""Shared setup for the reliability tests: a tiny model, runs in-process on gloo ranks
(`tests.distributed.run_ranks`) or under torchrun as a subprocess, and loss readers."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_lite.arguments import parse_config
from megatron_lite.data.format import ShardWriter, shard_name, write_manifest
from megatron_lite.reliability import FAULT_ENV
from megatron_lite.training import train

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "97", "--make-vocab-size-divisible-by", "8",
        "--micro-batch-size", "2", "--lr", "2e-3", "--eval-iters", "0", "--peak-tflops", "1",
        "--log-interval", "1"]
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


def bad_corpora(root: Path) -> dict[str, Path]:
    """Two 2-shard corpora for TINY's vocabulary of 97: shard 1 of "ids" holds token ids up
    to 499 under a manifest that claims 97 (only the ids can tell); "truncated" has one token
    cut off the end of shard 1's .bin. Returns name -> the file the error must name."""
    rng = np.random.default_rng(0)
    bad = {}
    for name, top in (("ids", 500), ("truncated", 97)):
        prefix = root / name
        entries = []
        for s in range(2):
            writer = ShardWriter(shard_name(prefix, s), np.uint16)
            for _ in range(20):
                hi = top if s == 1 else 97  # shard 0 is fine: the error must name shard 1
                doc = np.append(rng.integers(3, hi, size=int(rng.integers(2, 30))), 2)
                writer.add_documents(doc, np.array([len(doc)]))
            entries.append(writer.finalize())
        write_manifest(f"{prefix}.manifest.json", {
            "shards": entries, "total_documents": 40, "tokenizer": {"vocab_size": 97, "eod_id": 2},
            "total_tokens": sum(e["tokens"] for e in entries)})
        bad[name] = Path(shard_name(prefix, 1) + ".bin")
    with open(bad["truncated"], "r+b") as f:
        f.truncate(bad["truncated"].stat().st_size - 2)
    return bad


def run_train(pstate, flags: list[str], fault: str | None = None) -> Outcome:
    """Train on `pstate`, capturing what this rank prints; errors are returned, not raised.
    With `--data-path` in `flags` the run uses it instead of mock data."""
    out = io.StringIO()
    if fault:
        os.environ[FAULT_ENV] = fault
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            base = [f for f in TINY if f != "--mock-data" or "--data-path" not in flags]
            result = train(parse_config([*base, *flags]), pstate)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_plain_ranks(flags: list[str], fault: str, timeout: float = 120
                     ) -> tuple[list[int], list[float], str]:
    """Two `python pretrain.py` processes (no torchrun, so nothing kills the survivor for
    us): return codes, exit times (monotonic seconds) and the combined output."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, FAULT_ENV: fault}
        procs.append(subprocess.Popen([sys.executable, "pretrain.py", *TINY, *flags], cwd=ROOT,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    ended: list[float | None] = [None, None]
    deadline = time.monotonic() + timeout
    while None in ended and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    output = "".join(p.communicate()[0] for p in procs)
    assert None not in ended, f"a rank did not exit within {timeout} s:\n{output[-3000:]}"
    return [p.returncode for p in procs], ended, output  # type: ignore[return-value]
