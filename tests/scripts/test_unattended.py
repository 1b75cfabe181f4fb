"""A run carries itself across Slurm jobs: fake Slurm (SLURM_* variables, stub srun/scontrol and
an sbatch that records its arguments), one CPU process per job, the 8B script in tiny mode.

Job 1001 stops at iteration 10 (SIGTERM, as at the time limit) and resubmits itself once; job
1002 of the same script resumes at 11, and its losses equal an uninterrupted run's. A hang that
names the host resubmits with --exclude of it; a failure repeated at one iteration stops; a
rank frozen under srun is killed by its peer's watchdog and its host excluded."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lite.arguments import parse_with_notes
from megatron_lite.reliability.heartbeat import PEER_LOST_EXIT_CODE
from megatron_lite.training import run
from megatron_lite.unattended import goodput, read_records
from tests.numerics import EXACT

ROOT = Path(__file__).resolve().parents[2]
STUBS = Path(__file__).resolve().parent / "unattended_stubs"
SCRIPT = ROOT / "scripts" / "pretrain_llama_8b.sh"
ITERS = 20


def _env(tmp_path: Path, job: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "MEGATRON_LITE_FAULT"))}
    env.update(PATH=f"{STUBS}:{env['PATH']}", PYTHON=sys.executable, MEGATRON_LITE_DIR=str(ROOT),
               RUN_DIR=str(tmp_path / "run"), FAKE_SBATCH_RECORD=str(tmp_path / "sbatch.jsonl"),
               SLURM_JOB_ID=job, SLURM_NNODES="1", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1",
               SLURM_JOB_NODELIST="127.0.0.1", FAKE_SLURM_HOSTS="127.0.0.1",
               MEGATRON_LITE_TINY="1", TINY_TP="1", TINY_ITERS=str(ITERS), PREFLIGHT="off",
               EXTRA_ARGS="--fp64 --eval-iters 0", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    env.update(extra)
    return env


def _job(tmp_path: Path, job: str, **extra: str) -> str:
    proc = subprocess.run(["bash", str(SCRIPT)], env=_env(tmp_path, job, **extra), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    return proc.stdout + proc.stderr


def _sbatch_calls(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "sbatch.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _reference_losses(tmp_path: Path) -> list[float]:
    """The same script's command line (srun echoes it), trained uninterrupted in this process."""
    echo = tmp_path / "srun.jsonl"
    (tmp_path / "ref").mkdir()
    _job(tmp_path / "ref", "999", FAKE_SRUN_ECHO=str(echo))
    argv = json.loads(echo.read_text().splitlines()[0])["argv"][3:]
    cfg, _, _ = parse_with_notes(argv)
    cfg.checkpoint.save = None
    cfg.logging.log_jsonl = None
    return run(cfg).losses


def test_time_limit_resubmits_once_and_the_next_job_resumes_exactly(tmp_path):
    out = _job(tmp_path, "1001", MEGATRON_LITE_FAULT="rank0:iter10:sigterm", PREFLIGHT="quick")
    assert "preflight: ok on host" in out, out[-3000:]
    calls = _sbatch_calls(tmp_path)
    assert calls == [["--dependency=afterany:1001", str(SCRIPT)]], out[-3000:]
    out2 = _job(tmp_path, "1002")
    assert _sbatch_calls(tmp_path) == calls, out2[-3000:]  # done: no further resubmission
    assert "unattended: stop: training done at iteration 20" in out2
    records = read_records(tmp_path / "run" / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert [(r["job"], r["iteration"]) for r in train] == (
        [("1001", i) for i in range(1, 11)] + [("1002", i) for i in range(11, 21)])
    reference = _reference_losses(tmp_path)
    assert len(reference) == ITERS
    for record, expected in zip(train, reference, strict=True):
        assert abs(record["loss"] - expected) <= EXACT * abs(expected), record
    resume = [r for r in records if r.get("event") == "resume"]
    assert len(resume) == 1 and resume[0]["job"] == "1002"
    assert (resume[0]["iteration"], resume[0]["resumed_from"], resume[0]["iterations_lost"]) \
        == (11, 10, 0)
    assert resume[0]["downtime_s"] > 0
    log = (tmp_path / "run" / "train.log").read_text()
    assert "resume: from the checkpoint of iteration 10; 0 iterations lost" in log
    ends = [r for r in records if r.get("event") == "job_end"]
    assert [e["job"] for e in ends] == ["1001", "1002"]
    # goodput: the 20 kept steps' times over both jobs' allocations, independently summed
    steps = sum(r["iter_time_ms"] for r in train) / 1e3
    allocated = sum(e["allocated_s"] for e in ends)
    assert ends[-1]["run_goodput"] == pytest.approx(steps / allocated, rel=1e-9)
    assert 0 < ends[-1]["run_goodput"] < 1
    assert log.count("goodput: ") == 2 and f"{100 * steps / allocated:.1f}%" in log


def test_failure_naming_a_host_resubmits_without_it(tmp_path):
    out = _job(tmp_path, "1001", MEGATRON_LITE_FAULT="rank0:iter3:hang", TINY_ITERS="6",
               EXTRA_ARGS="--fp64 --eval-iters 0 --hang-timeout-seconds 1")
    host = socket.gethostname()
    assert f"hang watchdog: rank 0 on host {host}" in out, out[-3000:]
    assert _sbatch_calls(tmp_path) == [["--dependency=afterany:1001", f"--exclude={host}",
                                        str(SCRIPT)]], out[-3000:]
    assert (tmp_path / "run" / "exclude_hosts").read_text().split() == [host]
    records = read_records(tmp_path / "run" / "metrics.jsonl")
    failure = [r for r in records if r.get("event") == "failure"]
    assert [(f["iteration"], f["rc"], f["hosts"]) for f in failure] == [(2, 3, [host])]


def test_failure_repeated_at_one_iteration_stops(tmp_path):
    out = _job(tmp_path, "1001", MEGATRON_LITE_FAULT="rank0:iter3:exit", TINY_ITERS="6",
               TINY_SAVE_INTERVAL="2", MAX_RESTARTS="3")
    assert "restart 1 of 3 in place" in out, out[-3000:]
    assert "the failure repeated at iteration 2" in out
    assert _sbatch_calls(tmp_path) == []
    records = read_records(tmp_path / "run" / "metrics.jsonl")
    assert [r["iteration"] for r in records if r.get("event") == "failure"] == [2, 2]
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2]  # the restart resumed at 3
    assert goodput(records)[1] > 0


def test_frozen_rank_under_srun_is_killed_and_its_host_excluded(tmp_path):
    """Two ranks under LAUNCHER=srun (only SLURM_PROCID set, no RANK/MASTER_PORT); rank 1
    freezes (SIGSTOP) at iteration 3. Rank 0's watchdog names it stale and SIGKILLs it, so the
    step ends at once (a stopped task ignores srun's SIGTERM: without the kill the step would
    wait for it forever, here the 120 s timeout), and the frozen rank's host is excluded."""
    out = _job(tmp_path, "1001", MEGATRON_LITE_FAULT="rank1:iter3:stop", TINY_ITERS="6",
               SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2",
               EXTRA_ARGS="--fp64 --eval-iters 0 --hang-timeout-seconds 2")
    host = socket.gethostname()
    assert f"rank 1 (host {host}, pid" in out and "stopped answering" in out, out[-3000:]
    assert "hang watchdog: killed stale rank 1" in out, out[-3000:]
    assert (tmp_path / "run" / "exclude_hosts").read_text().split() == [host]
    assert _sbatch_calls(tmp_path) == [["--dependency=afterany:1001", f"--exclude={host}",
                                        str(SCRIPT)]], out[-3000:]


def test_dead_rank_under_srun_is_named_by_host_exits_5_and_is_excluded(tmp_path):
    """Two ranks under srun; rank 1 is SIGKILLed at iteration 3. The survivor's one error line
    names rank 1's host (from its heartbeat), the step exits PEER_LOST_EXIT_CODE (not 2, a
    user mistake) and the launch resubmits without that host instead of restarting in place."""
    out = _job(tmp_path, "1001", MEGATRON_LITE_FAULT="rank1:iter3:kill", TINY_ITERS="6",
               SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", MAX_RESTARTS="1",
               EXTRA_ARGS="--fp64 --eval-iters 0 --hang-timeout-seconds 5")
    host = socket.gethostname()
    assert f"a collective failed because rank 1 (host {host}, pid" in out, out[-3000:]
    assert f"failed (exit status {PEER_LOST_EXIT_CODE}) on a named host" in out, out[-3000:]
    assert (tmp_path / "run" / "exclude_hosts").read_text().split() == [host]
    assert _sbatch_calls(tmp_path) == [["--dependency=afterany:1001", f"--exclude={host}",
                                        str(SCRIPT)]], out[-3000:]
    failure = [r for r in read_records(tmp_path / "run" / "metrics.jsonl")
               if r.get("event") == "failure"]
    assert [(f["rc"], f["hosts"]) for f in failure] == [(PEER_LOST_EXIT_CODE, [host])]
