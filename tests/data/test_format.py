"""Shard format: round trip, Megatron's exact byte layout, and one clear error per corruption."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from megatron_lite.data import format as fmt


def _write(prefix, docs, dtype=np.uint16):
    w = fmt.ShardWriter(prefix, dtype)
    w.add_documents(np.concatenate(docs), np.array([len(d) for d in docs]))
    return w.finalize()


@pytest.fixture
def shard(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 30000, size=n) for n in (5, 1, 17, 9)]
    _write(tmp_path / "s", docs)
    return tmp_path / "s", docs


@pytest.mark.quick
def test_round_trip(shard):
    prefix, docs = shard
    r = fmt.IndexedShard(prefix)
    assert len(r) == len(docs) and r.num_tokens == sum(map(len, docs))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(r[i], d)
    np.testing.assert_array_equal(r.get(2, 3, 4), docs[2][3:7])


def test_layout_matches_megatron_spec(shard):
    """Independent decode with struct: header stores documents + 1; int32 lengths, int64 ptrs."""
    prefix, docs = shard
    raw = (prefix.parent / "s.idx").read_bytes()
    magic, version, code, n_seq, n_doc = struct.unpack_from("<9sQBQQ", raw)
    assert (magic, version, code, n_seq, n_doc) == (b"MMIDIDX\x00\x00", 1, 8, 4, 5)
    assert len(raw) == 34 + 12 * 4 + 8 * 5
    lengths = struct.unpack_from("<4i", raw, 34)
    pointers = struct.unpack_from("<4q", raw, 34 + 16)
    assert lengths == tuple(len(d) for d in docs)
    assert pointers == (0, 10, 12, 46)  # byte offsets of uint16 tokens
    assert struct.unpack_from("<5q", raw, 34 + 48) == (0, 1, 2, 3, 4)
    assert (prefix.parent / "s.bin").read_bytes() == np.concatenate(docs).astype("<u2").tobytes()


def test_int32_for_large_vocab(tmp_path):
    assert fmt.optimal_dtype(65499) == np.uint16 and fmt.optimal_dtype(65500) == np.int32
    _write(tmp_path / "w", [np.array([70000, 1, 2])], np.int32)
    np.testing.assert_array_equal(fmt.IndexedShard(tmp_path / "w")[0], [70000, 1, 2])


def test_pointers_are_int64_beyond_2_31_tokens(tmp_path):
    """Fake a 3 x 2^30-token index without allocating tokens: pointers must not wrap."""
    lengths = np.full(3, 1 << 30, dtype=np.int32)
    fmt.write_index(tmp_path / "big.idx", np.uint16, lengths, np.arange(4))
    raw = (tmp_path / "big.idx").read_bytes()
    assert struct.unpack_from("<3q", raw, 34 + 12) == (0, 1 << 31, 1 << 32)


def _expect(prefix, match):
    with pytest.raises(fmt.ShardError, match=match) as e:
        fmt.IndexedShard(prefix)
    assert "data_tools.preprocess" in str(e.value)
    return str(e.value)


def test_bad_magic(shard):
    prefix, _ = shard
    idx = prefix.parent / "s.idx"
    idx.write_bytes(b"XXXXXXXXX" + idx.read_bytes()[9:])
    assert str(idx) in _expect(prefix, "bad magic")


def test_wrong_version(shard):
    prefix, _ = shard
    idx = prefix.parent / "s.idx"
    raw = bytearray(idx.read_bytes())
    raw[9:17] = struct.pack("<Q", 2)
    idx.write_bytes(bytes(raw))
    _expect(prefix, "unsupported version 2")


def test_truncated_bin(shard):
    prefix, _ = shard
    b = prefix.parent / "s.bin"
    b.write_bytes(b.read_bytes()[:-4])
    assert str(b) in _expect(prefix, "do not match")


def test_truncated_idx(shard):
    prefix, _ = shard
    idx = prefix.parent / "s.idx"
    idx.write_bytes(idx.read_bytes()[:-8])
    _expect(prefix, "does not match its header")


def test_idx_counts_not_matching_bin(tmp_path):
    """A valid .idx from another run next to this .bin: counts disagree."""
    _write(tmp_path / "a", [np.arange(10), np.arange(4)])
    _write(tmp_path / "b", [np.arange(3)])
    (tmp_path / "a.idx").write_bytes((tmp_path / "b.idx").read_bytes())
    _expect(tmp_path / "a", "counts do not match")


def test_inconsistent_pointer(shard):
    prefix, _ = shard
    idx = prefix.parent / "s.idx"
    raw = bytearray(idx.read_bytes())
    raw[34 + 16 + 8:34 + 16 + 16] = struct.pack("<q", 12)
    idx.write_bytes(bytes(raw))
    _expect(prefix, "pointer of sequence 1")


def test_missing_shard(shard):
    prefix, _ = shard
    (prefix.parent / "s.bin").unlink()
    _expect(prefix, "missing")
    with pytest.raises(fmt.ShardError, match="neither"):
        fmt.resolve_prefixes(str(prefix.parent / "nothing"))


def test_manifest_checksum_mismatch(tmp_path):
    entry = _write(tmp_path / "m_00000", [np.arange(8)])
    fmt.write_manifest(tmp_path / "m.manifest.json", {
        "shards": [entry], "total_tokens": 8, "total_documents": 1,
        "command": "python -m data_tools.preprocess --input x --output-prefix m"})
    prefixes, m = fmt.resolve_prefixes(str(tmp_path / "m"))
    assert prefixes == [str(tmp_path / "m_00000")]
    m.verify_checksums()
    raw = bytearray((tmp_path / "m_00000.bin").read_bytes())
    raw[0] ^= 1
    (tmp_path / "m_00000.bin").write_bytes(bytes(raw))
    with pytest.raises(fmt.ShardError, match="checksum mismatch") as e:
        m.verify_checksums()
    assert "--output-prefix m" in str(e.value) and "m_00000.bin" in str(e.value)


def test_abort_leaves_nothing(tmp_path):
    w = fmt.ShardWriter(tmp_path / "x", np.uint16)
    w.add_documents(np.arange(5), np.array([5]))
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_shard_assignment():
    assert fmt.shards_for_dp_rank(5, 1, 2) == [1, 3]
    with pytest.raises(fmt.ShardError, match="--num-shards >= 4"):
        fmt.shards_for_dp_rank(3, 0, 4)


def test_every_truncation_and_index_byte_flip_is_caught(shard):
    """No truncated .idx/.bin and no single corrupted .idx byte (outside the document index's
    unused tail) opens silently: each raises ShardError, never another exception."""
    prefix, docs = shard
    idx, bin_ = prefix.parent / "s.idx", prefix.parent / "s.bin"
    good_idx, good_bin = idx.read_bytes(), bin_.read_bytes()
    for cut in range(len(good_idx)):
        idx.write_bytes(good_idx[:cut])
        with pytest.raises(fmt.ShardError):
            fmt.IndexedShard(prefix)
    idx.write_bytes(good_idx)
    for cut in range(0, len(good_bin), 3):
        bin_.write_bytes(good_bin[:cut])
        with pytest.raises(fmt.ShardError):
            fmt.IndexedShard(prefix)
    bin_.write_bytes(good_bin)
    doc_index_start = 34 + 12 * len(docs)
    for pos in range(doc_index_start):
        raw = bytearray(good_idx)
        raw[pos] ^= 0x10
        idx.write_bytes(bytes(raw))
        with pytest.raises(fmt.ShardError):
            fmt.IndexedShard(prefix)


def test_full_vocab_scan_names_the_offset(tmp_path):
    """A bad id deep inside a shard, found by the chunked scan of every token."""
    docs = [np.arange(50, dtype=np.int64) % 40 for _ in range(400)]
    docs[200][17] = 45  # 20,000 tokens in all; this one sits at offset 200 * 50 + 17
    _write(tmp_path / "deep", docs)
    shard = fmt.IndexedShard(tmp_path / "deep")
    shard.check_vocab(46, chunk=4096)
    assert shard.token_range(chunk=4096) == (0, 45)
    with pytest.raises(fmt.ShardError, match=r"token id 45 at token offset 10017 is outside"):
        shard.check_vocab(41, chunk=4096)
