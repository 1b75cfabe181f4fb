"""Reliability: preemption, hangs, NaN/Inf, loss spikes, fault injection for tests.

`guard.Guard` is what the training loop calls; `faults` is the test-only injector
(MEGATRON_LITE_FAULT); `watchdog`, `signals` and `spikes` are its parts.
"""

from megatron_lite.reliability.faults import FAULT_ENV
from megatron_lite.reliability.guard import (
    Decision,
    Guard,
    NonFiniteError,
    report_partial_checkpoints,
)
from megatron_lite.reliability.watchdog import HANG_EXIT_CODE

__all__ = ["FAULT_ENV", "HANG_EXIT_CODE", "Decision", "Guard", "NonFiniteError",
           "report_partial_checkpoints"]
