"""Hang watchdog: a phase of training that takes too long ends the process, loudly.

A collective on a dead peer fails by itself (gloo sees the closed socket at once), but a
stuck peer only fails after --distributed-timeout-minutes, and a hang outside a collective
(a deadlocked data worker, a wedged filesystem during a save) never does. The training loop
names each phase it enters (`phase("forward-backward")`, `phase("checkpoint save")`, ...);
a daemon thread checks every second whether the current phase has run for longer than
--hang-timeout-seconds. If so it prints rank, host, iteration and the phase (the last
collective-bearing step started), dumps every thread's Python stack with faulthandler, and
exits with HANG_EXIT_CODE so that the scheduler or torchrun restarts the job.

A second, C-level timer (faulthandler.dump_traceback_later) backs the thread up at twice the
timeout, for a main thread stuck in native code while holding the GIL.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import tempfile
import threading
import time

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
        header = (f"hang watchdog: rank {self.rank} on host {socket.gethostname()}, iteration "
                  f"{iteration}: phase '{phase}' has run for {elapsed:.1f} s, more than "
                  f"--hang-timeout-seconds {self.timeout_s:g}. A peer rank may be stuck or dead "
                  f"(its log says which); stacks of every thread of this rank follow. Exiting "
                  f"with status {HANG_EXIT_CODE} so the job can be restarted from the last "
                  f"checkpoint.\n")
        sys.stderr.flush()
        _write_fd(sys.__stderr__.fileno(), header + self._stacks())
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


def _write_fd(fd: int, text: str) -> None:
    """One write call where the OS allows it, so another rank's output cannot cut a line."""
    data = text.encode(errors="replace")
    while data:
        data = data[os.write(fd, data):]
