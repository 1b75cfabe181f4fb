"""Per-DP-rank micro-batches of each global batch, with a resumable position.

The global batch of step k is samples [consumed, consumed + global_batch) of the dataset
(which does its own seeded shuffling). Inside it, micro-step j of DP rank r takes the
`micro_batch_size` samples starting at consumed + (j * dp + r) * micro_batch_size, the order
Megatron's pretraining sampler uses. The whole position is `consumed_samples`: a checkpoint
stores that number and a resumed run continues with exactly the same batches.

With `node_local=True` each DP rank's dataset holds only its own shards: the rank reads its
dataset sequentially from consumed_samples / dp, so every rank still takes the same number of
samples per step and the position is still the one global number.

With `batch_size_at` (a batch-size ramp-up) the global batch of a step is a function of the
position it starts at, so the position still says everything: a resume mid-ramp continues
with the same batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np
import torch
from torch import Tensor


class TokenDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> np.ndarray: ...


def to_batch(samples: Sequence[np.ndarray], eod_id: int | None, eod_mask_loss: bool
             ) -> dict[str, Tensor]:
    """Stack samples of seq+1 tokens into inputs, next-token labels and a loss mask."""
    data = torch.from_numpy(np.stack(samples).astype(np.int64))
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    if eod_mask_loss and eod_id is not None:
        loss_mask[tokens == eod_id] = 0.0
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


class MicroBatchLoader:
    """Yields, per optimizer step, this DP rank's list of micro-batches."""

    def __init__(self, dataset: TokenDataset, *, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int, dp_size: int, consumed_samples: int = 0,
                 eod_id: int | None = None, eod_mask_loss: bool = False,
                 node_local: bool = False, prefetch: int = 0,
                 batch_size_at: Callable[[int], int] | None = None) -> None:
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError("global batch must be a multiple of micro batch x dp")
        self.dataset = dataset
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples
        self.eod_id, self.eod_mask_loss = eod_id, eod_mask_loss
        self.node_local = node_local
        self.prefetch = prefetch
        self.batch_size_at = batch_size_at or (lambda consumed: global_batch_size)
        self._pool = ThreadPoolExecutor(1, "batch-prefetch") if prefetch > 0 else None
        self._ahead: dict[int, Future] = {}

    @property
    def current_global_batch_size(self) -> int:
        """The global batch of the next step (below --global-batch-size during a ramp-up)."""
        return self.batch_size_at(self.consumed_samples)

    @property
    def num_microbatches(self) -> int:
        return self.current_global_batch_size // (self.micro_batch_size * self.dp_size)

    def sample_indices(self, consumed: int) -> list[list[int]]:
        """Dataset indices of this rank's micro-batches for the step starting at `consumed`."""
        mb, dp = self.micro_batch_size, self.dp_size
        steps = self.batch_size_at(consumed) // (mb * dp)
        if self.node_local:
            start = consumed // dp
            return [[(start + j * mb + i) % len(self.dataset) for i in range(mb)]
                    for j in range(steps)]
        return [[(consumed + (j * dp + self.dp_rank) * mb + i) % len(self.dataset)
                 for i in range(mb)] for j in range(steps)]

    def _build(self, consumed: int) -> list[dict[str, Tensor]]:
        return [to_batch([self.dataset[i] for i in idx], self.eod_id, self.eod_mask_loss)
                for idx in self.sample_indices(consumed)]

    def next_step(self) -> list[dict[str, Tensor]]:
        """The step starting at `consumed_samples`, then advance.

        With `prefetch` = N (--num-workers), a background thread prepares the next N steps.
        Work is keyed by the position it starts at, so a position set from outside (resume,
        evaluation restart) simply misses and is built here: batches never depend on timing.
        """
        future = self._ahead.pop(self.consumed_samples, None)
        batches = future.result() if future else self._build(self.consumed_samples)
        self.consumed_samples += self.batch_size_at(self.consumed_samples)
        if self._pool is not None:
            for stale in [k for k in self._ahead if k < self.consumed_samples]:
                self._ahead.pop(stale).cancel()
            start = self.consumed_samples
            for _ in range(self.prefetch):
                if start not in self._ahead:
                    self._ahead[start] = self._pool.submit(self._build, start)
                start += self.batch_size_at(start)
        return batches

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
