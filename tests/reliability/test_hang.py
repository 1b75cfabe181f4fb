"""A hang on one rank: the watchdog ends the run with every thread's stack (torchrun)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_lite.reliability import HANG_EXIT_CODE
from tests.reliability.common import torchrun


@pytest.mark.slow
def test_hang_is_detected_with_stacks(tmp_path: Path) -> None:
    """Rank 1 hangs at iteration 3: its watchdog dumps every thread's stack and exits with
    HANG_EXIT_CODE after --hang-timeout-seconds; the run ends, it does not hang."""
    timeout_s = 5  # a tiny step takes milliseconds; 5 s leaves start-up room on a busy box
    out = torchrun(["--train-iters", "6", "--hang-timeout-seconds", str(timeout_s),
                    "--distributed-timeout-minutes", "1"], fault="rank1:iter3:hang",
                   timeout=90)
    assert out.returncode != 0
    assert f"exitcode  : {HANG_EXIT_CODE}" in out.output, out.output[-3000:]
    assert "hang watchdog: rank 1 on host" in out.output, out.output[-3000:]
    # Rank 0 waits for rank 1 in a collective: its own watchdog fires at about the same time,
    # unless rank 1's exit closes the connection first, which fails rank 0's collective.
    assert ("hang watchdog: rank 0 on host" in out.output
            or "Connection closed by peer" in out.output), out.output[-3000:]
    assert "iteration 3: phase 'forward-backward'" in out.output
    assert "in before_step" in out.output  # rank 1's own stack shows where it is stuck
    # Both ranks dump at once into one stream: whole lines, each naming its rank.
    stuck = [line for line in out.output.splitlines() if line.endswith(" in before_step")]
    assert stuck and all(line.startswith("[rank 1]   File ") for line in stuck), stuck
    assert "in all_reduce_" in out.output  # rank 0 waits for it in a collective
    assert "Thread 0x" in out.output or "Current thread 0x" in out.output
    assert out.seconds < 60
