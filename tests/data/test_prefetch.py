"""--num-workers prefetching never changes which batches a step gets."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.data.loader import MicroBatchLoader
from megatron_lite.data.mock import MockDataset


def _loader(prefetch: int, consumed: int = 0) -> MicroBatchLoader:
    return MicroBatchLoader(MockDataset(50, 8, seed=3), micro_batch_size=2, global_batch_size=8,
                            dp_rank=1, dp_size=2, consumed_samples=consumed, prefetch=prefetch)


def _same(a: list[dict], b: list[dict]) -> bool:
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


@pytest.mark.quick
def test_prefetch_matches_synchronous_including_jumps() -> None:
    sync, ahead = _loader(0), _loader(2)
    for _ in range(4):
        assert _same(sync.next_step(), ahead.next_step())
    assert len(ahead._ahead) == 2  # the next two steps are being prepared
    # Evaluation restarts and checkpoint loads set the position from outside.
    for pos in (0, 56, 8):
        sync.load_state_dict({"consumed_samples": pos})
        ahead.load_state_dict({"consumed_samples": pos})
        for _ in range(3):
            assert _same(sync.next_step(), ahead.next_step())
    assert sync.consumed_samples == ahead.consumed_samples == 32
