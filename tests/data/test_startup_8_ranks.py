"""8 gloo ranks started together by torchrun on a fresh cache over bare `.bin/.idx` shards (no
manifest, so every token id must be scanned): one rank scans each shard once and builds each
index once, a restart does neither, and the start-up phase line is in the log."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.data.test_prep import bare_shard

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "8", "--vocab-size", "97", "--make-vocab-size-divisible-by", "8",
        "--micro-batch-size", "1", "--train-iters", "1", "--eval-iters", "0",
        "--num-workers", "0", "--peak-tflops", "1", "--tokenizer-type", "NullTokenizer",
        "--ffn-hidden-size", "64"]
PHASES = re.compile(r"^startup: rendezvous [\d.]+ s, data validation [\d.]+ s, index [\d.]+ s, "
                    r"model build [\d.]+ s, checkpoint load [\d.]+ s, first step [\d.]+ s "
                    r"\(slowest of 8 ranks each\)$", re.M)


def _torchrun_8(flags: list[str]) -> str:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=8", "pretrain.py", *TINY, *flags], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
def test_8_ranks_scan_and_index_once_and_a_restart_redoes_nothing(tmp_path):
    shards = [tmp_path / "a", tmp_path / "b"]
    for i, prefix in enumerate(shards):
        bare_shard(prefix, docs=40, seed=i)
    flags = ["--data-path", "0.5", str(shards[0]), "0.5", str(shards[1]),
             "--data-cache-path", str(tmp_path / "cache")]
    out = _torchrun_8(flags)
    scanned = re.findall(r"^data: rank (\d+) scanned (\S+) ", out, re.M)
    built = re.findall(r"^data: rank (\d+) built index (\S+) ", out, re.M)
    assert sorted(path for _, path in scanned) == sorted(map(str, shards)), out[-4000:]
    assert len(built) == 2 and len({path for _, path in built}) == 2  # one per source index
    assert {rank for rank, _ in scanned + built} == {"0"}
    assert len(PHASES.findall(out)) == 1, out[-4000:]

    again = _torchrun_8(flags)
    assert "scanned" not in again and "built index" not in again, again[-4000:]
    assert len(PHASES.findall(again)) == 1
