"""Hang watchdog: a phase of training that takes too long ends the process, loudly.

A collective on a dead peer fails by itself (gloo sees the closed socket at once), but a
stuck peer only fails after --distributed-timeout-minutes, and a hang outside a collective
(a deadlocked data worker, a wedged filesystem during a save) never does. The training loop
names each phase it enters (`phase("forward-backward")`, `phase("checkpoint save")`, ...);
a daemon thread checks every second whether the current phase has run for longer than
--hang-timeout-seconds. If so it prints rank, host, iteration and the phase (the last
collective-bearing step started), dumps every thread's Python stack with faulthandler, and
exits with HANG_EXIT_CODE so that the scheduler or torchrun restarts the job.

With heartbeats (reliability/heartbeat.py), the firing rank also names the ranks that stopped
answering, with host, pid and the phase they were last in, and the live ranks stuck in one
phase. A stale rank on this host (checked by pid and its launch environment) is SIGKILLed
before this rank exits: a stopped or frozen process ignores the launcher's SIGTERM, and torchrun
would otherwise wait out its --shutdown-timeout (30 s) before the job ends.

A second, C-level timer (faulthandler.dump_traceback_later) backs the thread up at twice the
timeout, for a main thread stuck in native code while holding the GIL.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from megatron_lite.parallel.launch import launch_identity
from megatron_lite.reliability.heartbeat import Heartbeat, Verdict

HANG_EXIT_CODE = 3
"""Exit status after a detected hang (distinct from 1, a Python error)."""


class Watchdog:
    """Per-process hang detector; `phase()` is the heartbeat."""

    def __init__(self, timeout_s: float, rank: int, poll_s: float = 1.0) -> None:
        self.timeout_s, self.rank, self.poll_s = timeout_s, rank, poll_s
        self.iteration = 0
        self._phase = "start-up"
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        self.heartbeat: Heartbeat | None = None
        """Set before `start` to name stale peers when firing."""

    def start(self) -> Watchdog:
        self._thread.start()
        self._arm_backstop()
        return self

    def stop(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.poll_s)

    def phase(self, name: str, iteration: int | None = None) -> None:
        """Enter a phase: restarts the clock (cheap; called a few times per iteration)."""
        with self._lock:
            self._phase, self._since = name, time.monotonic()
            if iteration is not None:
                self.iteration = iteration
        self._arm_backstop()

    def _arm_backstop(self) -> None:
        faulthandler.dump_traceback_later(2 * self.timeout_s + 5, exit=True,
                                         file=sys.__stderr__)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                phase, elapsed, iteration = self._phase, time.monotonic() - self._since, \
                    self.iteration
            if elapsed > self.timeout_s:
                self._fire(phase, elapsed, iteration)

    def _fire(self, phase: str, elapsed: float, iteration: int) -> None:
        verdict = (self.heartbeat.verdict(stuck_after_s=self.timeout_s)
                   if self.heartbeat is not None else None)
        peers = ("A peer rank may be stuck or dead (its log says which)" if verdict is None
                 else f"Heartbeats: {verdict.describe()}")
        header = (f"hang watchdog: rank {self.rank} on host {socket.gethostname()}, iteration "
                  f"{iteration}: phase '{phase}' has run for {elapsed:.1f} s, more than "
                  f"--hang-timeout-seconds {self.timeout_s:g}. {peers}. Stacks of every thread "
                  f"of this rank follow. Exiting with status {HANG_EXIT_CODE} so the job can be "
                  f"restarted from the last checkpoint.\n")
        sys.stderr.flush()
        killed = _kill_local_stale(verdict) if verdict is not None else ""
        _write_fd(sys.__stderr__.fileno(), header + killed + self._stacks())
        os._exit(HANG_EXIT_CODE)

    def _stacks(self) -> str:
        """Every thread's stack, each line prefixed with the rank.

        Usually all ranks fire at once into one stream; faulthandler writes in small pieces,
        so their dumps would interleave mid-line. Dumped to a file first, then written whole.
        """
        try:
            with tempfile.TemporaryFile(mode="w+") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
                f.seek(0)
                lines = f.read().splitlines()
        except OSError:  # no temporary directory: dump unprefixed, straight to stderr
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
            return ""
        return "".join(f"[rank {self.rank}] {line}\n" for line in lines)


def _kill_local_stale(verdict: Verdict) -> str:
    """SIGKILL the stale ranks running on this host; returns a line per rank killed.

    A pid is trusted only if that process was launched as that rank of this job: its
    environment gives the same `launch.launch_identity` as this process's with the stale
    rank's number (torchrun's RANK and rendezvous, or srun's SLURM_PROCID and job step), so a
    reused pid or a host name shared by two machines kills nothing."""
    host, own = socket.gethostname(), launch_identity(os.environ)
    lines = []
    for rank, beat, _ in verdict.stale:
        if beat is None or beat.host != host or own is None:
            continue
        if _process_identity(beat.pid) != (rank, own[1]):
            continue
        try:
            os.kill(beat.pid, signal.SIGKILL)
        except OSError:
            continue
        lines.append(f"hang watchdog: killed stale rank {rank} (pid {beat.pid}) on this host "
                     "so that the launcher ends the job now\n")
    return "".join(lines)


def _process_identity(pid: int) -> tuple[int, str] | None:
    """`launch_identity` of process `pid` of this host, from /proc (None if unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    pairs = (item.decode(errors="replace").partition("=") for item in raw if b"=" in item)
    return launch_identity({key: value for key, _, value in pairs})


def _write_fd(fd: int, text: str) -> None:
    """One write call where the OS allows it, so another rank's output cannot cut a line."""
    data = text.encode(errors="replace")
    while data:
        data = data[os.write(fd, data):]
