"""An interrupted preprocessing run continues where its progress record says, and the result is
byte for byte an uninterrupted run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_tools import preprocess
from tests.data.test_preprocess import _docs, _jsonl, tok_model  # noqa: F401 - fixture

ARGS = ["--workers", "1", "--chunk-bytes", "512", "--num-shards", "2", "--append-eod"]


def _run(src: Path, prefix: Path, tok: str) -> int:
    return preprocess.main(["--input", str(src), "--output-prefix", str(prefix),
                            "--tokenizer-model", tok, *ARGS])


def test_interrupted_preprocessing_resumes(tmp_path, tok_model, monkeypatch, capsys):  # noqa: F811
    src = _jsonl(tmp_path / "in.jsonl", _docs(120))
    assert _run(src, tmp_path / "ref" / "out", tok_model) == 0
    monkeypatch.setattr(preprocess, "PROGRESS_EVERY_S", 0.0)  # a record after every chunk
    calls = {"n": 0}
    real_add = preprocess.ShardSet.add

    def add_then_crash(self, tokens, lengths):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt  # Ctrl-C between chunks 3 and 4
        real_add(self, tokens, lengths)

    monkeypatch.setattr(preprocess.ShardSet, "add", add_then_crash)
    with pytest.raises(KeyboardInterrupt):
        _run(src, tmp_path / "out", tok_model)
    assert "rerun the same command to resume" in capsys.readouterr().err
    assert json.loads((tmp_path / "out.progress.json").read_text())["chunks"] == 3
    monkeypatch.setattr(preprocess.ShardSet, "add", real_add)
    assert _run(src, tmp_path / "out", tok_model) == 0
    assert "resuming an interrupted run after chunk 3" in capsys.readouterr().out
    assert not (tmp_path / "out.progress.json").exists()
    ref, got = (json.loads((d / "out.manifest.json").read_text())
                for d in (tmp_path / "ref", tmp_path))
    for a, b in zip(ref["shards"], got["shards"], strict=True):
        assert (a["bin_sha256"], a["idx_sha256"], a["documents"]) == \
            (b["bin_sha256"], b["idx_sha256"], b["documents"])
    assert (tmp_path / "out_00000.bin").read_bytes() == \
        (tmp_path / "ref" / "out_00000.bin").read_bytes()
    assert got["total_documents"] == ref["total_documents"] > 100
    assert not list(tmp_path.glob("out_*.tmp"))
