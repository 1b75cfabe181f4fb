"""Synthetic, learnable token sequences for smoke tests and benchmarks.

Sample i is a deterministic function of (seed, split, i) only, so every parallel layout and
every resumed run sees exactly the same samples in the same order. Each sample repeats a
short random pattern whose tokens follow a Zipf-like distribution: a model first learns the
unigram frequencies (a quick, visible drop from ln(vocab)) and then to copy the pattern.
"""

from __future__ import annotations

import numpy as np

_SPLIT_STREAMS = {"train": 0, "valid": 1, "test": 2}


class MockDataset:
    """Indexable like the real GPT dataset: item i -> int64 array of seq_length + 1 tokens."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, split: str = "train",
                 num_samples: int = 2**40) -> None:
        if vocab_size < 2:
            raise ValueError(f"mock data needs --vocab-size >= 2, got {vocab_size}")
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        self.stream = _SPLIT_STREAMS[split]
        self.num_samples = num_samples
        weights = 1.0 / np.arange(1, vocab_size + 1)
        self.probs = weights / weights.sum()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.stream, int(index)])
        period = int(rng.integers(2, 9))
        pattern = rng.choice(self.vocab_size, size=period, p=self.probs)
        return np.resize(pattern, self.seq_length + 1).astype(np.int64)
