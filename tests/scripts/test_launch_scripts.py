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
from megatron_lite.data.format import write_manifest

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


def _dry_run_argv(script: str, tmp_path: Path, **extra: str) -> list[str]:
    """The command line a script's DRY_RUN mode execs ($PYTHON: a stub that records it)."""
    argv_file, stub = tmp_path / "argv", tmp_path / "python"
    stub.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {argv_file}\n')
    stub.chmod(0o755)
    env = {k: v for k, v in _env(tmp_path, DRY_RUN="0", PYTHON=str(stub), **extra).items()
           if k not in ("DATA_MANIFEST", "DATA_PATH", "TOKENIZER_MODEL")
           or k in extra}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    program, *argv = argv_file.read_text().splitlines()
    assert program == "pretrain.py"
    return argv


@pytest.mark.parametrize("script", SBATCH_SCRIPTS)
def test_dry_run_keeps_the_data_checkpoint_and_logging_flags(script, tmp_path):
    """DRY_RUN= passes the script's own --save/--async-save, --log-jsonl directory and data
    flags; the node-local staged path becomes the shared manifest it is staged from, and the
    dry run's records go beside the run's metrics.jsonl, never over it."""
    manifest = tmp_path / "corpus" / "train.manifest.json"
    argv = _dry_run_argv(script, tmp_path, DATA_MANIFEST=str(manifest),
                         LOCAL_DATA_DIR="/local/data")
    args = build_parser().parse_args(argv)  # exits on an unknown flag
    run = tmp_path / "run"
    assert getattr(args, "data.data_path") == [str(manifest)]
    assert getattr(args, "data.data_sharding") == "node-local"
    assert getattr(args, "checkpoint.save") == str(run / "checkpoints")
    assert getattr(args, "logging.log_jsonl") == str(run / "dry_run.jsonl")
    assert "--async-save" in argv and "--save-interval" in argv and "--log-interval" in argv
    assert getattr(args, "model.vocab_size") == 128256  # no TOKENIZER_MODEL: the assumed vocab
    assert "--tokenizer-model" not in argv and "--dry-run" in argv


def test_dry_run_checks_the_scripts_paths_without_reading_shards(tmp_path):
    """The 8B script's dry-run flags: a manifest whose shards are on the nodes passes; a
    missing manifest, a missing tokenizer and a RUN_DIR that cannot be created are each named
    by flag (before any rank runs); without data the dry run reads mock batches."""
    from megatron_lite.arguments import parse_config
    from megatron_lite.dry_run import data_problems, output_problems

    manifest = tmp_path / "corpus" / "train.manifest.json"
    manifest.parent.mkdir()
    write_manifest(manifest, {"shards": [{"prefix": "train_0"}], "total_tokens": 10,
                              "total_documents": 1})
    cfg = parse_config(_dry_run_argv("pretrain_llama_8b.sh", tmp_path,
                                     DATA_MANIFEST=str(manifest)))
    assert data_problems(cfg) == [] and output_problems(cfg) == []
    blocked = tmp_path / "a_file"
    blocked.touch()
    cfg = parse_config(_dry_run_argv("pretrain_llama_8b.sh", tmp_path,
                                     DATA_MANIFEST=str(tmp_path / "gone.manifest.json"),
                                     TOKENIZER_MODEL=str(tmp_path / "no.model"),
                                     RUN_DIR=str(blocked / "run")))
    data = data_problems(cfg)
    assert data[0].startswith(f"--tokenizer-model {tmp_path / 'no.model'}: no such file")
    assert data[1].startswith(f"--data-path {tmp_path / 'gone.manifest.json'}:") and len(data) == 2
    out = output_problems(cfg)
    assert [p.split(" ")[0] for p in out] == ["--save", "--wandb-save-dir", "--log-jsonl"]
    assert all(f"{blocked} is not a writable directory" in p for p in out)
    cfg = parse_config(_dry_run_argv("pretrain_llama_8b.sh", tmp_path))
    assert cfg.data.mock_data and data_problems(cfg) == []


def test_dry_run_of_a_script_saves_on_meta_and_leaves_the_run_alone(tmp_path):
    """The 125M script's DRY_RUN on rank 0, as a real process, with its own --save
    --async-save, --hang-timeout-seconds and --log-jsonl: the rank's iteration assembles the
    checkpoint on meta (phase `checkpoint`), the manifest's absent shards are not read, and
    the run directory gains only dry_run.jsonl (the run's metrics.jsonl is left as it was)."""
    manifest = tmp_path / "corpus" / "train.manifest.json"
    manifest.parent.mkdir()
    write_manifest(manifest, {"shards": [{"prefix": "train_0"}], "total_tokens": 10,
                              "total_documents": 1})
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 7, "loss": 3.0}\n')
    env = {k: v for k, v in _env(tmp_path, DRY_RUN="0", DATA_MANIFEST=str(manifest)).items()
           if k != "TOKENIZER_MODEL"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "pretrain_llama_125m.sh")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "data flags ok" in proc.stdout
    (record,) = [json.loads(line) for line in (run / "dry_run.jsonl").read_text().splitlines()]
    assert record["rank"] == 0 and "checkpoint" in record["phases"], record
    assert record["data_errors"] == []
    assert sorted(p.name for p in run.iterdir()) == ["dry_run.jsonl", "metrics.jsonl"]
    assert (run / "metrics.jsonl").read_text() == '{"iteration": 7, "loss": 3.0}\n'
