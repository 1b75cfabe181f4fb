"""Builds the train and validation loaders for this DP rank from the data config."""

from __future__ import annotations

from megatron_lite.config import Config
from megatron_lite.data.loader import MicroBatchLoader
from megatron_lite.data.mock import MockDataset


def build_data_loaders(cfg: Config, dp_rank: int, dp_size: int,
                       consumed_train_samples: int = 0
                       ) -> tuple[MicroBatchLoader, MicroBatchLoader | None]:
    """(train loader, validation loader or None)."""
    t, m = cfg.train, cfg.model
    gbs = t.global_batch_size or t.micro_batch_size * dp_size
    if not cfg.data.mock_data:
        raise ValueError("no data: pass --mock-data or --data-path with --tokenizer-model")
    train = MockDataset(m.vocab_size, m.seq_length, t.seed, "train")
    valid = MockDataset(m.vocab_size, m.seq_length, t.seed, "valid")
    common = dict(micro_batch_size=t.micro_batch_size, global_batch_size=gbs,
                  dp_rank=dp_rank, dp_size=dp_size)
    return (MicroBatchLoader(train, consumed_samples=consumed_train_samples, **common),
            MicroBatchLoader(valid, **common))
