"""GPT datasets over Megatron shards: samples of seq_length + 1 tokens, seeded epochs, blending.

`build_datasets` turns `--data-path` (one corpus, or Megatron's `0.7 A 0.3 B` blend), `--split`
and the sample counts into train/valid/test datasets. Item i of every dataset is an int64 array
of `seq_length + 1` tokens and depends only on (data, split, seed, i), so resuming from a
consumed-samples count replays exactly.

Sharding modes:
- global: every rank sees the whole corpus (shared storage) and the loader gives each DP rank
  its slice of every global batch.
- node-local: DP rank r reads only its shards (`shards_for_dp_rank`) and is asked for its share
  (num_samples / dp) of samples. The number of epochs is derived from GLOBAL counts (global
  samples needed against the manifest's global token count), never from the local count that
  is 1/dp of the truth; a rank whose shards are smaller than average repeats its data a little
  more rather than running short, so every rank yields the same number of micro-batches.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_lite.config import parse_blend, parse_split
from megatron_lite.data.format import (
    IndexedShard,
    Manifest,
    ShardVerdicts,
    resolve_prefixes,
    shards_for_dp_rank,
)
from megatron_lite.data.index import (
    INDEX_ALGORITHM,
    EpochIndex,
    blend_indices,
    load_or_build,
    num_epochs_for,
    samples_per_epoch,
)

SPLIT_NAMES = ("train", "valid", "test")


class Corpus:
    """Several shards read as one list of documents (Megatron's sequences)."""

    def __init__(self, shards: Sequence[IndexedShard]) -> None:
        self.shards = list(shards)
        counts = [len(s) for s in self.shards]
        self.first_doc = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.sizes = (np.concatenate([s.lengths for s in self.shards]) if self.shards
                      else np.zeros(0, np.int32))

    def __len__(self) -> int:
        return int(self.first_doc[-1])

    def get(self, doc: int, offset: int, length: int) -> np.ndarray:
        shard = int(np.searchsorted(self.first_doc, doc, side="right")) - 1
        return self.shards[shard].get(doc - int(self.first_doc[shard]), offset, length)


def split_ranges(split: str, num_docs: int) -> list[tuple[int, int]]:
    """Megatron's `--split 969,30,1`: contiguous document ranges for train/valid/test, with its
    arithmetic (normalized weights summed in order, each bound rounded to a document)."""
    bounds = [0.0]
    for weight in parse_split(split):
        bounds.append(bounds[-1] + weight)
    ends = [round(b * float(num_docs)) for b in bounds]
    return [(ends[i], ends[i + 1]) for i in range(3)]


@dataclass
class GPTDataset:
    """Samples over documents [start, end) of a corpus; `len` = epochs x samples per epoch."""

    corpus: Corpus
    doc_range: tuple[int, int]
    seq_length: int
    index: EpochIndex
    name: str

    @property
    def num_epochs(self) -> int:
        return self.index.shuffle.shape[0]

    def __len__(self) -> int:
        return self.num_epochs * self.index.samples_per_epoch

    def __getitem__(self, i: int) -> np.ndarray:
        epoch, k = divmod(int(i), self.index.samples_per_epoch)
        k = int(self.index.shuffle[epoch, k])
        order = self.index.doc_order[epoch]
        d0, off0 = int(self.index.sample_doc[epoch, k]), int(self.index.sample_offset[epoch, k])
        d1, off1 = (int(self.index.sample_doc[epoch, k + 1]),
                    int(self.index.sample_offset[epoch, k + 1]))
        first = self.doc_range[0]
        if d0 == d1:
            return self.corpus.get(first + int(order[d0]), off0, off1 - off0 + 1).astype(np.int64)
        sizes = self.corpus.sizes
        parts = [self.corpus.get(first + int(order[d0]), off0,
                                 int(sizes[first + int(order[d0])]) - off0)]
        for d in range(d0 + 1, d1):
            doc = first + int(order[d])
            parts.append(self.corpus.get(doc, 0, int(sizes[doc])))
        parts.append(self.corpus.get(first + int(order[d1]), 0, off1 + 1))
        return np.concatenate(parts).astype(np.int64)


class BlendedDataset:
    """Megatron's weighted blend: sample i comes from dataset `dataset_index[i]`."""

    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float],
                 num_samples: int) -> None:
        self.datasets = list(datasets)
        self.dataset_index, self.sample_index = blend_indices(np.asarray(weights), num_samples)
        for d, ds in enumerate(self.datasets):
            used = self.sample_index[self.dataset_index == d]
            if used.size and used.max() >= len(ds):
                raise ValueError(f"blended dataset {ds.name} has {len(ds)} samples, "
                                 f"{int(used.max()) + 1} needed")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.sample_index[i])]


@dataclass
class Source:
    """One `--data-path` entry as this rank reads it, with the global token count."""

    path: str
    corpus: Corpus
    manifest: Manifest | None
    global_tokens: int


@dataclass
class Prep:
    """How this rank takes part in preparing the data at start-up (training decides; data
    imports nothing from parallel): what it prints and times, and whether it prepares files
    that other ranks read."""

    rank: int = 0
    required: bool = False
    """This rank validates shards and builds index caches for others to read: a cache
    directory it cannot write is then an error (each rank would redo the work), not a warning."""
    seconds: dict[str, float] = field(
        default_factory=lambda: {"data validation": 0.0, "index": 0.0})
    """Wall time spent per phase, for the start-up line."""

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started


def open_source(path: str, dp_rank: int = 0, dp_size: int = 1, node_local: bool = False,
                vocab_size: int | None = None, cache_dir: str | None = None,
                prep: Prep | None = None) -> Source:
    """Open and validate the shards this rank reads (all of them unless node-local).

    Validation verdicts are cached beside the index (`ShardVerdicts`), so a shard is checked
    once, not by every rank at every restart.
    """
    prep = prep or Prep()
    with prep.timed("data validation"):
        prefixes, manifest = resolve_prefixes(path)
        hint = manifest.hint() if manifest else None
        if node_local:
            if manifest is None:
                raise ValueError(f"--data-sharding node-local needs a manifest for --data-path "
                                 f"{path} (made by data_tools.preprocess --num-shards)")
            prefixes = [prefixes[i] for i in shards_for_dp_rank(len(prefixes), dp_rank, dp_size)]
        verdicts = ShardVerdicts(cache_dir or _default_cache(prefixes), prep.rank, prep.required)
        # Every id, manifest or not: a manifest says which tokenizer made the shard, not that
        # its bytes are still what that tokenizer wrote (the scan costs bench/token_scan.py's
        # seconds per billion tokens, once per shard version: see `fingerprint`).
        corpus = Corpus([verdicts.open(p, hint, vocab_size) for p in prefixes])
    total = manifest.total_tokens if manifest else int(corpus.sizes.sum(dtype=np.int64))
    return Source(path, corpus, manifest, total)


def _dataset(src: Source, split: str, which: int, num_samples: int, seq_length: int,
             seed: int, cache_dir: str | None, node_local: tuple[int, int] | None,
             prep: Prep | None = None) -> GPTDataset | None:
    """Dataset of one split of one source, sized for `num_samples` (this rank's share)."""
    start, end = split_ranges(split, len(src.corpus))[which]
    sizes = src.corpus.sizes[start:end]
    local_tokens = int(sizes.sum(dtype=np.int64))
    if num_samples <= 0 or samples_per_epoch(local_tokens, seq_length) == 0:
        return None
    local_total = max(1, int(src.corpus.sizes.sum(dtype=np.int64)))
    if node_local:
        dp_rank, dp_size = node_local
        # global tokens of this split, scaled from the manifest total (exact for even shards)
        global_tokens = src.global_tokens * local_tokens // local_total
        epochs = num_epochs_for(num_samples * dp_size, global_tokens, seq_length)
        needed = num_epochs_for(num_samples, local_tokens, seq_length)
        if needed > epochs:
            print(f"note: DP rank {dp_rank}'s shards of {src.path} hold {local_tokens:,} "
                  f"{SPLIT_NAMES[which]} tokens, below the average {global_tokens // dp_size:,}; "
                  f"it repeats its data over {needed} epochs instead of {epochs}",
                  file=sys.stderr)
        epochs = max(epochs, needed)
    else:
        epochs = num_epochs_for(num_samples, local_tokens, seq_length)
    name = f"{src.path}:{SPLIT_NAMES[which]}"
    description = {"shards": [s.prefix.rsplit("/", 1)[-1] for s in src.corpus.shards],
                   "doc_range": [start, end], "seq_length": seq_length, "seed": seed,
                   "split": which, "epochs": epochs, "index_algorithm": INDEX_ALGORITHM}
    prep = prep or Prep()
    with prep.timed("index"):
        index = load_or_build(cache_dir or _default_cache([s.prefix for s in src.corpus.shards]),
                              description, sizes, seq_length, epochs, seed * 7 + which,
                              rank=prep.rank, required=prep.required)
    return GPTDataset(src.corpus, (start, end), seq_length, index, name)


def _default_cache(prefixes: Sequence[str]) -> str | None:
    """`cache/` beside the first shard (where --data-cache-path is not given)."""
    return str(Path(prefixes[0]).parent / "cache") if prefixes else None


def build_datasets(data_path: Sequence[str], split: str, seq_length: int, seed: int,
                   num_samples: Sequence[int], cache_dir: str | None = None,
                   node_local: tuple[int, int] | None = None,
                   vocab_size: int | None = None, prep: Prep | None = None) -> list:
    """[train, valid, test] (None where a split is empty or not needed).

    `num_samples` are the samples THIS rank will request per split (global counts in global
    mode; global / dp in node-local mode, with `node_local=(dp_rank, dp_size)`). With
    `vocab_size`, every token id of every shard is checked against it (once per shard
    version, `ShardVerdicts`). `prep`: this rank's part in the job's start-up (see `Prep`).
    """
    blend = parse_blend(data_path)
    sources = [open_source(p, *(node_local or (0, 1)), node_local=node_local is not None,
                           vocab_size=vocab_size, cache_dir=cache_dir, prep=prep)
               for _, p in blend]
    out: list = []
    for which, n in enumerate(num_samples):
        if len(sources) == 1:
            out.append(_dataset(sources[0], split, which, n, seq_length, seed, cache_dir,
                                node_local, prep))
            continue
        if n <= 0:  # a split nobody asks for: no index to build
            out.append(None)
            continue
        weights = _blend_weights(blend, sources, split, which, seq_length)
        parts = [_dataset(s, split, which, int(np.ceil(w * n * 1.005)) + 2, seq_length,
                          seed, cache_dir, node_local, prep) if w > 0 else None
                 for s, w in zip(sources, weights)]
        keep = [i for i, d in enumerate(parts) if d is not None]
        out.append(BlendedDataset([parts[i] for i in keep], weights[keep], n) if keep else None)
    return out


def _blend_weights(blend: Sequence[tuple[float | None, str]], sources: Sequence[Source],
                   split: str, which: int, seq_length: int) -> np.ndarray:
    """The blend's weights for split `which`, normalized: as given, or for an unweighted
    blend (`--data-path A B`) Megatron's: each source's samples in one pass over its part of
    the split, so every source is read at the same rate. Megatron then caps the blend at one
    such pass; here a run that needs more repeats every source alike (more epochs)."""
    if blend[0][0] is not None:
        weights = np.array([w for w, _ in blend], dtype=np.float64)
    else:
        weights = np.array([samples_per_epoch(_split_tokens(src, split, which), seq_length)
                            for src in sources], dtype=np.float64)
    total = weights.sum()
    return weights / total if total > 0 else weights


def _split_tokens(src: Source, split: str, which: int) -> int:
    """Tokens of split `which` of a source over all its shards (node-local ranks hold only
    some: scaled from the manifest's total, so every rank gets the same blend weights)."""
    start, end = split_ranges(split, len(src.corpus))[which]
    local = int(src.corpus.sizes[start:end].sum(dtype=np.int64))
    local_total = int(src.corpus.sizes.sum(dtype=np.int64))
    return local if local_total == src.global_tokens else (
        src.global_tokens * local // max(1, local_total))
