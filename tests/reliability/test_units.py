"""Pure pieces, no processes: the fault syntax, the spike rule, Young/Daly, the exit flag, the
hang watchdog's thread."""

from __future__ import annotations

import math
import signal
import statistics
import threading
import time

import pytest

from megatron_lite.config import ConfigError, ReliabilityConfig
from megatron_lite.reliability import watchdog
from megatron_lite.reliability.faults import FAULT_ENV, Fault, FaultInjector, parse_faults
from megatron_lite.reliability.signals import ExitMonitor
from megatron_lite.reliability.spikes import MIN_HISTORY, SpikeDetector, young_daly_interval_s


@pytest.mark.quick
def test_fault_syntax() -> None:
    assert parse_faults("rank1:iter13:exit, rank0:iter4-6:spike:attempt1") == [
        Fault(1, 13, 13, "exit"), Fault(0, 4, 6, "spike", 1)]
    for bad in ("rank1:13:exit", "rank1:iter13:explode", "iter13:exit"):
        with pytest.raises(ValueError, match=FAULT_ENV):
            parse_faults(bad)


def test_faults_fire_once_on_their_rank_and_attempt() -> None:
    env = {FAULT_ENV: "rank1:iter2-3:nan_grad,rank1:iter5:exit:attempt1"}
    assert FaultInjector(0, env).faults == []
    first = FaultInjector(1, env)
    assert [f.kind for f in first.faults] == ["nan_grad"]
    assert [first.take(i, "nan_grad") for i in (1, 2, 2, 3)] == [False, True, False, True]
    restarted = FaultInjector(1, {**env, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert [f.kind for f in restarted.faults] == ["exit"]


@pytest.mark.quick
def test_spike_rule_against_statistics() -> None:
    det = SpikeDetector(threshold=3.0)
    losses = [5.0 - 0.1 * i + 0.05 * (-1) ** i for i in range(MIN_HISTORY)]
    for i, x in enumerate(losses):
        assert det.limit() is None or i >= MIN_HISTORY
        det.accept(x)
    limit = statistics.mean(losses) + 3.0 * statistics.stdev(losses)
    assert det.limit() == pytest.approx(limit)
    assert det.is_spike(limit + 1e-6) and not det.is_spike(limit - 1e-6)
    assert not det.is_spike(float("nan"))  # NaN is the NaN rule's business
    det.accept(float("inf"))
    assert len(det.history) == MIN_HISTORY
    flat = SpikeDetector(threshold=3.0)
    for _ in range(MIN_HISTORY):
        flat.accept(2.0)
    assert flat.limit() == pytest.approx(2.0 + 3.0 * 0.02)  # std floored at 1% of the mean


def test_young_daly_matches_worked_numbers() -> None:
    """RELIABILITY.md 1.6: C=40 s, M=7 days -> 1.92 h (Daly); Young alone sqrt(2CM) = 1.93 h."""
    week = 7 * 24 * 3600.0
    assert math.sqrt(2 * 40 * week) / 3600 == pytest.approx(1.93, abs=0.01)
    assert young_daly_interval_s(40, week) / 3600 == pytest.approx(1.92, abs=0.01)
    assert young_daly_interval_s(60, 54 * 24 * 3600 / 419) / 60 == pytest.approx(19, abs=1)
    assert young_daly_interval_s(100, 40) == 40  # save slower than failures: every M


@pytest.mark.quick
def test_exit_monitor_signal_and_time() -> None:
    mon = ExitMonitor(exit_duration_mins=None)
    mon.install()
    try:
        signal.raise_signal(signal.SIGUSR1)
    finally:
        mon.uninstall()
    assert mon.received == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    assert ExitMonitor(1e-9).out_of_time() and not ExitMonitor(60).out_of_time()


def test_config_checks() -> None:
    for kwargs, flag in (({"spike_patience": 0}, "--spike-patience"),
                         ({"spike_lr_factor": 1.5}, "--spike-lr-factor"),
                         ({"hang_timeout_seconds": 0}, "--hang-timeout-seconds")):
        with pytest.raises(ConfigError, match=flag):
            ReliabilityConfig(**kwargs)


@pytest.mark.quick
def test_recovery_limit_checks() -> None:
    for kwargs, match in (({"max_skipped_iterations_in_a_row": -1},
                           "--max-skipped-iterations-in-a-row must be >= 0"),
                          ({"max_skipped_iterations": -2}, "--max-skipped-iterations must"),
                          ({"spike_accept_after": 1}, "--spike-accept-after must be 0"),
                          ({"spike_threshold": 5, "spike_accept_after": 8,
                            "max_skipped_iterations_in_a_row": 6}, "can never act")):
        with pytest.raises(ConfigError, match=match):
            ReliabilityConfig(**kwargs)
    ReliabilityConfig(spike_accept_after=8, max_skipped_iterations_in_a_row=6)  # no detector
    ReliabilityConfig(spike_threshold=5, spike_accept_after=6,
                      max_skipped_iterations_in_a_row=6)  # 5 skipped, the 6th trains


def test_spike_reset_restarts_the_statistics_at_the_new_level() -> None:
    det = SpikeDetector(threshold=3.0)
    for _ in range(MIN_HISTORY):
        det.accept(2.0)
    assert det.is_spike(20.0)
    det.reset([20.0, float("nan"), 21.0])
    assert list(det.history) == [20.0, 21.0] and det.limit() is None  # warming up again
    for _ in range(MIN_HISTORY):
        det.accept(20.5)
    assert not det.is_spike(21.0) and det.is_spike(40.0)


def test_slow_data_fault_sleeps_in_the_fetch() -> None:
    from megatron_lite.reliability.faults import SLOW_DATA_S

    inj = FaultInjector(0, {FAULT_ENV: "rank0:iter2:slow_data"})
    start = time.perf_counter()
    inj.delay_data(1)
    assert time.perf_counter() - start < SLOW_DATA_S / 2
    inj.delay_data(2)
    assert time.perf_counter() - start >= SLOW_DATA_S


@pytest.mark.quick
def test_watchdog_fires_only_on_a_stalled_phase(monkeypatch, capfd) -> None:
    """Heartbeats more often than the timeout keep it quiet for several timeouts; a phase that
    stalls past it exits with HANG_EXIT_CODE after printing rank, iteration, phase and the
    stuck thread's stack (os._exit is replaced by a recorder, so this process lives on)."""
    exits: list[int] = []
    fired = threading.Event()
    wd = watchdog.Watchdog(timeout_s=0.3, rank=5, poll_s=0.02)

    def fake_exit(code: int) -> None:
        exits.append(code)
        fired.set()
        wd._stop.set()  # ends the watchdog's loop, as the real exit would end the process

    monkeypatch.setattr(watchdog.os, "_exit", fake_exit)
    wd.start()
    try:
        for i in range(40):  # 0.8 s of steps, each well under the timeout
            wd.phase("forward-backward", iteration=i)
            time.sleep(0.02)
        assert not fired.is_set(), capfd.readouterr().err
        wd.phase("checkpoint save", iteration=41)
        assert fired.wait(10), "a phase stalled for 10 s and the watchdog did not fire"
    finally:
        wd.stop()
    err = capfd.readouterr().err
    assert exits == [watchdog.HANG_EXIT_CODE]
    assert "hang watchdog: rank 5 on host" in err and "iteration 41: phase 'checkpoint save'" \
        in err, err
    assert "[rank 5]   File " in err and "in test_watchdog_fires_only_on_a_stalled_phase" in err
