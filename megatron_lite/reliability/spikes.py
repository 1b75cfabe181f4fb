"""Loss-spike detection and the Young/Daly checkpoint-interval hint.

A spike is a finite loss far above the recent ones: above the mean of the last WINDOW
accepted losses plus k of their standard deviations (floored at 1% of the mean, so a flat
curve's noise is not a spike). Detection starts after MIN_HISTORY losses. Every rank computes
the same decision from the same all-reduced loss, so no extra collective is needed.
"""

from __future__ import annotations

import math
from collections import deque

WINDOW = 50
MIN_HISTORY = 10
STD_FLOOR = 0.01


class SpikeDetector:
    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.history: deque[float] = deque(maxlen=WINDOW)

    def limit(self) -> float | None:
        """The loss above which a step is a spike now (None while warming up)."""
        if len(self.history) < MIN_HISTORY:
            return None
        n = len(self.history)
        mean = sum(self.history) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / max(1, n - 1))
        return mean + self.threshold * max(std, STD_FLOOR * abs(mean))

    def is_spike(self, loss: float) -> bool:
        limit = self.limit()
        return limit is not None and math.isfinite(loss) and loss > limit

    def accept(self, loss: float) -> None:
        """Record a loss that was trained on."""
        if math.isfinite(loss):
            self.history.append(loss)

    def reset(self, losses: list[float]) -> None:
        """Start the statistics over from `losses` (a level shift was accepted): detection
        resumes once MIN_HISTORY losses of the new level are in."""
        self.history = deque((x for x in losses if math.isfinite(x)), maxlen=WINDOW)

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque((float(x) for x in state.get("history", [])), maxlen=WINDOW)


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's optimal time between checkpoints, sqrt(2 C M), with Daly's correction terms
    (C = time training is blocked per save, M = job-level mean time between failures)."""
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_s
