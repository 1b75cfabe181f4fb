"""The launch scripts under fake Slurm: stub srun/sbatch/scontrol on PATH, 2 nodes x 2 tasks on
localhost (127.0.0.1 and 127.0.0.2), gloo, tiny sizes through MEGATRON_LITE_TINY=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lite.arguments import build_parser

ROOT = Path(__file__).resolve().parents[2]
STUBS = Path(__file__).resolve().parent / "slurm_stubs"
SBATCH_SCRIPTS = ["pretrain_llama_125m.sh", "pretrain_llama_1b.sh", "pretrain_llama_8b.sh",
                  "pretrain_llama_70b.sh", "pretrain_mixtral_8x7b.sh"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(PATH=f"{STUBS}:{env['PATH']}", PYTHON=sys.executable, MEGATRON_LITE_DIR=str(ROOT),
               RUN_DIR=str(tmp_path / "run"), FAKE_SLURM_JOB_ID="424242", WANDB_MODE="disabled",
               OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def _sbatch(script: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sbatch", "--nodes=2", "--ntasks-per-node=2", str(ROOT / "scripts" / script)],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=240,
    )


# Tiny mode swaps in the same arrays for every script, so two training runs (the TP+SP and the
# TP+PP scripts) cover the shared path; every script's own full-size flags are checked below.
@pytest.mark.slow
@pytest.mark.parametrize("script", ["pretrain_llama_8b.sh", "pretrain_llama_70b.sh"])
def test_sbatch_script_trains_under_fake_slurm(script, tmp_path):
    proc = _sbatch(script, _env(tmp_path, MEGATRON_LITE_TINY="1"), tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # pretrain.py resolved the Slurm variables itself (no torchrun) into the 2x2 grid, TP innermost.
    assert "launch: slurm, world size 4, backend gloo" in out, out[-4000:]
    assert "dp0:tp[0, 1]  dp1:tp[2, 3]" in out
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if "loss" in r]
    assert [r["iteration"] for r in train] == [1, 2]
    assert all(0 < r["loss"] < 20 for r in train)
    info = (tmp_path / "run" / "run_info.txt").read_text()
    assert "SLURM_JOB_NODELIST=127.0.0.[1-2]" in info and "git: " in info


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.quick)
                                    if s == "pretrain_llama_1b.sh" else s
                                    for s in SBATCH_SCRIPTS])
def test_full_size_commands(script, tmp_path):
    """Full-size flags all exist in pretrain.py; staging runs one task per node before training."""
    record = tmp_path / "srun.jsonl"
    manifest = "/shared/corpus/train.manifest.json"
    env = _env(tmp_path, FAKE_SRUN_ECHO=str(record), DATA_MANIFEST=manifest,
               LOCAL_DATA_DIR="/local/data", TOKENIZER_MODEL="/shared/tok.model")
    proc = _sbatch(script, env, tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    stage, train = (json.loads(line) for line in record.read_text().splitlines())
    assert (stage["nodes"], stage["ntasks_per_node"]) == (2, 1)
    assert stage["argv"][1:4] == ["-m", "data_tools.stage", "--manifest"]
    assert stage["argv"][4] == manifest and "--gpus-per-node" in stage["argv"]
    assert train["ntasks_per_node"] == 2 and train["argv"][1:3] == ["-u", "pretrain.py"]
    args = build_parser().parse_args(train["argv"][3:])  # exits on an unknown flag
    assert getattr(args, "data.data_path") == ["/local/data/train"]
    assert getattr(args, "data.tokenizer_model") == "/shared/tok.model"
    assert getattr(args, "logging.log_jsonl") == str(tmp_path / "run" / "metrics.jsonl")


def test_tiny_cpu_script_runs_here(tmp_path):
    env = _env(tmp_path, TRAIN_ITERS="2", EXTRA_ARGS="--eval-iters 1 --log-interval 1")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "pretrain_llama_tiny_cpu.sh")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "launch: torchrun, world size 2" in out, out[-4000:]
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["iteration"] for r in rows if '"loss"' in r] == [1, 2]
