"""Every token id of every shard is checked once (issue 31, Why 1): ids deep inside a shard with
a manifest, ids inside the padded vocabulary but beyond the tokenizer's, a shard patched in
place with its size and mtime kept, and --verify-checksums in a single process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from megatron_lite.config import Config, ConfigError
from megatron_lite.data import format as fmt
from megatron_lite.data.builder import Coordinator, build_loaders, resolve_tokenizer
from megatron_lite.data.format import ShardVerdicts, ShardWriter, shard_name, write_manifest

VOCAB, EOD = 2000, 1
TOKENS = 300_000  # well past the 2 x 65,536 tokens the old sampled check read


def _manifest_corpus(path: Path, bad: dict[int, int] | None = None) -> str:
    """One shard of TOKENS ids below VOCAB (documents of 1,000), with `bad` {offset: id}
    written into it, and a manifest that (truthfully about the tokenizer) says vocab VOCAB."""
    tokens = np.random.default_rng(0).integers(2, VOCAB, size=TOKENS).astype(np.uint16)
    for offset, token in (bad or {}).items():
        tokens[offset] = token
    w = ShardWriter(shard_name(path, 0), np.uint16)
    w.add_documents(tokens, np.full(TOKENS // 1000, 1000))
    entry = w.finalize()
    write_manifest(f"{path}.manifest.json", {
        "shards": [entry], "total_documents": entry["documents"], "total_tokens": TOKENS,
        "tokenizer": {"vocab_size": VOCAB, "eod_id": EOD}})
    return str(path)


def _cfg(prefix: str, **data) -> Config:
    cfg = Config()
    cfg.data.data_path, cfg.data.split = [prefix], "100,0,0"
    cfg.model.seq_length = 16
    cfg.train.train_iters, cfg.train.eval_iters = 2, 0
    for k, v in data.items():
        setattr(cfg.data, k, v)
    resolve_tokenizer(cfg)
    return cfg


def _one_process() -> Coordinator:
    """The coordinator training makes for a single process (world size 1, it prepares)."""
    return Coordinator(rank=0, preparer=0, wait=lambda error: None, world_size=1)


@pytest.mark.quick
def test_ids_deep_inside_a_manifest_shard_are_refused_by_offset(tmp_path):
    prefix = _manifest_corpus(tmp_path / "c", bad={200_000: 4000, 230_000: 4000})
    with pytest.raises(ConfigError, match=r"c_00000\.bin: token id 4000 at token offset "
                       r"200000 is outside the vocabulary \[0, 2000\) of the tokenizer"):
        build_loaders(_cfg(prefix), 0, 1, coordinator=_one_process())


def test_ids_inside_the_padded_vocab_but_beyond_the_tokenizer_are_refused(tmp_path):
    prefix = _manifest_corpus(tmp_path / "c", bad={150_000: 2047})
    cfg = _cfg(prefix)
    assert cfg.model.vocab_size == VOCAB and cfg.model.padded_vocab_size(1) == 2048
    with pytest.raises(ConfigError, match=r"token id 2047 at token offset 150000 is outside"):
        build_loaders(cfg, 0, 1)


def test_a_shard_patched_in_place_with_size_and_mtime_kept_is_scanned_again(tmp_path, capsys):
    prefix = str(tmp_path / "s")
    w = ShardWriter(prefix, np.uint16)
    w.add_documents(np.full(TOKENS, 5, np.uint16), np.full(TOKENS // 1000, 1000))
    w.finalize()
    cache = tmp_path / "cache"
    ShardVerdicts(cache).open(prefix, vocab_size=VOCAB)
    assert "scanned" in capsys.readouterr().out
    ShardVerdicts(cache).open(prefix, vocab_size=VOCAB)
    assert capsys.readouterr().out == ""  # unchanged: the verdict stands, nothing is read

    # byte 5,000 of the .bin lies between the fingerprint's first two sampled blocks, so only
    # the change time can tell; the kernel's timestamp clock ticks every few milliseconds
    sampled = os.path.getsize(f"{prefix}.bin") // (fmt.FINGERPRINT_SAMPLES - 1)
    assert 4096 < 5000 < sampled
    time.sleep(0.05)
    st = os.stat(f"{prefix}.bin")
    with open(f"{prefix}.bin", "r+b") as f:
        f.seek(5000)
        f.write(np.array([4000], "<u2").tobytes())
    os.utime(f"{prefix}.bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(f"{prefix}.bin")
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with pytest.raises(fmt.ShardError, match=r"token id 4000 at token offset 2500 is outside"):
        ShardVerdicts(cache).open(prefix, vocab_size=VOCAB)
    assert "scanned" in capsys.readouterr().out


def test_verify_checksums_works_in_a_single_process(tmp_path):
    prefix = _manifest_corpus(tmp_path / "c")
    raw = bytearray((tmp_path / "c_00000.bin").read_bytes())
    raw[100] ^= 1  # ids stay in the vocabulary and the size is kept: only the checksum tells
    (tmp_path / "c_00000.bin").write_bytes(bytes(raw))
    build_loaders(_cfg(prefix), 0, 1, coordinator=_one_process())
    with pytest.raises(ConfigError, match=r"c_00000\.bin: checksum mismatch"):
        build_loaders(_cfg(prefix, verify_checksums=True), 0, 1, coordinator=_one_process())
