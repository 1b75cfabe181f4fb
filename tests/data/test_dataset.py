"""GPT dataset, index building, blending, node-local epochs, DP coverage and exact resume."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_lite.data.dataset import build_datasets, split_ranges
from megatron_lite.data.format import ShardWriter, shard_name, write_manifest
from megatron_lite.data.index import (
    blend_indices,
    build_sample_index,
    num_epochs_for,
    permutation,
)
from megatron_lite.data.loader import MicroBatchLoader


def make_corpus(path, docs_per_shard, num_shards=1, seed=0, offset=0):
    """Manifest + shards whose token values encode (document, position) for easy checking."""
    rng = np.random.default_rng(seed)
    entries, docs = [], []
    for s in range(num_shards):
        w = ShardWriter(shard_name(path, s), np.uint16)
        for _ in range(docs_per_shard):
            doc = rng.integers(offset, offset + 1000, size=int(rng.integers(1, 40)))
            docs.append(doc)
            w.add_documents(doc, np.array([len(doc)]))
        entries.append(w.finalize())
    write_manifest(f"{path}.manifest.json", {
        "shards": entries, "total_documents": len(docs),
        "total_tokens": sum(e["tokens"] for e in entries)})
    return docs


@pytest.mark.quick
def test_samples_match_reference_concatenation(tmp_path):
    docs = make_corpus(tmp_path / "c", 60, num_shards=2)
    seq = 16
    (train,) = build_datasets([str(tmp_path / "c")], "100,0,0", seq, seed=3,
                              num_samples=[200], cache_dir=str(tmp_path / "cache"))[:1]
    # shards are read in order; docs of shard 0 then shard 1
    ordered = [docs[i] for i in range(0, len(docs))]
    assert train.num_epochs == num_epochs_for(200, sum(map(len, docs)), seq)
    per_epoch = train.index.samples_per_epoch
    for e in range(train.num_epochs):
        stream = np.concatenate([ordered[j] for j in train.index.doc_order[e]])
        seen = set()
        for k in range(per_epoch):
            sample = train[e * per_epoch + k]
            assert sample.dtype == np.int64 and len(sample) == seq + 1
            s = int(train.index.shuffle[e, k])
            np.testing.assert_array_equal(sample, stream[s * seq:(s + 1) * seq + 1])
            seen.add(s)
        assert seen == set(range(per_epoch))  # each sample of the epoch exactly once
    assert not np.array_equal(train.index.doc_order[0], train.index.doc_order[1])


def test_index_is_cached_and_keyed(tmp_path):
    make_corpus(tmp_path / "c", 50)
    args = ([str(tmp_path / "c")], "100,0,0", 8)
    a = build_datasets(*args, seed=1, num_samples=[50, 0, 0], cache_dir=str(tmp_path / "k"))[0]
    assert len(list((tmp_path / "k").glob("gpt_index_*"))) == 1
    b = build_datasets(*args, seed=1, num_samples=[50, 0, 0], cache_dir=str(tmp_path / "k"))[0]
    assert isinstance(b.index.shuffle, np.memmap)  # loaded, not rebuilt
    np.testing.assert_array_equal(a.index.shuffle, b.index.shuffle)
    build_datasets(*args, seed=2, num_samples=[50, 0, 0], cache_dir=str(tmp_path / "k"))
    assert len(list((tmp_path / "k").glob("gpt_index_*"))) == 2
    assert not list((tmp_path / "k").glob("*.tmp*"))


def test_sample_index_is_int64_beyond_2_31_tokens():
    """Three fake 2^30-token documents: boundaries past 2^31 must not wrap."""
    sizes = np.full(3, 1 << 30, dtype=np.int32)
    seq = 1 << 20
    doc, off = build_sample_index(sizes, np.arange(3), seq, 3 * 1024 - 1)
    k = np.arange(3 * 1024)
    np.testing.assert_array_equal(doc, k // 1024)
    np.testing.assert_array_equal(off, (k % 1024) * seq)


def test_empty_documents_are_skipped():
    sizes = np.array([0, 5, 0, 0, 6, 0], dtype=np.int32)
    doc, off = build_sample_index(sizes, np.arange(6), 2, 5)
    stream_doc = np.repeat(np.arange(6), sizes)
    stream_off = np.concatenate([np.arange(n) for n in sizes])
    np.testing.assert_array_equal(doc, stream_doc[np.arange(6) * 2])
    np.testing.assert_array_equal(off, stream_off[np.arange(6) * 2])


def test_split_ranges():
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("8,2", 10) == [(0, 8), (8, 10), (10, 10)]
    with pytest.raises(ValueError, match="--split"):
        split_ranges("a,b", 10)


def test_blend_proportions_within_one_percent(tmp_path):
    ds, sample = blend_indices(np.array([0.7, 0.2, 0.1]), 10_000)
    for prefix in (100, 1000, 10_000):
        frac = np.bincount(ds[:prefix], minlength=3) / prefix
        np.testing.assert_allclose(frac, [0.7, 0.2, 0.1], atol=0.01)
    for d in range(3):  # each dataset's samples used in order, no gaps
        np.testing.assert_array_equal(sample[ds == d], np.arange((ds == d).sum()))
    make_corpus(tmp_path / "a", 80, offset=0)
    make_corpus(tmp_path / "b", 80, offset=2000, seed=1)
    blended = build_datasets(["0.75", str(tmp_path / "a"), "0.25", str(tmp_path / "b")],
                             "100,0,0", 8, seed=0, num_samples=[400, 0, 0])[0]
    from_b = np.mean([blended[i][0] >= 2000 for i in range(400)])
    assert abs(from_b - 0.25) < 0.01


def _loader(ds, rank, dp, consumed=0, node_local=False):
    return MicroBatchLoader(ds, micro_batch_size=2, global_batch_size=4 * dp, dp_rank=rank,
                            dp_size=dp, consumed_samples=consumed, node_local=node_local)


def test_dp2_ranks_disjoint_and_cover_the_epoch(tmp_path):
    make_corpus(tmp_path / "c", 100)
    ds = build_datasets([str(tmp_path / "c")], "100,0,0", 8, seed=0, num_samples=[64, 0, 0])[0]
    per_epoch = ds.index.samples_per_epoch
    steps = per_epoch // 8
    seen = {0: [], 1: []}
    for rank in (0, 1):
        loader = _loader(ds, rank, 2)
        for _ in range(steps):
            seen[rank] += [(*tuple(mb["tokens"][i].tolist()), int(mb["labels"][i, -1]))
                           for mb in loader.next_step() for i in range(2)]
    assert not set(seen[0]) & set(seen[1])
    covered = set(seen[0]) | set(seen[1])
    expect = {tuple(ds[i].tolist()) for i in range(steps * 8)}
    assert covered == expect and len(covered) == steps * 8


@pytest.mark.parametrize("node_local", [False, True])
def test_resume_from_consumed_samples_gives_identical_batches(tmp_path, node_local):
    make_corpus(tmp_path / "c", 40, num_shards=2)
    kwargs = dict(node_local=(1, 2)) if node_local else {}
    ds = build_datasets([str(tmp_path / "c")], "100,0,0", 8, seed=5, num_samples=[80, 0, 0],
                        **kwargs)[0]
    rank = 1 if node_local else 0
    straight = _loader(ds, rank, 2, node_local=node_local)
    batches = [straight.next_step() for _ in range(6)]
    resumed = _loader(ds, rank, 2, consumed=straight.global_batch_size * 4,
                      node_local=node_local)
    for expect in batches[4:]:
        for a, b in zip(expect, resumed.next_step()):
            for key in ("tokens", "labels", "loss_mask"):
                assert a[key].equal(b[key])


def test_node_local_epochs_come_from_global_counts(tmp_path):
    """4 fake nodes x 1 shard. Epochs follow global samples needed vs global tokens; the local
    count (1/4 of the truth) would give 4x as many epochs. Every rank yields the same number
    of samples and, within an epoch, each of its own samples once."""
    make_corpus(tmp_path / "c", 50, num_shards=4, seed=7)
    seq, gbs, iters = 8, 8, 30
    needed_global = gbs * iters
    from megatron_lite.data.format import load_manifest
    m = load_manifest(tmp_path / "c.manifest.json")
    global_epochs = num_epochs_for(needed_global, m.total_tokens, seq)
    local_epochs_wrong = num_epochs_for(needed_global, m.shards[0]["tokens"], seq)
    assert local_epochs_wrong > global_epochs  # the bug this guards against would show
    counts = []
    for rank in range(4):
        ds = build_datasets([str(tmp_path / "c")], "100,0,0", seq, seed=0,
                            num_samples=[needed_global // 4, 0, 0], node_local=(rank, 4))[0]
        assert [s.prefix for s in ds.corpus.shards] == [str(tmp_path / f"c_{rank:05d}")]
        assert ds.num_epochs == global_epochs
        loader = _loader(ds, rank, 4, node_local=True)
        steps = [loader.next_step() for _ in range(iters)]
        counts.append(sum(len(step) for step in steps))
        per_epoch = ds.index.samples_per_epoch
        first = [tuple(ds[i].tolist()) for i in range(per_epoch)]
        assert len(set(first)) == per_epoch
    assert counts == [counts[0]] * 4


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_sample_index_matches_binary_search(threads):
    """The streaming bincount index equals a binary search per sample, across chunk seams."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(threads)
    sizes = rng.integers(0, 12, size=700_000).astype(np.int32)  # ~1/12 empty documents
    order = rng.permutation(len(sizes))
    seq = 7
    num = (int(sizes.sum()) - 1) // seq
    ends = np.cumsum(sizes[order], dtype=np.int64)
    want_doc = np.searchsorted(ends, np.arange(num + 1) * seq, side="right")
    want_off = np.arange(num + 1) * seq - (ends[want_doc] - sizes[order][want_doc])
    pool = ThreadPoolExecutor(threads) if threads else None
    doc, off = build_sample_index(sizes, order, seq, num, pool)
    np.testing.assert_array_equal(doc, want_doc)
    np.testing.assert_array_equal(off, want_off)
    assert doc.dtype == off.dtype == np.int64


def test_permutation_is_uniform_and_independent_of_threads():
    """Bucketed scatter-then-shuffle: every element lands in every position equally often, and
    the result depends on the seed alone (not on whether or how many threads run it)."""
    from concurrent.futures import ThreadPoolExecutor

    n, draws = 6, 6000
    hits = np.zeros((n, n))
    for s in range(draws):
        p = permutation(n, [s, 1], bucket_size=1)  # 4 buckets even for 6 elements
        hits[p, np.arange(n)] += 1
    expected = draws / n
    chi2 = ((hits - expected) ** 2 / expected).sum()
    assert chi2 < 60, chi2  # 25 degrees of freedom: p ~ 1e-4 at 60; a biased shuffle is far above
    big = 300_000
    with ThreadPoolExecutor(3) as pool:
        a = permutation(big, [7, 0, 1], pool)
    b = permutation(big, [7, 0, 1])
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.sort(a), np.arange(big))
    assert not np.array_equal(a, permutation(big, [7, 0, 2]))
