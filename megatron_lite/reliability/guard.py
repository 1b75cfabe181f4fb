"""The training loop's reliability companion: one object, called around each step.

Per iteration:

    plan = guard.before_step(iteration, consumed)  watchdog heartbeat; injected process
                                                   faults; --skip-iterations; lowered LR
      inside the step (training.train_step), where only the step can call them:
      local = guard.check_loss(local)              before any reduction of the loss
        (the optimizer calls guard.check_grads(bucket) before each bucket's DP reduction)
      decision = guard.decide(loss)                ONE small all-reduce: exit flags + NaN/Inf;
                                                   then the spike rule on the reduced loss
    decision = guard.after_step(step)              accept the loss, count skips in a row and
                                                   in total; say: go on, roll back, exit, stop

`attach(optimizer, checkpointer)` wires the gradient check and the checkpointer's
file-written hook (for injected faults during a save) once, before the loop.

`decide` is the only collective. It agrees across all ranks on: a signal received anywhere,
rank 0's wall-clock budget, and NaN/Inf found in any rank's local loss or gradients. The
NaN/Inf message names the rank, host, iteration and whether it was the loss or a gradient
(gathered from the ranks that found one, on the rare path only).

Recovery is bounded: a rank that keeps producing NaN/Inf would otherwise make the run skip
steps forever while it consumes data. After --max-skipped-iterations-in-a-row skipped steps in
a row, or --max-skipped-iterations in all (NaN/Inf, spikes, non-finite gradient norms or
updates; not --skip-iterations, which the user asked for), the loop saves and `SkipLimitError`
ends the run: one `error:` line naming the rank and iteration of the last skip.

Spikes are told apart by rank: with a spike threshold, `decide`'s all-reduce also carries each
rank's share of the loss (one slot per rank), so a spike names the ranks whose own loss is above
the limit. A run of --spike-accept-after spikes in a row is taken as a genuine level shift only
when every rank's loss rose (the detector restarts its statistics from those losses and the step
trains); a spike carried by some ranks is a fault and never becomes the new level: it keeps
being skipped (and rolled back with --on-spike rollback) until the skip limit stops the run.

Every skip, rollback, recovery and exit is an event `{"event", "iteration", "time", ...}`: kept
in the checkpointed history, printed on rank 0, and handed to `on_event` (the metrics logger's
JSONL / wandb).
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from megatron_lite.config import Config, ConfigError
from megatron_lite.errors import UserError
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState
from megatron_lite.reliability.faults import FaultInjector
from megatron_lite.reliability.heartbeat import Heartbeat, default_store, interval_for, lost_peer
from megatron_lite.reliability.signals import ExitMonitor
from megatron_lite.reliability.spikes import SpikeDetector, young_daly_interval_s
from megatron_lite.reliability.watchdog import Watchdog

_SIGNAL_EXIT = "exit signal received"


class NonFiniteError(RuntimeError):
    """NaN/Inf in a loss or gradient with --on-nan stop."""


class SkipLimitError(UserError):
    """Too many skipped steps in a row or in total: the run saved and stops (exit 2, one
    `error:` line: every rank agreed on it)."""

    same_on_every_rank = True


@dataclass
class Decision:
    """What every rank does with this iteration (identical on all ranks)."""

    skip: bool = False
    """Do not update the weights (the batch is consumed)."""
    reason: str | None = None
    rollback: bool = False
    """--on-spike rollback: reload the last checkpoint before the next iteration."""
    exit_reason: str | None = None
    """Save and exit cleanly after this iteration."""
    stop_reason: str | None = None
    """Save, then stop with `SkipLimitError`: automatic recovery has given up."""


@dataclass(frozen=True)
class StepPlan:
    """What `before_step` says about the coming step."""

    lr_scale: float = 1.0
    """Multiplier of the scheduled LR (< 1 for a while after a spike rollback)."""
    skip_data: bool = False
    """--skip-iterations names this iteration: consume its batch, train nothing."""


class StepOutcome(Protocol):
    """What `after_step` reads of a finished step (training.StepOutcome)."""

    loss: float
    skipped: bool


@dataclass
class Counters:
    nan_skipped: int = 0
    spike_skipped: int = 0
    data_skipped: int = 0
    rollbacks: int = 0
    events: list[dict] = field(default_factory=list)
    """Every action with its numbers (event, iteration, time, values), oldest first."""
    other_skipped: int = 0
    """Optimizer steps skipped for a non-finite gradient norm (NaN checks off) or a proposed
    update that would not be finite."""

    @property
    def skipped(self) -> int:
        """Steps skipped without the user asking: what --max-skipped-iterations bounds."""
        return self.nan_skipped + self.spike_skipped + self.other_skipped


class Guard:
    def __init__(self, cfg: Config, pstate: ParallelState) -> None:
        r = cfg.reliability
        if r.on_spike == "rollback" and r.spike_threshold is not None and not cfg.checkpoint.save:
            raise ConfigError("--on-spike rollback needs --save DIR (it reloads the last "
                              "checkpoint); add --save or use --on-spike skip")
        self.cfg, self.pstate, self.rel = cfg, pstate, r
        self.faults = FaultInjector(pstate.rank, drill_rate=r.error_injection_rate,
                                    drill_type=r.error_injection_type, seed=cfg.train.seed)
        self.exits = ExitMonitor(r.exit_duration_in_mins)
        self.watchdog = (Watchdog(r.hang_timeout_seconds, pstate.rank)
                         if r.hang_timeout_seconds else None)
        self.heartbeat: Heartbeat | None = None
        """Started by `start` on a multi-rank job (names a stuck or lost peer)."""
        self._phase = "start-up"
        self.spikes = SpikeDetector(r.spike_threshold) if r.spike_threshold else None
        self.skip_set = set(r.skip_iterations)
        self.counters = Counters()
        self.host = socket.gethostname()
        self._iteration = 0
        self._consumed = 0
        self._loss_bad = False
        self._grad_bad: Tensor | None = None
        self._consecutive_spikes = 0
        self._spike_run: list[float] = []
        """The losses of the current run of spikes (a new level if it lasts)."""
        self._skipped_in_a_row = 0
        self._lr_scaled_until = 0
        self._advised = False
        self._local_loss: Tensor | None = None
        """This rank's share of the loss (TP rank 0 only), for the per-rank spike slots."""
        self._optimizer_skip: str | None = None
        """Why the optimizer skipped this iteration's step (`Optimizer.on_skip`)."""
        self._culprit = ""
        """What the latest skip found and where (named by the skip-limit stop)."""
        self.decision = Decision()
        """This iteration's agreed decision (reset by `begin`)."""
        self.on_event: Callable[[dict], None] | None = None
        """Called with every event record on every rank (the metrics logger writes rank 0's)."""

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self, hosts: Sequence[str] = ()) -> Guard:
        """Signals, heartbeats and the watchdog; `hosts`: every rank's host by rank (gathered
        at start-up), so that a peer lost before its first heartbeat is named with its host."""
        self.exits.install()
        store = (default_store() if self.pstate.world_size > 1
                 and self.pstate.device.type != "meta" else None)  # not in a dry run
        if store is not None:
            self.heartbeat = Heartbeat(store, self.pstate.rank, self.pstate.world_size,
                                       interval_for(self.rel.hang_timeout_seconds))
            self.heartbeat.hosts = tuple(hosts)
            self.heartbeat.start()
        if self.watchdog is not None:
            self.watchdog.heartbeat = self.heartbeat
            self.watchdog.start()
        return self

    def close(self) -> None:
        self.exits.uninstall()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.heartbeat is not None:
            self.heartbeat.stop()

    def phase(self, name: str) -> None:
        """Name what the loop does next (the watchdog reports it if it hangs there, and the
        heartbeat tells the other ranks)."""
        self._phase = name
        if self.watchdog is not None:
            self.watchdog.phase(name, self._iteration)
        if self.heartbeat is not None:
            self.heartbeat.enter(name, self._iteration)

    @contextmanager
    def watch_peers(self) -> Iterator[None]:
        """A collective that fails because a peer stopped answering becomes one
        `PeerLostError` naming that rank (from the heartbeats), not a backend traceback."""
        try:
            yield
        except Exception as err:
            lost = lost_peer(self.heartbeat, err, self._iteration, self._phase)
            if lost is None:
                raise
            raise lost from err

    def attach(self, optimizer: object, checkpointer: object, loader: object | None = None
               ) -> None:
        """Check each gradient bucket before its DP reduction; fire `*_in_save` faults after
        each checkpoint file is written and `slow_data` faults in the loader's fetch."""
        optimizer.grad_check = self.check_grads  # type: ignore[attr-defined]
        optimizer.on_skip = self._note_optimizer_skip  # type: ignore[attr-defined]
        checkpointer.on_file_written = (  # type: ignore[attr-defined]
            lambda: self.faults.file_written(self._iteration))
        if loader is not None and self.faults.faults:
            loader.before_fetch = (  # type: ignore[attr-defined]
                lambda: self.faults.delay_data(self._iteration))

    def before_step(self, iteration: int, consumed_samples: int) -> StepPlan:
        """Start of an iteration whose batch starts at sample `consumed_samples`."""
        self._iteration, self._consumed = iteration, consumed_samples
        self._loss_bad, self._grad_bad = False, None
        self._local_loss, self._optimizer_skip = None, None
        self.decision = Decision()
        self.phase("forward-backward")
        self.faults.before_step(iteration)
        scale = self.rel.spike_lr_factor if iteration <= self._lr_scaled_until else 1.0
        scale = self.faults.corrupt_lr(iteration, scale)
        return StepPlan(lr_scale=scale, skip_data=self._skip_data(iteration, consumed_samples))

    def _note_optimizer_skip(self, why: str) -> None:
        self._optimizer_skip = why

    def after_step(self, step: StepOutcome) -> Decision:
        """The step is done: a loss that updated the weights joins the spike statistics;
        returns the iteration's decision (roll back, exit, stop, or neither)."""
        if not step.skipped and self.spikes is not None:
            self.spikes.accept(step.loss)
        if step.skipped and not self.decision.skip:
            if self._iteration in self.skip_set:  # --skip-iterations: asked for, not counted
                return self.decision
            self.counters.other_skipped += 1  # the optimizer found a non-finite norm/update
            why = self._optimizer_skip or "non-finite gradient norm"
            update = why != "non-finite gradient norm"
            self._culprit = f"iteration {self._iteration}: {why}"
            self._log(f"iteration {self._iteration}: optimizer step skipped on every rank, "
                      f"nothing changed: {why}",
                      event="update_skip" if update else "grad_norm_skip", reason=why)
        if step.skipped:
            self._skipped_in_a_row += 1
            self._check_skip_limits()
        elif self._skipped_in_a_row:
            self._log(f"iteration {self._iteration}: trained again after "
                      f"{self._skipped_in_a_row} skipped step(s) in a row", event="recovered",
                      after_skipped=self._skipped_in_a_row)
            self._skipped_in_a_row = 0
        return self.decision

    def _check_skip_limits(self) -> None:
        r, total = self.rel, self.counters.skipped
        if r.max_skipped_iterations_in_a_row and \
                self._skipped_in_a_row >= r.max_skipped_iterations_in_a_row:
            why = (f"{self._skipped_in_a_row} steps in a row were skipped "
                   f"(--max-skipped-iterations-in-a-row {r.max_skipped_iterations_in_a_row})")
        elif r.max_skipped_iterations and total >= r.max_skipped_iterations:
            why = (f"{total} steps were skipped in all (--max-skipped-iterations "
                   f"{r.max_skipped_iterations})")
        else:
            return
        self.decision.stop_reason = (
            f"{why}: {self.counters.nan_skipped} for NaN/Inf, {self.counters.spike_skipped} for "
            f"loss spikes, {self.counters.other_skipped} for a non-finite gradient norm or "
            f"update; the last at {self._culprit}")
        self.decision.rollback = False

    def log_stop(self, iteration: int) -> SkipLimitError:
        """The event and the error that end the run after the loop saved `iteration`."""
        reason = self.decision.stop_reason
        saved = (f"checkpoint of iteration {iteration} saved in {self.cfg.checkpoint.save} "
                 "(the weights of the last trained step)"
                 if self.cfg.checkpoint.save else "nothing saved (no --save)")
        todo = ("check the named rank's GPU and host, or the batches of the skipped iterations "
                "(--skip-iterations skips a bad one), then resume from the checkpoint; raise "
                "--max-skipped-iterations-in-a-row / --max-skipped-iterations to go on as before")
        self._log(f"stopping after iteration {iteration}: {reason}; {saved}", event="stop",
                  reason=reason)
        return SkipLimitError(f"stopped after iteration {iteration}: {reason}; {saved}. To go "
                              f"on: {todo}")

    def _log(self, text: str, **event: object) -> None:
        name = event.pop("event")
        record = {"event": name, "iteration": self._iteration, "time": time.time(), **event}
        self.counters.events.append(record)
        if self.pstate.rank == 0:
            print(text, flush=True)
        if self.on_event is not None:
            self.on_event(record)

    # ---- data ------------------------------------------------------------------------------

    def _skip_data(self, iteration: int, consumed_samples: int) -> bool:
        """True when --skip-iterations names this iteration (the caller consumes its batch)."""
        if iteration not in self.skip_set:
            return False
        self.counters.data_skipped += 1
        self._log(f"iteration {iteration}: skipped by --skip-iterations (samples "
                  f"{consumed_samples}.. not trained on)", event="skip_iteration",
                  consumed_samples=consumed_samples)
        return True

    # ---- local checks (before any reduction) -----------------------------------------------

    def check_loss(self, local: Tensor) -> Tensor:
        """This rank's partial loss, checked; exactly zero on ranks whose chunks have no head
        (which stage holds it depends on the schedule: the last, or stage 0 under ZBV)."""
        self.phase("gradient reduction and loss all-reduce")
        local = self.faults.corrupt_loss(self._iteration, local)
        if self.spikes is not None and self.pstate.tp_rank == 0:
            self._local_loss = local.detach()
        if self.rel.check_for_nan_in_loss_and_grad:
            finite = torch.isfinite(local).all()
            # a dry run has no value to check; the flag still travels in `decide`
            self._loss_bad = not comms.host_value(finite, True)
        return local

    def check_grads(self, grad: Tensor) -> None:
        """Optimizer hook: one bucket of this rank's gradients, before its DP reduction.
        Accumulates on the device (no sync); `decide` reads the flag once."""
        self.faults.corrupt_grad(self._iteration, grad)
        if self.rel.check_for_nan_in_loss_and_grad:
            bad = ~torch.isfinite(grad.sum())
            self._grad_bad = bad if self._grad_bad is None else self._grad_bad | bad

    # ---- the per-iteration agreement -------------------------------------------------------

    def decide(self, loss: float) -> Decision:
        """Agree with every rank on exits and NaN/Inf, then apply the spike rule."""
        iteration = self._iteration
        self.phase("reliability all-reduce")
        grad_bad = (self._grad_bad is not None
                    and bool(comms.host_value(self._grad_bad, False)))
        flags = torch.tensor([float(self.exits.received is not None),
                              float(self.pstate.rank == 0 and self.exits.out_of_time()),
                              float(self._loss_bad), float(grad_bad)],
                             dtype=torch.float32, device=self.pstate.device)
        if self.spikes is not None:  # + each rank's share of the loss, in its own slot
            shares = torch.zeros(self.pstate.world_size, dtype=torch.float32,
                                 device=self.pstate.device)
            if self._local_loss is not None:
                shares[self.pstate.rank] = self._local_loss.to(torch.float32)
            flags = torch.cat([flags, shares])
        comms.all_reduce_(flags, self.pstate.world_group, kind="world")
        # a dry run: the reduction ran, its flags have no value: nothing was raised
        values = comms.host_value(flags, [0.0] * 4)
        signals, timed_out, loss_bad, grads_bad = values[:4]
        decision = Decision()
        if signals:
            decision.exit_reason = (f"{_SIGNAL_EXIT} by {int(signals)} of "
                                    f"{self.pstate.world_size} ranks")
        elif timed_out:
            decision.exit_reason = (f"--exit-duration-in-mins {self.rel.exit_duration_in_mins:g}"
                                    " reached")
        if loss_bad or grads_bad:
            self._non_finite(iteration, decision)
        elif self.spikes is not None:
            self._spike_rule(iteration, loss, decision, values[4:])
        self.decision = decision
        return decision

    def _reports(self) -> list[str]:
        """'rank R (host H): the loss' lines from every rank that found NaN/Inf."""
        mine = [w for w, bad in (("the loss", self._loss_bad),
                                 ("a gradient", bool(self._grad_bad) if self._grad_bad
                                  is not None else False)) if bad]
        local = f"rank {self.pstate.rank} (host {self.host}): {' and '.join(mine)}" if mine \
            else None
        gathered = comms.all_gather_objects(local, self.pstate.world_group, self.pstate.device,
                                            kind="world")
        return [g for g in gathered if g]

    def _non_finite(self, iteration: int, decision: Decision) -> None:
        found = "; ".join(self._reports())
        where = (f"NaN/Inf at iteration {iteration}, found before any reduction in {found}")
        if self.rel.on_nan == "stop":
            print(f"rank {self.pstate.rank}: {where}; stopping (--on-nan stop): the last "
                  "checkpoint is left unchanged", file=sys.stderr, flush=True)
            raise NonFiniteError(f"{where}; stopped by --on-nan stop without saving. Resume "
                                 "from the last checkpoint (consider --skip-iterations "
                                 f"{iteration} if the batch is bad)")
        self.counters.nan_skipped += 1
        self._culprit = f"iteration {iteration}: NaN/Inf in {found}"
        decision.skip, decision.reason = True, "nan"
        self._log(f"{where}; step skipped on every rank (--on-nan skip), "
                  f"{self.counters.nan_skipped} skipped so far", event="nan_skip", found=found)

    def _spike_rule(self, iteration: int, loss: float, decision: Decision,
                    shares: list[float]) -> None:
        assert self.spikes is not None
        limit = self.spikes.limit()
        if not self.spikes.is_spike(loss):
            self._consecutive_spikes = 0
            self._spike_run = []
            return
        assert limit is not None
        self._consecutive_spikes += 1
        ranks, where = spiking_ranks(shares, limit)
        everywhere = len(ranks) == sum(1 for x in shares if x)  # every share holder's rose
        accept = self.rel.spike_accept_after
        lasting = bool(accept) and self._consecutive_spikes >= accept
        if lasting and everywhere:
            self._accept_level(iteration, loss, limit, where)
            return
        self._spike_run.append(loss)
        decision.skip, decision.reason = True, "spike"
        self.counters.spike_skipped += 1
        self._culprit = f"iteration {iteration}: a loss spike {where}"
        rollback = (self.rel.on_spike == "rollback"
                    and self._consecutive_spikes >= self.rel.spike_patience)
        action = (f"rolling back ({self._consecutive_spikes} in a row)" if rollback else
                  f"step skipped (spike {self._consecutive_spikes} in a row)")
        if lasting:
            action += (" and not taken as a new level (--spike-accept-after "
                       f"{accept}): only some ranks' loss rose, a fault, not the data")
        self._log(f"iteration {iteration}: loss spike {loss:.4f} > limit {limit:.4f} "
                  f"(--spike-threshold {self.rel.spike_threshold:g}) {where}; {action}; its "
                  f"batch (from sample {self._consumed}) is not trained on", event="spike",
                  spike_loss=loss, limit=limit, rollback=rollback, ranks=ranks,
                  consumed_samples=self._consumed)
        decision.rollback = rollback

    def _accept_level(self, iteration: int, loss: float, limit: float, where: str) -> None:
        """--spike-accept-after spikes in a row on every rank: a new level, not an outlier. The
        statistics restart from the run's losses (`after_step` adds this one); it trains."""
        assert self.spikes is not None
        run = self._consecutive_spikes
        self.spikes.reset(self._spike_run)
        self._consecutive_spikes, self._spike_run = 0, []
        self._log(f"iteration {iteration}: loss {loss:.4f} above the limit {limit:.4f} for {run} "
                  f"steps in a row {where}, every rank's loss rose (--spike-accept-after "
                  f"{self.rel.spike_accept_after}): accepted as the new level; the spike "
                  "statistics restart from these losses and this step trains",
                  event="spike_level_accepted", spike_loss=loss, limit=limit,
                  spikes_in_a_row=run)

    # ---- rollback ----------------------------------------------------------------------------

    def after_rollback(self, at_iteration: int, restored_iteration: int,
                       consumed_at_spike_end: int, loader: object) -> None:
        """The loop has reloaded the last checkpoint into `loader` & co.: skip the samples
        from the checkpoint through the spikes (or --spike-skip-samples), lower the LR."""
        restored = loader.consumed_samples  # type: ignore[attr-defined]
        skip = self.rel.spike_skip_samples
        if skip is None:
            skip = consumed_at_spike_end - restored
        loader.consumed_samples = restored + skip  # type: ignore[attr-defined]
        self._lr_scaled_until = restored_iteration + self.rel.spike_lr_iters
        self._consecutive_spikes, self._spike_run = 0, []
        self.counters.rollbacks += 1
        lr = (f"LR x{self.rel.spike_lr_factor:g} through iteration {self._lr_scaled_until}"
              if self.rel.spike_lr_iters and self.rel.spike_lr_factor != 1 else
              "LR unchanged (--spike-lr-iters / --spike-lr-factor lower it for a while)")
        self._log(f"loss spike rollback at iteration {at_iteration}: reloaded iteration "
                  f"{restored_iteration}, consumed_samples {restored} -> {restored + skip} "
                  f"({skip} samples skipped), {lr}", event="rollback",
                  from_iteration=at_iteration, to_iteration=restored_iteration,
                  reason=self._culprit, restored_iteration=restored_iteration,
                  skipped_samples=skip, consumed_samples=restored + skip,
                  lr_until=self._lr_scaled_until)

    def log_exit(self, iteration: int, reason: str) -> None:
        """The exit event (collective after a signal: the signal's count is taken again
        here, since a rank that got it after the agreement has got it by now)."""
        if self.decision.exit_reason is not None and \
                self.decision.exit_reason.startswith(_SIGNAL_EXIT):
            got = torch.tensor([float(self.exits.received is not None)],
                               device=self.pstate.device)
            comms.all_reduce_(got, self.pstate.world_group, kind="world")
            count = int(comms.host_value(got[0], 0))
            reason = f"{_SIGNAL_EXIT} by {count} of {self.pstate.world_size} ranks"
        saved = (f"checkpoint of iteration {iteration} in {self.cfg.checkpoint.save}"
                 if self.cfg.checkpoint.save else "nothing saved (no --save)")
        self._log(f"exiting cleanly after iteration {iteration}: {reason}; {saved}",
                  event="exit", reason=reason)

    # ---- checkpoint interval advice ----------------------------------------------------------

    def advise_interval(self, save_seconds: float, iter_seconds: float) -> None:
        """Once, after the first save: log the measured save time and, with --mtbf-hours,
        the Young/Daly interval next to the configured one."""
        if self._advised or self.pstate.rank != 0:
            return
        self._advised = True
        interval = self.cfg.checkpoint.save_interval
        configured = (f"every {interval} iterations = {interval * iter_seconds:.1f} s"
                      if interval else "no --save-interval")
        text = (f"checkpoint interval: a save blocked training {save_seconds:.3f} s; "
                f"configured {configured}")
        if self.rel.mtbf_hours:
            best = young_daly_interval_s(save_seconds, 3600 * self.rel.mtbf_hours)
            iters = max(1, round(best / iter_seconds)) if iter_seconds > 0 else 1
            text += (f"; Young/Daly for --mtbf-hours {self.rel.mtbf_hours:g}: every "
                     f"{best:.1f} s = about {iters} iterations")
        print(text, flush=True)

    # ---- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Counters, the event log, spike statistics and the lowered-LR window: stored in
        every checkpoint's metadata, so a resumed run carries on with the same history."""
        c = self.counters
        return {"nan_skipped": c.nan_skipped, "spike_skipped": c.spike_skipped,
                "data_skipped": c.data_skipped, "rollbacks": c.rollbacks,
                "events": list(c.events), "lr_scaled_until": self._lr_scaled_until,
                "consecutive_spikes": self._consecutive_spikes, "spike_run": self._spike_run,
                "other_skipped": c.other_skipped, "skipped_in_a_row": self._skipped_in_a_row,
                "spikes": self.spikes.state_dict() if self.spikes is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.counters = Counters(state["nan_skipped"], state["spike_skipped"],
                                 state["data_skipped"], state["rollbacks"],
                                 list(state["events"]), int(state.get("other_skipped", 0)))
        self._skipped_in_a_row = int(state.get("skipped_in_a_row", 0))
        self._spike_run = [float(x) for x in state.get("spike_run", [])]
        self._lr_scaled_until = int(state["lr_scaled_until"])
        self._consecutive_spikes = int(state.get("consecutive_spikes", 0))
        if self.spikes is not None and state.get("spikes"):
            self.spikes.load_state_dict(state["spikes"])



def spiking_ranks(shares: list[float], limit: float) -> tuple[list[int], str]:
    """The ranks whose own loss is above the spike `limit`, and words naming them. A rank's
    own loss is its share of the global loss times the ranks holding a share (TP rank 0 of
    the head's stage; a share is exactly 0 elsewhere); with none above, the largest one."""
    holders = {r: x for r, x in enumerate(shares) if x}
    if not holders:
        return [], ""
    own = {r: x * len(holders) for r, x in holders.items()}
    ranks = [r for r, x in own.items() if x > limit] or [max(own, key=own.__getitem__)]
    named = ", ".join(f"{r} (its loss {own[r]:.4f})" for r in ranks)
    others = [x for r, x in own.items() if r not in ranks]
    rest = f"; the other ranks {min(others):.4f}-{max(others):.4f}" if others else ""
    return ranks, f"on rank{'s' if len(ranks) > 1 else ''} {named}{rest}"


def report_partial_checkpoints(load_dir: Path | None) -> list[str]:
    """Name the directories of interrupted saves under `load_dir` (never loaded: they have
    no committed metadata); returns their names. Call on one rank before loading."""
    if load_dir is None or not load_dir.is_dir():
        return []
    partial = sorted(p.name for p in load_dir.iterdir()
                     if p.is_dir() and p.name.startswith("iter_") and p.suffix == ".tmp")
    for name in partial:
        print(f"checkpoint: skipping partial {load_dir / name} (a save was interrupted before "
              "it was committed); loading the newest complete checkpoint instead", flush=True)
    return partial
