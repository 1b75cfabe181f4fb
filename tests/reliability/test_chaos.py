"""Chaos: a 2-rank job on real shards is killed and preempted at random steps, twice, and
resumed each time; it must end exactly where an uninterrupted run ends.

Each round is one `torchrun --max-restarts 1`: on attempt 0 one worker (either rank) SIGKILLs
itself at a random iteration; torchrun restarts the group, which resumes from the last
checkpoint; on attempt 1 a worker SIGTERMs torchrun itself at another random iteration, which
forwards it: both ranks save and exit. After two rounds a last launch trains to the end. The
draws come from one seed, printed (and taken from CHAOS_SEED if set), so a failure replays.

Layout CP2 / DP1 with document masks and --async-save (a kill can land while a save is
being written), checkpoints every 4 iterations.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from megatron_lite.config import Config, ParallelConfig
from megatron_lite.data.format import ShardWriter, shard_name, write_manifest
from megatron_lite.reliability import FAULT_ENV
from tests.distributed import run_ranks
from tests.reliability.common import ROOT, TINY, run_train

ITERS, SAVE_EVERY = 24, 4
RUN = ["--train-iters", str(ITERS), "--save-interval", str(SAVE_EVERY),
       "--context-parallel-size", "2", "--reset-attention-mask", "--reset-position-ids",
       "--async-save", "--split", "100,0,0"]
FLAGS = [*(f for f in TINY if f != "--mock-data"), *RUN]


def _shards(prefix: Path) -> None:
    """Two shards of random documents over TINY's vocabulary of 97 (eod 2), with a manifest."""
    rng = np.random.default_rng(0)
    entries = []
    for s in range(2):
        writer = ShardWriter(shard_name(prefix, s), np.uint16)
        for _ in range(60):
            doc = np.append(rng.integers(3, 97, size=int(rng.integers(3, 24))), 2)
            writer.add_documents(doc, np.array([len(doc)]))
        entries.append(writer.finalize())
    write_manifest(f"{prefix}.manifest.json", {
        "shards": entries, "total_documents": 120, "tokenizer": {"vocab_size": 97, "eod_id": 2},
        "total_tokens": sum(e["tokens"] for e in entries)})


def _launch(flags: list[str], fault: str | None, log: Path) -> tuple[int, str]:
    """torchrun --max-restarts 1 of pretrain.py; returns (exit status, output)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(FAULT_ENV, None)
    if fault:
        env[FAULT_ENV] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts=1", "pretrain.py", *FLAGS, *flags, "--log-jsonl", str(log)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def _losses(log: Path) -> list[tuple[int, float]]:
    """Every (iteration, loss) record, re-runs included, in the order written."""
    return [(r["iteration"], r["loss"]) for r in map(json.loads, log.read_text().splitlines())
            if "loss" in r]


def _latest(save: Path) -> int:
    return int((save / "latest").read_text().strip().removeprefix("iter_"))


@pytest.mark.slow
def test_chaos_kills_and_preemptions_resume_bit_exact(tmp_path: Path) -> None:
    seed = int(os.environ.get("CHAOS_SEED", random.SystemRandom().randrange(1 << 20)))
    print(f"chaos seed {seed} (rerun with CHAOS_SEED={seed})")
    rng = random.Random(seed)
    _shards(tmp_path / "corpus")
    data = ["--data-path", str(tmp_path / "corpus")]

    ref_log, log, save = tmp_path / "ref.jsonl", tmp_path / "chaos.jsonl", tmp_path / "ckpt"
    # the uninterrupted run: the same two ranks in forked processes (torchrun's equal), in a
    # thread so that it uses the CPU the launches leave idle while they start
    ref_runs: list = []
    reference = threading.Thread(target=lambda: ref_runs.extend(run_ranks(
        run_train, 2, tmp_path, cfg=Config(parallel=ParallelConfig(context_parallel_size=2)),
        flags=[*RUN, *data, "--log-jsonl", str(ref_log), "--save", str(tmp_path / "ref")])))
    reference.start()
    start = 0
    for round_ in range(2):
        # attempt 0 dies at `kill`; attempt 1 resumes from the checkpoint before it and
        # is preempted at `term`
        kill = rng.randint(start + 2, start + 6)
        term = rng.randint(kill, kill + 3)  # after the resumed checkpoint (< kill): reached
        victim = rng.randrange(2)
        fault = f"rank{victim}:iter{kill}:kill,rank{rng.randrange(2)}:iter{term}:" \
                "sigterm_launcher:attempt1"
        code, out = _launch(["--save", str(save), *data], fault, log)
        print(f"round {round_}: {fault} -> exit {code}, latest {_latest(save)}")
        assert code != 0, out[-3000:]  # torchrun reports the SIGTERM as a failure
        assert f"fault injection: rank {victim} iteration {kill}: kill" in out, out[-3000:]
        # the survivor names the dead rank in one line, not a gloo traceback
        assert re.search(rf"error: rank {1 - victim}: iteration \d+, phase '[^']+': a collective "
                         rf"failed because rank {victim} \(host [^,]+, pid \d+\) has exited",
                         out), out[-3000:]
        assert "exiting cleanly after iteration" in out and \
            "exit signal received by 2 of 2 ranks" in out, out[-3000:]
        start = _latest(save)
        assert start >= term  # saved where the preemption stopped it
    code, out = _launch(["--save", str(save), *data], None, log)
    assert code == 0, out[-3000:]
    assert out.count(f"checkpoint: saved iteration {ITERS} ") == 1, out[-3000:]  # not twice
    assert f"checkpoint: loaded iteration {start} " in out
    assert "(saved with tp 1, pp 1, dp 1, cp 2)" in out, out[-3000:]
    reference.join()
    assert len(ref_runs) == 2, "the reference run failed (its error is printed above)"
    for r in ref_runs:
        assert r.error is None, r.error + r.output[-3000:]
    ref = dict(_losses(ref_log))
    assert sorted(ref) == list(range(1, ITERS + 1))
    got = _losses(log)
    assert {i for i, _ in got} >= set(ref)
    for iteration, loss in got:  # every record, re-run iterations too: bit for bit
        if iteration in ref:
            assert loss == ref[iteration], (iteration, loss, ref[iteration], seed)

    scanned = 0
    for ckpt in sorted(save.glob("iter_*")):
        if not (ckpt / "metadata.json").exists():
            continue  # a save cut short by the kill: never loaded (the resume skipped it)
        for f in ckpt.glob("*.safetensors"):
            for name, t in load_file(f).items():
                scanned += 1
                assert not t.is_floating_point() or bool(torch.isfinite(t).all()), (f, name)
    assert scanned > 0 and math.isfinite(ref[ITERS])
