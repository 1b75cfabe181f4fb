"""Fault injection: make one rank fail in a chosen way at a chosen iteration (tests), and
Megatron's --error-injection-rate drill (NaN losses at random steps, in a real run).

    MEGATRON_LITE_FAULT=rank1:iter13:exit            # rank 1 dies (os._exit(1)) at iteration 13
    MEGATRON_LITE_FAULT=rank0:iter12-14:spike        # an iteration range
    MEGATRON_LITE_FAULT=rank1:iter13:kill:attempt0,rank0:iter4:nan_grad   # several, comma-separated

Kinds: `exit` (os._exit(1)), `kill` (SIGKILL to itself), `hang` (sleeps forever in the loop),
`stop` (SIGSTOP to itself: a frozen rank that stops beating and ignores SIGTERM),
`nan_loss` / `nan_grad` (this rank's local loss / one local gradient element becomes NaN),
`spike` (this rank's local loss x SPIKE_FACTOR), `nan_update` (this rank's LR is NaN for the
step, so its proposed optimizer update is not finite), `slow_data` (this rank's loader takes
SLOW_DATA_S longer to hand over the iteration's batch), `sigterm` (SIGTERM to itself between steps),
`sigterm_launcher` (SIGTERM to its parent, torchrun's agent, which forwards it to every worker),
`sigterm_in_save` / `kill_in_save` (SIGTERM / SIGKILL to itself while writing the checkpoint of
that iteration, after its first file is written).

The variable is read once, when the training loop starts. A fault fires at most once per
process, and only on restart attempt `attemptN` (default 0; torchrun's
TORCHELASTIC_RESTART_COUNT), so a restarted group does not meet the same fault again.
Nothing here runs unless the variable or --error-injection-rate is set.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

FAULT_ENV = "MEGATRON_LITE_FAULT"
KINDS = ("exit", "kill", "hang", "nan_loss", "nan_grad", "spike", "sigterm", "sigterm_in_save",
         "kill_in_save", "slow_data", "sigterm_launcher", "nan_update", "stop")
SPIKE_FACTOR = 20.0
SLOW_DATA_S = 0.2
_SPEC = re.compile(r"rank(\d+):iter(\d+)(?:-(\d+))?:([a-z_]+)(?::attempt(\d+))?")


@dataclass(frozen=True)
class Fault:
    rank: int
    first: int
    last: int
    kind: str
    attempt: int = 0


def parse_faults(text: str) -> list[Fault]:
    """Parse the MEGATRON_LITE_FAULT syntax; a malformed spec is an error, never ignored."""
    faults = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = _SPEC.fullmatch(item)
        if m is None or m.group(4) not in KINDS:
            raise ValueError(f"{FAULT_ENV}: cannot parse {item!r}; expected "
                             f"rank<R>:iter<N>[-<M>]:<kind>[:attempt<A>] with kind in {KINDS}")
        first = int(m.group(2))
        last = int(m.group(3) or first)
        faults.append(Fault(int(m.group(1)), first, last, m.group(4), int(m.group(5) or 0)))
    return faults


class FaultInjector:
    """This rank's planned faults; every method is a no-op when none is planned."""

    def __init__(self, rank: int, environ: Mapping[str, str] | None = None,
                 drill_rate: int = 0, drill_type: str = "transient_error",
                 seed: int = 0) -> None:
        env = os.environ if environ is None else environ
        attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.rank = rank
        self.faults = [f for f in parse_faults(env.get(FAULT_ENV, ""))
                       if f.rank == rank and f.attempt == attempt]
        self._fired: set[tuple[Fault, int]] = set()
        self.drill_rate, self.drill_type = drill_rate, drill_type
        self._draws = random.Random(seed)  # the same stream on every rank, as Megatron's
        self._broken_since: int | None = None

    def drill(self, iteration: int) -> bool:
        """--error-injection-rate: True when this step's loss is to be spoiled."""
        if not self.drill_rate:
            return False
        if self._broken_since is not None:
            return True
        if (self._draws.randrange(self.drill_rate) + self.rank) % self.drill_rate:
            return False
        print(f"error injection: rank {self.rank} iteration {iteration}: {self.drill_type} "
              "(--error-injection-rate)", file=sys.stderr, flush=True)
        if self.drill_type == "persistent_error":
            self._broken_since = iteration
        return True

    def take(self, iteration: int, *kinds: str) -> bool:
        """True (once) when a fault of one of `kinds` is due at `iteration`."""
        for f in self.faults:
            if f.kind in kinds and f.first <= iteration <= f.last and (f, iteration) not in \
                    self._fired:
                self._fired.add((f, iteration))
                print(f"fault injection: rank {self.rank} iteration {iteration}: {f.kind}",
                      file=sys.stderr, flush=True)
                return True
        return False

    def before_step(self, iteration: int) -> None:
        """Process-level faults at the start of an iteration."""
        if self.take(iteration, "exit"):
            os._exit(1)
        if self.take(iteration, "kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.take(iteration, "sigterm"):
            signal.raise_signal(signal.SIGTERM)
        if self.take(iteration, "sigterm_launcher"):
            os.kill(os.getppid(), signal.SIGTERM)
        if self.take(iteration, "hang"):
            while True:  # a stuck rank: only the watchdog or a collective timeout ends this
                time.sleep(3600)
        if self.take(iteration, "stop"):  # a frozen rank (wedged node): only SIGKILL ends it
            os.kill(os.getpid(), signal.SIGSTOP)

    def corrupt_loss(self, iteration: int, local: Tensor) -> Tensor:
        if self.drill(iteration) or self.take(iteration, "nan_loss"):
            return local * float("nan")
        if self.take(iteration, "spike"):
            return local * SPIKE_FACTOR
        return local

    def corrupt_lr(self, iteration: int, scale: float) -> float:
        """The LR multiplier of this rank's step: NaN for a `nan_update` fault."""
        return float("nan") if self.take(iteration, "nan_update") else scale

    def corrupt_grad(self, iteration: int, grad: Tensor) -> None:
        """Called with each local gradient bucket before its reduction."""
        if grad.numel() and self.take(iteration, "nan_grad"):
            grad.view(-1)[0] = float("nan")

    def delay_data(self, iteration: int) -> None:
        """Loader hook, inside the timed fetch of a step's batch: `slow_data` faults."""
        if self.take(iteration, "slow_data"):
            time.sleep(SLOW_DATA_S)

    def file_written(self, iteration: int) -> None:
        """Checkpointer hook, after each file of a save: `*_in_save` faults of `iteration`."""
        if self.take(iteration, "kill_in_save"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.take(iteration, "sigterm_in_save"):
            signal.raise_signal(signal.SIGTERM)
