"""Megatron's fault drill (--error-injection-rate/-type): which steps get a NaN loss follows
Megatron's draw, written out here independently, and the guard handles them as --on-nan
says: a transient fault costs one skipped step, a persistent one stops the run."""

from __future__ import annotations

import random
import re

import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.parallel.state import single_process_state
from megatron_lite.reliability.faults import FaultInjector
from megatron_lite.reliability.guard import SkipLimitError
from megatron_lite.training import train

TINY = ["--mock-data", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--ffn-hidden-size", "64", "--seq-length", "8", "--vocab-size", "64",
        "--micro-batch-size", "1", "--eval-iters", "0", "--log-interval", "1", "--fp64",
        "--peak-tflops", "1", "--seed", "7"]


@pytest.mark.parametrize("rank", [0, 3])
def test_the_draw_is_megatrons(rank: int) -> None:
    """(randint(0, N-1) + rank) % N == 0 on each check, one stream seeded alike on all ranks."""
    rate, steps = 4, 200
    draws = random.Random(7)
    expected = [i for i in range(steps) if (draws.randint(0, rate - 1) + rank) % rate == 0]
    injector = FaultInjector(rank, {}, drill_rate=rate, seed=7)
    assert [i for i in range(steps) if injector.drill(i)] == expected
    assert 30 < len(expected) < 70  # about one in four


def test_a_persistent_fault_stays_and_no_rate_means_no_fault() -> None:
    injector = FaultInjector(0, {}, drill_rate=5, drill_type="persistent_error", seed=7)
    fired = [injector.drill(i) for i in range(40)]
    first = fired.index(True)
    assert all(fired[first:]) and not any(fired[:first])
    assert not any(FaultInjector(0, {}, seed=7).drill(i) for i in range(40))


@pytest.mark.quick
def test_transient_faults_are_skipped_and_persistent_ones_stop_the_run(capsys) -> None:
    result = train(parse_config([*TINY, "--train-iters", "12", "--error-injection-rate", "3"]),
                   single_process_state())
    out, err = capsys.readouterr()
    injected = err.count("error injection: rank 0 ")
    skipped = re.findall(r"\| skipped (\d+)", out)
    assert result.iteration == 12 and 1 <= injected < 12
    assert int(skipped[-1]) == injected  # each injected step skipped, the others trained
    persistent = parse_config([*TINY, "--train-iters", "40", "--error-injection-rate", "3",
                               "--error-injection-type", "persistent_error",
                               "--max-skipped-iterations-in-a-row", "3"])
    with pytest.raises(SkipLimitError, match="stopped after iteration"):
        train(persistent, single_process_state())


def test_a_negative_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="--error-injection-rate must be >= 0"):
        parse_config([*TINY, "--error-injection-rate", "-1"])
