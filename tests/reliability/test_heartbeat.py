"""Heartbeats: a stopped rank is named by the one whose watchdog fires, and the job ends
within the hang timeout plus a few seconds, not the timeout plus torchrun's 30 s grace."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_lite.reliability.heartbeat import Heartbeat, PeerLostError, lost_peer
from tests.reliability.common import ROOT, TINY


def _trio(store: dist.Store, interval_s: float) -> tuple[Heartbeat, Heartbeat, Heartbeat]:
    """Three ranks' heartbeats in this process (each over its own connection to `store`)."""
    return tuple(Heartbeat(dist.PrefixStore("job", store), r, 3, interval_s).start()
                 for r in range(3))  # type: ignore[return-value]


@pytest.mark.quick
def test_verdict_names_stale_stuck_and_exited_ranks() -> None:
    """Rank 1 stops beating (a frozen process) after entering a save; rank 2 beats but sits
    in one phase: rank 0's verdict names 1 as stale with its phase, 2 as stuck. A beat whose
    process has exited is named at once, without waiting out two beats."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    me, frozen, stuck = _trio(store, 0.05)
    try:
        frozen.enter("checkpoint save", 7)
        stuck.enter("reliability all-reduce", 9)
        time.sleep(0.3)
        frozen.stop()
        time.sleep(0.2)  # stuck now 0.5 s in its phase
        verdict = me.verdict(stuck_after_s=0.3)
        assert [r for r, _, _ in verdict.stale] == [1] and [b.rank for b in verdict.stuck] == [2]
        text = verdict.describe()
        host, pid = socket.gethostname(), os.getpid()
        assert (f"rank 1 (host {host}, pid {pid}) stopped answering" in text
                and "last heard from in phase 'checkpoint save' of iteration 7" in text), text
        assert (f"rank 2 (host {host}, pid {pid}) is alive but has been in phase "
                "'reliability all-reduce' of iteration 9 for") in text, text
        assert lost_peer(me, ValueError("not a collective"), 9, "x") is None

        child = subprocess.Popen(["true"])
        child.wait()  # reaped: its pid is gone
        frozen.pid, me.interval_s = child.pid, 30.0  # a 60 s wait would fail the test's budget
        frozen.beat()
        started = time.monotonic()
        err = lost_peer(me, RuntimeError("[pair.cc:1] Read error: Connection reset by peer. "
                                         "This is typically"), 9, "forward-backward")
        assert time.monotonic() - started < 5
        assert isinstance(err, PeerLostError)
        assert str(err).startswith(
            f"iteration 9, phase 'forward-backward': a collective failed because rank 1 (host "
            f"{host}, pid {child.pid}) has exited, last heard from in phase 'checkpoint save'"
            " of iteration 7 (RuntimeError: Read error: Connection reset by peer)"), str(err)
    finally:
        for h in (me, frozen, stuck):
            h.stop()


def _workers(agent: int) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes (children of `agent`)."""
    ranks = {}
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]
                                            ) != agent:
                continue
            for var in (d / "environ").read_bytes().split(b"\0"):
                if var.startswith(b"RANK="):
                    ranks[int(var[5:])] = int(d.name)
        except (OSError, IndexError, ValueError):
            continue
    return ranks


@pytest.mark.slow
def test_sigstopped_rank_is_named_and_job_ends_within_timeout(tmp_path: Path) -> None:
    """SIGSTOP on rank 1 mid-training (torchrun, --hang-timeout-seconds 3): rank 0's watchdog
    names rank 1, its host, pid and last phase, and the job is over within the timeout plus a
    few seconds (a stopped process ignores torchrun's SIGTERM: the watchdog SIGKILLs it)."""
    timeout_s, log = 3, tmp_path / "out.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "pretrain.py", *TINY, "--train-iters", "1000000", "--hang-timeout-seconds",
           str(timeout_s), "--distributed-timeout-minutes", "1"]
    with open(log, "w") as out:
        agent = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
    ranks: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 90
        while "\niter " not in log.read_text() and agent.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(1.5)  # two beats into training: its heartbeat shows a training phase
        ranks = _workers(agent.pid)
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(timeout=timeout_s + 30)
        took = time.monotonic() - stopped
    finally:  # whatever is left of this job: the agent's workers, then the agent
        for pid in _workers(agent.pid).values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        agent.kill()
        agent.wait()
    text = log.read_text()
    host = socket.gethostname()
    m = re.search(rf"hang watchdog: rank 0 on host {re.escape(host)}, iteration \d+: .*"
                  rf"Heartbeats: rank 1 \(host {re.escape(host)}, pid {ranks[1]}\) stopped "
                  r"answering [\d.]+ s ago, last heard from in phase '([^']+)' of iteration "
                  r"(\d+)", text)
    assert m, text[-3000:]
    assert m.group(1) != "start-up" and int(m.group(2)) >= 1, m.group(0)
    assert f"killed stale rank 1 (pid {ranks[1]})" in text, text[-3000:]
    print(f"job ended {took:.1f} s after the SIGSTOP (--hang-timeout-seconds {timeout_s})")
    assert took < timeout_s + 8, (took, text[-3000:])  # before: + torchrun's 30 s grace
