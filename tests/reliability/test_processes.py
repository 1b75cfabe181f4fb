"""Faults that kill or stall whole processes: a rank SIGKILLed mid-save, a torchrun restart,
a hang. Each launches real processes; the losses are compared bit for bit with the
uninterrupted in-process baseline (same config, same schedule)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from megatron_lite.reliability import FAULT_ENV, HANG_EXIT_CODE
from tests.reliability.common import BASE, ROOT, TINY, jsonl_losses, torchrun

PG_TIMEOUT_S = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_plain_ranks(flags: list[str], fault: str, timeout: float = 120
                     ) -> tuple[list[int], list[float], str]:
    """Two `python pretrain.py` processes (no torchrun, so nothing kills the survivor for
    us): return codes, exit times (monotonic seconds) and the combined output."""
    port = str(_free_port())
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


def test_rank_killed_during_save_then_resume(runs, tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed while writing the checkpoint of iteration 15 (saves every 5): the
    survivor exits non-zero within the collective timeout + 10 s, the partial checkpoint is
    skipped with a message, and the resume from iteration 10 reproduces iterations 11-20."""
    baseline = runs[0][0]["baseline"].losses
    save, log = tmp_path / "ckpt", tmp_path / "m.jsonl"
    flags = [*BASE, "--save", str(save), "--log-jsonl", str(log),
             "--distributed-timeout-minutes", str(PG_TIMEOUT_S / 60)]
    codes, ended, output = _two_plain_ranks(flags, "rank1:iter15:kill_in_save")
    assert codes[1] == -9 and codes[0] not in (0, None), (codes, output[-3000:])
    assert ended[0] - ended[1] < PG_TIMEOUT_S + 10
    assert (save / "latest").read_text().strip() == "iter_0000010"
    partial = save / "iter_0000015.tmp"
    assert partial.is_dir() and not (partial / "metadata.json").exists()

    resumed = torchrun(flags)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"checkpoint: skipping partial {partial}" in resumed.output
    assert "checkpoint: loaded iteration 10" in resumed.output
    losses = jsonl_losses(log)
    assert [losses[i] for i in range(11, 21)] == baseline[10:20]


def test_torchrun_restart_reforms_group_and_matches(runs, tmp_path: Path) -> None:
    """torchrun --max-restarts 1; rank 1 dies at iteration 13 of attempt 0 only. Attempt 1
    re-forms the gloo group (store prefixed by the restart count), resumes from iteration 10
    and finishes with the uninterrupted losses."""
    baseline = runs[0][0]["baseline"].losses
    log = tmp_path / "m.jsonl"
    out = torchrun([*BASE, "--save", str(tmp_path / "ckpt"), "--log-jsonl", str(log)],
                   fault="rank1:iter13:exit", max_restarts=1, timeout=180)
    assert out.returncode == 0, out.output[-3000:]
    assert "fault injection: rank 1 iteration 13: exit" in out.output
    assert "checkpoint: loaded iteration 10" in out.output
    losses = jsonl_losses(log)
    assert [losses[i] for i in range(1, 21)] == baseline


def test_hang_is_detected_with_stacks(tmp_path: Path) -> None:
    """Rank 1 hangs at iteration 3: the watchdog on each rank dumps every thread's stack and
    exits with HANG_EXIT_CODE after --hang-timeout-seconds; the run ends, it does not hang."""
    timeout_s = 8
    out = torchrun(["--train-iters", "6", "--hang-timeout-seconds", str(timeout_s),
                    "--distributed-timeout-minutes", "1"], fault="rank1:iter3:hang",
                   timeout=90)
    assert out.returncode != 0
    assert f"exitcode  : {HANG_EXIT_CODE}" in out.output, out.output[-3000:]
    for rank in (0, 1):
        assert f"hang watchdog: rank {rank} on host" in out.output, out.output[-3000:]
    assert "iteration 3: phase 'forward-backward'" in out.output
    assert "in before_step" in out.output  # rank 1's own stack shows where it is stuck
    assert "in all_reduce_" in out.output  # rank 0 waits for it in a collective
    assert "Thread 0x" in out.output or "Current thread 0x" in out.output
    assert out.seconds < 60
