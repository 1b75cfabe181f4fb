"""Heartbeats in the rendezvous store: which rank stopped answering, and where it was.

A stopped (SIGSTOP), frozen or dead rank cannot say so itself, and its peers only see a
collective that never completes (or a closed socket). So every rank stamps a small record,
`{"seq", "iteration", "phase", "phase_s", "time", "host", "pid"}`, under
`heartbeat/<rank>` in the store its process group was formed through (torchrun's agent store,
or the env:// store), every `interval_s` from a daemon thread. A rank that has to give up (its
watchdog fired, or a collective failed) reads every rank's record twice, `2 * interval_s`
apart: a rank whose `seq` did not move is stale (its process is stopped, frozen or gone) and
is named with its host, pid, and the phase and iteration it was last in; a live rank that has
sat in one phase for longer than the hang timeout is named as stuck. A peer on this host whose
process has exited (its pid gone from /proc, or a zombie) is named at once, without the wait,
so a survivor of a killed rank fails within a second with that rank's number.

The thread talks to the store over its own connection, with a short timeout, so a slow or
frozen store host (rank 0 under env://) costs a failed beat, never a blocked training step.
Comparing `seq` values read by one process needs no clocks in sync across hosts; the age
printed next to a stale rank is by the reading host's clock.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from megatron_lite.errors import UserError

KEY = "heartbeat/{}"
MAX_INTERVAL_S = 2.0
"""Beat period without a hang timeout (with one: a quarter of it, at most this)."""
MAX_NAMED = 8
"""Ranks named in full in one message; the rest are counted."""


PEER_LOST_EXIT_CODE = 5
"""Exit status after a peer rank was lost (a dead node or process): not 2, a user mistake,
nor 3, this rank's own hang (watchdog), nor 4, a failed preflight; the launch scripts restart
or resubmit on it, where a 2 would only repeat."""


class PeerLostError(UserError):
    """A collective failed because a peer rank stopped answering. Not the user's mistake, but
    like one it is reported as one `error:` line: the traceback would only show gloo's C++.
    It exits with PEER_LOST_EXIT_CODE."""

    exit_code = PEER_LOST_EXIT_CODE


@dataclass(frozen=True)
class Beat:
    """One rank's last heartbeat record."""

    rank: int
    seq: int
    iteration: int
    phase: str
    phase_s: float
    """Seconds it had spent in `phase` when it stamped this."""
    time: float
    host: str
    pid: int

    def where(self) -> str:
        return f"last heard from in phase '{self.phase}' of iteration {self.iteration}"


@dataclass(frozen=True)
class Verdict:
    """What two reads of the heartbeats tell: ranks that stopped, ranks stuck in a phase."""

    stale: list[tuple[int, Beat | None, float]]
    """(rank, its last beat or None if it never stamped one, seconds since that beat)."""
    stuck: list[Beat]
    unreadable: str | None = None
    """Why the store could not be read (then nothing is known)."""
    gone: frozenset[int] = frozenset()
    """Stale ranks on this host whose process has exited (seen at once, no wait)."""
    hosts: tuple[str, ...] = ()
    """Every rank's host by rank, when known (`Heartbeat.hosts`): names the host of a rank
    that never sent a heartbeat, so the launch script can exclude it."""

    def describe(self) -> str:
        """One sentence naming the stale ranks first, then the stuck ones."""
        if self.unreadable:
            return f"the heartbeats could not be read ({self.unreadable})"
        parts = []
        for rank, beat, age in self.stale[:MAX_NAMED]:
            if beat is None:
                host = f" (host {self.hosts[rank]})" if rank < len(self.hosts) else ""
                parts.append(f"rank {rank}{host} never sent a heartbeat")
            elif rank in self.gone:
                parts.append(f"rank {rank} (host {beat.host}, pid {beat.pid}) has exited, "
                             f"{beat.where()}")
            else:
                parts.append(f"rank {rank} (host {beat.host}, pid {beat.pid}) stopped answering "
                             f"{age:.1f} s ago, {beat.where()}")
        for beat in self.stuck[:MAX_NAMED]:
            parts.append(f"rank {beat.rank} (host {beat.host}, pid {beat.pid}) is alive but has "
                         f"been in phase '{beat.phase}' of iteration {beat.iteration} for "
                         f"{beat.phase_s:.1f} s")
        more = len(self.stale) + len(self.stuck) - len(parts)
        if more > 0:
            parts.append(f"and {more} more")
        return "; ".join(parts) if parts else "every other rank's heartbeat is current"


def default_store() -> dist.Store | None:
    """The store the default process group was formed through (None without one)."""
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


class Heartbeat:
    """This rank's beating thread and the reader of every rank's beats."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, interval_s: float
                 ) -> None:
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self.store = _own_connection(store, max(1.0, 2 * interval_s))
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._seq = 0
        self._where = (0, "start-up", time.monotonic())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self.hosts: tuple[str, ...] = ()
        """Every rank's host by rank (set by `Guard.start`; empty: unknown)."""

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s)

    def enter(self, phase: str, iteration: int) -> None:
        """The training loop enters `phase` (one tuple assignment: the thread reads it)."""
        self._where = (iteration, phase, time.monotonic())

    def beat(self) -> None:
        iteration, phase, since = self._where
        self._seq += 1
        record = {"seq": self._seq, "iteration": iteration, "phase": phase,
                  "phase_s": round(time.monotonic() - since, 3),
                  "time": time.time(), "host": self.host, "pid": self.pid}
        # the store host is slow or gone: this beat is lost, the next one tries again
        with contextlib.suppress(RuntimeError, dist.DistError):
            self.store.set(KEY.format(self.rank), json.dumps(record))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def read(self) -> dict[int, Beat]:
        """Every other rank's last beat (ranks that never stamped one are missing)."""
        keys = {r: KEY.format(r) for r in range(self.world_size) if r != self.rank}
        present = [r for r, k in keys.items() if self.store.check([k])]
        values = self.store.multi_get([keys[r] for r in present]) if present else []
        return {r: Beat(rank=r, **json.loads(v)) for r, v in zip(present, values, strict=True)}

    def verdict(self, stuck_after_s: float | None = None) -> Verdict:
        """Read the beats twice, `2 * interval_s` apart: stale ranks, and (with
        `stuck_after_s`) live ranks in one phase for longer than that. A peer on this host
        whose process has exited is stale at once: then the second read is not waited for."""
        try:
            first = self.read()
            local = [b for b in first.values() if b.host == self.host]
            deadline = time.monotonic() + 2 * self.interval_s
            while True:  # a killed process may take a moment to exit: look again meanwhile
                gone = frozenset(b.rank for b in local if _exited(b.pid))
                if gone:
                    now = time.time()
                    return Verdict([(r, first[r], now - first[r].time) for r in sorted(gone)],
                                   [], gone=gone)
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
            second = self.read()
        except (RuntimeError, dist.DistError) as e:
            return Verdict([], [], unreadable=f"{type(e).__name__}: {str(e).splitlines()[0]}")
        now = time.time()
        stale, stuck = [], []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            beat = second.get(rank)
            if beat is None or (rank in first and first[rank].seq == beat.seq):
                stale.append((rank, beat, now - beat.time if beat else 0.0))
            elif stuck_after_s is not None and beat.phase_s > stuck_after_s:
                stuck.append(beat)
        return Verdict(stale, stuck, hosts=self.hosts)


def _exited(pid: int) -> bool:
    """Whether process `pid` of this host has exited (gone, or a zombie not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:  # no /proc (not Linux) or not ours to read: not known to have exited
        return False
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


def _own_connection(store: dist.Store, timeout_s: float) -> dist.Store:
    """A second connection to `store` with a short timeout (the training's keeps its own);
    the store itself where it cannot be cloned (a FileStore in tests)."""
    try:
        mine = store.clone()
    except (RuntimeError, AttributeError):
        return store
    mine.set_timeout(timedelta(seconds=timeout_s))
    return mine


def interval_for(hang_timeout_s: float | None) -> float:
    """A quarter of the hang timeout (so a stale rank is told apart well within it), at most
    MAX_INTERVAL_S."""
    return MAX_INTERVAL_S if hang_timeout_s is None else min(MAX_INTERVAL_S, hang_timeout_s / 4)


def is_backend_error(err: BaseException) -> bool:
    """A failed collective's error: a DistError, or a RuntimeError from the backend's C++."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        s in text for s in ("gloo", "Gloo", "NCCL", "Connection closed", "Connection reset"))


def lost_peer(heartbeat: Heartbeat | None, err: BaseException, iteration: int, phase: str
              ) -> PeerLostError | None:
    """`err` explained by the heartbeats (None when it is no backend error or every peer
    still beats: then it is not a lost peer and keeps its own traceback)."""
    if heartbeat is None or not is_backend_error(err):
        return None
    verdict = heartbeat.verdict()
    if not verdict.stale and not verdict.unreadable:
        return None
    text = str(err).strip()
    # gloo's first line: "[path/pair.cc:537] Read error [addr]:port: Connection reset by peer.
    # This is typically caused by ..."; its first sentence, without the source location
    cause = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]).split(". ")[0] if text else "-"
    return PeerLostError(
        f"iteration {iteration}, phase '{phase}': a collective failed because "
        f"{verdict.describe()} ({type(err).__name__}: {cause}). The job cannot go on without "
        "it: restart it from the last checkpoint (torchrun --max-restarts does so)")
