"""Sample indices over a document list, vectorized numpy (no compiled helpers), cached on disk.

For each epoch e: a document order (seeded permutation), a sample index (where each sample of
`seq_length + 1` tokens starts: position in that order and token offset; samples may cross
document boundaries, consecutive samples share one token) and a shuffle of the samples.
Everything is int64 where it counts tokens, so corpora beyond 2^31 tokens work. The big passes
run in cache-sized chunks on a thread per core; the result never depends on the thread count.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_lite.errors import UserError

INDEX_ALGORITHM = 2  # part of the cache key: bump when the indices a seed gives change
_BUCKET = 1 << 16  # entries per shuffle bucket: 512 KiB of int64, an L2 cache's worth


class CacheError(UserError):
    """The index cache cannot be written where a multi-rank job needs it; names the flag."""


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


def _workers() -> int:
    """Threads for index building: the cores this process may use, at most 8 (the passes are
    memory-bound beyond that, and every rank of a node may be building at once)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return min(8, cores)


def _in_chunks(pool: Executor | None, n: int, fn: Callable[[int, int], object],
               chunk: int = 1 << 18) -> list:
    """[fn(lo, hi) for cache-sized slices of [0, n)], on the pool's threads if one is given
    (numpy releases the GIL in the loops used here)."""
    bounds = [(lo, min(n, lo + chunk)) for lo in range(0, n, chunk)]
    if pool is None:
        return [fn(lo, hi) for lo, hi in bounds]
    return [f.result() for f in [pool.submit(fn, lo, hi) for lo, hi in bounds]]


def permutation(n: int, seed: list[int], pool: Executor | None = None,
                bucket_size: int = _BUCKET) -> np.ndarray:
    """A uniformly random permutation of range(n) (int64), determined by n and seed alone.

    Scatter, then shuffle locally (Sanders, "Random permutations on distributed, external and
    hierarchical memory", 1998): every element goes to one of B buckets drawn uniformly, a
    stable radix argsort gathers the buckets, and each bucket is shuffled on its own. Buckets
    of ~64K entries stay in cache and shuffle on all cores, which makes this several times
    faster than one Fisher-Yates pass over ten million entries. The thread count never changes
    the result: every bucket has its own seeded generator.
    """
    buckets = 1 << min(8, max(0, (n // bucket_size).bit_length() - 1))  # power of two, <= 256
    if buckets == 1:
        return np.random.default_rng(seed).permutation(n)
    which = np.random.default_rng([*seed, 1]).integers(0, 256, n, dtype=np.uint8)
    which &= buckets - 1  # uniform, and much faster to draw than integers(0, buckets)
    out = np.argsort(which, kind="stable")
    step = 1 << 20  # bincount in chunks: no n-sized int64 copy of `which`
    counts = sum(np.bincount(which[i:i + step], minlength=buckets) for i in range(0, n, step))
    bounds = np.zeros(buckets + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])

    def shuffle(lo: int, hi: int) -> None:
        for b in range(lo, hi):
            np.random.default_rng([*seed, 2, b]).shuffle(out[bounds[b]:bounds[b + 1]])

    _in_chunks(pool, buckets, shuffle, chunk=1)
    return out


def build_sample_index(sizes: np.ndarray, doc_order: np.ndarray, seq_length: int,
                       num_samples: int, pool: Executor | None = None,
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(start document position, offset) of sample boundaries 0..num_samples.

    Sample k starts at global token k*seq of the documents laid end to end in `doc_order`, in
    the first document that ends after it; so its position is the number of documents ending
    at or before k*seq, i.e. with ceil(end / seq) <= k: a bincount and a cumsum, streaming
    passes instead of a binary search per sample. Empty documents are skipped by construction.
    """
    n = len(doc_order)
    starts = np.empty(n + 1, dtype=np.int64)  # starts[j]: first token of document j; [n]: total
    starts[0] = 0

    def gather(lo: int, hi: int) -> None:
        starts[lo + 1:hi + 1] = sizes[doc_order[lo:hi]]

    _in_chunks(pool, n, gather)
    np.cumsum(starts, out=starts)  # in place on int64: a casting cumsum is 3x slower

    def count(lo: int, hi: int) -> tuple[int, np.ndarray]:
        first = starts[lo + 1:hi + 1] + (seq_length - 1)  # document ends, rounded up to
        first //= seq_length  # ... the first sample boundary at or after them (non-decreasing)
        return int(first[0]), np.bincount(first - first[0])

    counts = np.zeros(num_samples + 1, dtype=np.int64)
    for base, local in _in_chunks(pool, n, count):
        local = local[:max(0, num_samples + 1 - base)]
        counts[base:base + len(local)] += local
    doc = np.cumsum(counts, out=counts)
    offset = np.empty(num_samples + 1, dtype=np.int64)

    def offsets(lo: int, hi: int) -> None:
        np.multiply(np.arange(lo, hi, dtype=np.int64), seq_length, out=offset[lo:hi])
        offset[lo:hi] -= starts[doc[lo:hi]]

    _in_chunks(pool, num_samples + 1, offsets)
    return doc, offset


def build_epoch_index(sizes: np.ndarray, seq_length: int, num_epochs: int,
                      seed: int) -> EpochIndex:
    """The per-epoch document, sample and shuffle indices for documents of `sizes`."""
    per_epoch = samples_per_epoch(int(sizes.sum(dtype=np.int64)), seq_length)
    parts: list[tuple[np.ndarray, ...]] = []
    with ThreadPoolExecutor(_workers()) as pool:
        for e in range(num_epochs):
            # the sample shuffle does not depend on the documents: one thread draws it while
            # the others build the document and sample indices
            shuffle = pool.submit(permutation, per_epoch, [seed, e, 2])
            doc_order = permutation(len(sizes), [seed, e, 1], pool)
            sample_doc, sample_offset = build_sample_index(sizes, doc_order, seq_length,
                                                           per_epoch, pool)
            parts.append((doc_order, sample_doc, sample_offset, shuffle.result()))
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
                  seq_length: int, num_epochs: int, seed: int, rank: int = 0,
                  required: bool = False, flag: str = "--data-cache-path") -> EpochIndex:
    """Cached index (memory-mapped) or a freshly built one, saved atomically when possible.

    Files go to a temporary directory that is renamed into place, so a reader never sees a
    partial cache and concurrent builders do not clash. A rank that builds says so in one
    `data: rank R built index ...` line. `required` (the rank that builds for a multi-rank
    job, the others memory-map its files): a cache directory it cannot write is an error
    naming `flag`, because every rank would then build the index again; otherwise a warning.
    """
    if cache_dir is None:
        return build_epoch_index(sizes, seq_length, num_epochs, seed)
    final = Path(cache_dir) / f"gpt_index_{cache_key(description, sizes)}"
    if all((final / f"{n}.npy").is_file() for n in _FIELDS):
        return EpochIndex(*(np.load(final / f"{n}.npy", mmap_mode="r") for n in _FIELDS))
    if required:
        _check_writable(final.parent, flag)
    started = time.perf_counter()
    index = build_epoch_index(sizes, seq_length, num_epochs, seed)
    print(f"data: rank {rank} built index {final} ({len(sizes):,} documents, "
          f"{index.samples_per_epoch:,} samples x {num_epochs} epochs) in "
          f"{time.perf_counter() - started:.2f} s", flush=True)
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
              f"{flag} to a writable directory to reuse it", file=sys.stderr)
    return index


def _check_writable(directory: Path, flag: str) -> None:
    """Refuse, before building, a cache directory that the other ranks would never see filled."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        writable = os.access(directory, os.W_OK)
        reason = "not writable"
    except OSError as e:
        writable, reason = False, e.strerror or str(e)
    if not writable:
        raise CacheError(f"cannot write the data index cache in {directory} ({reason}): every "
                         f"rank would build the index again; set {flag} to a directory this "
                         "rank can write (on storage all ranks share, for --data-sharding global)")


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
