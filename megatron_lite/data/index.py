"""Sample indices over a document list, vectorized numpy (no compiled helpers), cached on disk.

For each epoch e: a document order (seeded permutation), a sample index (where each sample of
`seq_length + 1` tokens starts: position in that order and token offset; samples may cross
document boundaries, consecutive samples share one token) and a shuffle of the samples.
Everything is int64 where it counts tokens, so corpora beyond 2^31 tokens work.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class EpochIndex:
    """Indices of `num_epochs` epochs; row e of each array belongs to epoch e."""

    doc_order: np.ndarray  # [E, docs] document positions (into the split's document list)
    sample_doc: np.ndarray  # [E, S + 1] position in doc_order where sample k starts
    sample_offset: np.ndarray  # [E, S + 1] token offset inside that document
    shuffle: np.ndarray  # [E, S] sample order within the epoch

    @property
    def samples_per_epoch(self) -> int:
        return self.shuffle.shape[1]


def samples_per_epoch(num_tokens: int, seq_length: int) -> int:
    """Samples of seq_length + 1 tokens (one shared with the next) that fit in num_tokens."""
    return max(0, (int(num_tokens) - 1) // seq_length)


def num_epochs_for(num_samples: int, num_tokens: int, seq_length: int) -> int:
    """Epochs needed for `num_samples`; pass GLOBAL counts (see the dataset's node-local mode)."""
    per_epoch = samples_per_epoch(num_tokens, seq_length)
    if per_epoch == 0:
        raise ValueError(f"{num_tokens} tokens do not make one sample of --seq-length "
                         f"{seq_length} + 1; use more data or a shorter sequence")
    return max(1, -(-int(num_samples) // per_epoch))


def build_sample_index(sizes: np.ndarray, doc_order: np.ndarray, seq_length: int,
                       num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(start document position, offset) of sample boundaries 0..num_samples.

    Sample k spans global token positions [k*seq, (k+1)*seq] of the documents laid end to end
    in `doc_order`; `searchsorted(..., "right")` skips empty documents.
    """
    ordered = sizes[doc_order]
    ends = np.cumsum(ordered, dtype=np.int64)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc = np.searchsorted(ends, positions, side="right")
    return doc, positions - (ends[doc] - ordered[doc])


def build_epoch_index(sizes: np.ndarray, seq_length: int, num_epochs: int,
                      seed: int) -> EpochIndex:
    """The per-epoch document, sample and shuffle indices for documents of `sizes`."""
    per_epoch = samples_per_epoch(int(sizes.sum(dtype=np.int64)), seq_length)
    parts: list[tuple[np.ndarray, ...]] = []
    for e in range(num_epochs):
        rng = np.random.default_rng([seed, e])
        doc_order = rng.permutation(len(sizes))
        sample_doc, sample_offset = build_sample_index(sizes, doc_order, seq_length, per_epoch)
        parts.append((doc_order, sample_doc, sample_offset, rng.permutation(per_epoch)))
    if num_epochs == 1:  # no copy in the common case
        return EpochIndex(*(a[None] for a in parts[0]))
    return EpochIndex(*(np.stack(arrays) for arrays in zip(*parts)))


def cache_key(description: dict, sizes: np.ndarray) -> str:
    """Hash of everything the index depends on: settings plus the document lengths."""
    h = hashlib.blake2b(json.dumps(description, sort_keys=True).encode(), digest_size=16)
    h.update(np.ascontiguousarray(sizes).view(np.uint8).data)
    return h.hexdigest()


_FIELDS = ("doc_order", "sample_doc", "sample_offset", "shuffle")


def load_or_build(cache_dir: str | Path | None, description: dict, sizes: np.ndarray,
                  seq_length: int, num_epochs: int, seed: int) -> EpochIndex:
    """Cached index (memory-mapped) or a freshly built one, saved atomically when possible.

    Files go to a temporary directory that is renamed into place, so a reader never sees a
    partial cache and concurrent builders on several ranks do not clash.
    """
    if cache_dir is None:
        return build_epoch_index(sizes, seq_length, num_epochs, seed)
    final = Path(cache_dir) / f"gpt_index_{cache_key(description, sizes)}"
    if all((final / f"{n}.npy").is_file() for n in _FIELDS):
        return EpochIndex(*(np.load(final / f"{n}.npy", mmap_mode="r") for n in _FIELDS))
    index = build_epoch_index(sizes, seq_length, num_epochs, seed)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp", dir=final.parent))
        for n in _FIELDS:
            np.save(tmp / f"{n}.npy", getattr(index, n))
        (tmp / "description.json").write_text(json.dumps(description, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:  # another rank finished first: its files are identical
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        print(f"warning: cannot cache the data index in {final.parent} ({e}); set "
              "--data-cache-path to a writable directory to reuse it", file=sys.stderr)
    return index


def blend_indices(weights: np.ndarray, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset id, sample within that dataset) for each of num_samples blended samples.

    Dataset d's k-th sample is due at time (k + 0.5) / w_d; sorting all due times interleaves
    the datasets so that every prefix holds each within one sample of its weight (vectorized
    stand-in for Megatron's sequential greedy helper).
    """
    weights = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    counts = np.ceil(weights * num_samples).astype(np.int64) + 1
    times = np.concatenate([(np.arange(c) + 0.5) / w for c, w in zip(counts, weights)])
    dataset = np.repeat(np.arange(len(weights), dtype=np.int16), counts)
    sample = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
    order = np.argsort(times, kind="stable")[:num_samples]
    return dataset[order], sample[order]
