"""build_data_loaders on real shards: vocab/EOD resolution, mismatch errors, eod loss mask."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_lite.config import Config, ConfigError
from megatron_lite.data.builder import build_data_loaders, resolve_tokenizer
from megatron_lite.data.format import ShardWriter, shard_name, write_manifest

EOD = 2


def _corpus(path, vocab=500, eod=EOD, shards=2, sha256=None):
    rng = np.random.default_rng(0)
    entries = []
    for s in range(shards):
        w = ShardWriter(shard_name(path, s), np.uint16)
        for _ in range(40):
            doc = np.append(rng.integers(3, vocab, size=int(rng.integers(2, 30))), eod)
            w.add_documents(doc, np.array([len(doc)]))
        entries.append(w.finalize())
    write_manifest(f"{path}.manifest.json", {
        "shards": entries, "total_documents": 40 * shards,
        "total_tokens": sum(e["tokens"] for e in entries),
        "tokenizer": {"vocab_size": vocab, "eod_id": eod, "sha256": sha256}})
    return str(path)


def _cfg(*data_path, **data):
    cfg = Config()
    cfg.data.data_path = list(data_path)
    cfg.data.split = "90,10,0"
    cfg.model.seq_length = 16
    cfg.train.train_iters, cfg.train.eval_iters = 5, 2
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


@pytest.mark.quick
def test_loaders_with_eod_mask(tmp_path):
    cfg = _cfg(_corpus(tmp_path / "c"), eod_mask_loss=True)
    assert resolve_tokenizer(cfg).eod_id == EOD and cfg.model.vocab_size == 500
    train, valid = build_data_loaders(cfg, dp_rank=0, dp_size=1)
    (mb,) = train.next_step()
    assert mb["tokens"].shape == (cfg.train.micro_batch_size, 16)
    assert mb["labels"][:, :-1].equal(mb["tokens"][:, 1:])
    assert (mb["loss_mask"][mb["tokens"] == EOD] == 0).all()
    assert (mb["loss_mask"][mb["tokens"] != EOD] == 1).all()
    assert valid is not None and valid.next_step()[0]["tokens"].shape == (2, 16)


def test_vocab_mismatch_is_an_error(tmp_path):
    a = _corpus(tmp_path / "a", vocab=500)
    b = _corpus(tmp_path / "b", vocab=600)
    with pytest.raises(ConfigError, match="tokenizer mismatch"):
        resolve_tokenizer(_cfg("0.5", a, "0.5", b))
    cfg = _cfg(a)  # model vocab left at the default 256
    with pytest.raises(ConfigError, match="pass --vocab-size 500"):
        build_data_loaders(cfg, 0, 1)


def test_other_tokenizer_file_with_same_vocab_is_a_warning(tmp_path):
    a = _corpus(tmp_path / "a", sha256="a" * 64)
    b = _corpus(tmp_path / "b", sha256="b" * 64)
    assert resolve_tokenizer(_cfg("0.5", a, "0.5", a)).warnings == []
    (warning,) = resolve_tokenizer(_cfg("0.5", a, "0.5", b)).warnings
    assert "b.manifest.json" in warning and "bbbbbbbbbbbb" in warning and "aaaaaaaaaaaa" in warning


def test_bad_shard_stops_before_training(tmp_path):
    prefix = _corpus(tmp_path / "c")
    (tmp_path / "c_00001.bin").write_bytes(b"\0" * 10)
    cfg = _cfg(prefix)
    resolve_tokenizer(cfg)
    with pytest.raises(ConfigError, match=r"c_00001\.bin.*do not match"):
        build_data_loaders(cfg, 0, 1)


def test_checksums_on_request(tmp_path):
    prefix = _corpus(tmp_path / "c")
    raw = bytearray((tmp_path / "c_00000.bin").read_bytes())
    raw[0] ^= 1  # same size: only the checksum can tell
    (tmp_path / "c_00000.bin").write_bytes(bytes(raw))
    cfg = _cfg(prefix)
    resolve_tokenizer(cfg)
    build_data_loaders(cfg, 0, 1)
    cfg.data.verify_checksums = True
    with pytest.raises(ConfigError, match="checksum mismatch"):
        build_data_loaders(cfg, 0, 1)


def test_token_ids_beyond_the_vocab_are_caught(tmp_path):
    """Shards made with a 500-token tokenizer, trained with a 300-token one."""
    prefix = _corpus(tmp_path / "c", vocab=500)
    cfg = _cfg(prefix)
    cfg.model.vocab_size = 300
    manifest = tmp_path / "c.manifest.json"
    data = json.loads(manifest.read_text())
    data["tokenizer"]["vocab_size"] = 300  # a manifest that lies: only the ids can tell
    manifest.write_text(json.dumps(data))
    with pytest.raises(ConfigError,
                       match=r"c_0000\d\.bin: token id \d+ at token offset \d+ is outside"):
        build_data_loaders(cfg, 0, 1)
