"""Preemption and time limits: turn SIGTERM/SIGUSR1 and a wall-clock budget into a flag.

Slurm (`--signal=USR1@120`, or SIGTERM at the time limit) and torchrun deliver the signal to
each process, at slightly different moments, possibly between different collectives. A
handler therefore only sets a flag; the training loop agrees on it with one small all-reduce
per iteration, so every rank stops after the same iteration, saves it, and exits 0.
"""

from __future__ import annotations

import signal
import sys
import time
from types import FrameType

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitMonitor:
    """Signals received by this process and the --exit-duration-in-mins budget."""

    def __init__(self, exit_duration_mins: float | None, start_time: float | None = None
                 ) -> None:
        self.exit_duration_s = None if exit_duration_mins is None else 60 * exit_duration_mins
        self.start_time = time.monotonic() if start_time is None else start_time
        self.received: signal.Signals | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Take over the exit signals (main thread only; elsewhere a no-op, e.g. in a worker
        thread of a notebook)."""
        for sig in EXIT_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:
                return

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:
            print(f"received {signal.Signals(signum).name}: will save and exit after the "
                  "current iteration", file=sys.stderr, flush=True)
        self.received = signal.Signals(signum)

    def out_of_time(self) -> bool:
        return (self.exit_duration_s is not None
                and time.monotonic() - self.start_time >= self.exit_duration_s)
