"""data_tools.preprocess: content equals a direct tokenizer reference, identical bytes for any
--workers, and every bad-input path (malformed JSON, empty docs, invalid UTF-8, interruption)."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from data_tools.chunks import line_number, read_range
from data_tools.preprocess import main as preprocess_main
from megatron_lite.data.format import IndexedShard, ShardError, load_manifest, resolve_prefixes
from tokenizer import Tokenizer
from tokenizer.train import main as train_main

ROOT = Path(__file__).resolve().parents[2]
SHAKESPEARE = Path("/work/shared/data/tinyshakespeare/input.txt")


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tok")
    text = d / "train.txt"
    text.write_text(Path(__file__).read_text() * 3 + "naïve café 🚀\n")
    train_main(["--input", str(text), "--output-prefix", str(d / "t"), "--vocab-size", "400",
                "--num-threads", "1"])
    return str(d / "t.model")


def _docs(n: int = 300) -> list[str]:
    rng = np.random.default_rng(0)
    words = ["def", "x", "  ", "return", "café", "\n", "🚀", "42", "    indented", "(", ")"]
    return [" ".join(rng.choice(words, size=rng.integers(1, 60))) for _ in range(n)]


def _jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _read_all(prefix: str) -> list[list[int]]:
    """Documents of all shards of a manifest, back in input order (doc g is in shard g % K)."""
    prefixes, _ = resolve_prefixes(prefix)
    shards = [IndexedShard(p) for p in prefixes]
    n = sum(len(s) for s in shards)
    return [shards[g % len(shards)][g // len(shards)].tolist() for g in range(n)]


def test_matches_tokenizer_and_is_identical_for_any_workers(tmp_path, tok_model):
    docs = _docs()
    src = _jsonl(tmp_path / "in.jsonl", docs)
    outs = {}
    for workers in (1, 2):
        prefix = str(tmp_path / f"w{workers}" / "out")
        preprocess_main(["--input", str(src), "--output-prefix", prefix, "--tokenizer-model",
                         tok_model, "--workers", str(workers), "--num-shards", "3",
                         "--append-eod", "--chunk-bytes", "2000"])
        outs[workers] = prefix
    for i in range(3):
        for ext in (".bin", ".idx"):
            a = Path(f"{outs[1]}_{i:05d}{ext}").read_bytes()
            assert a == Path(f"{outs[2]}_{i:05d}{ext}").read_bytes()
    tok = Tokenizer(tok_model)
    kept = [d for d in docs if d.strip()]  # whitespace-only documents are skipped
    assert _read_all(outs[2]) == [[*ids, tok.eod_id] for ids in tok.encode(kept)]
    m = load_manifest(outs[2] + ".manifest.json")
    assert m.total_documents == len(kept) == sum(s["documents"] for s in m.shards)
    assert m.data["skipped"]["empty_documents"] == len(docs) - len(kept)
    assert m.total_tokens == sum(len(x) + 1 for x in tok.encode(kept))
    assert m.tokenizer["vocab_size"] == 400 and m.tokenizer["eod_id"] == 2
    assert "--workers 2" in m.command
    m.verify_checksums()


@pytest.mark.parametrize("trailing_newline", [True, False])
def test_byte_ranges_give_every_line_once(tmp_path, trailing_newline: bool) -> None:
    """Workers read their own byte ranges of a JSONL file: for any range size, the lines that
    start in each range, concatenated, are the file, and line numbers are counted right."""
    raw = b"".join(b"x" * n + b"\n" for n in (0, 1, 5, 0, 0, 17, 2, 9))
    raw = raw if trailing_newline else raw + b"tail"
    path = tmp_path / "r.jsonl"
    path.write_bytes(raw)
    for size in (1, 2, 3, 7, 16, len(raw), 10 * len(raw)):
        pieces = [read_range(str(path), s, min(s + size, len(raw)))
                  for s in range(0, len(raw), size)]
        assert b"".join(data for _, data in pieces) == raw, size
        for offset, data in pieces:
            if data:
                assert offset == 0 or raw[offset - 1:offset] == b"\n"
                assert line_number(str(path), offset) == raw[:offset].count(b"\n") + 1


def test_small_ranges_change_nothing(tmp_path, tok_model, capsys):
    """Ranges that cut lines anywhere: the same bytes as one range, and errors name the line."""
    src = _jsonl(tmp_path / "in.jsonl", _docs(60))
    outs = []
    for chunk in ("7", "1000000"):
        prefix = str(tmp_path / f"c{chunk}" / "out")
        preprocess_main(["--input", str(src), "--output-prefix", prefix, "--tokenizer-model",
                         tok_model, "--workers", "2", "--chunk-bytes", chunk])
        outs.append(Path(f"{prefix}_00000.bin").read_bytes() +
                    Path(f"{prefix}_00000.idx").read_bytes())
    assert outs[0] == outs[1]
    lines = src.read_text().splitlines(keepends=True)
    lines[41] = '{"text": broken\n'
    src.write_text("".join(lines))
    assert preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "bad"),
                            "--tokenizer-model", tok_model, "--workers", "1",
                            "--chunk-bytes", "7"]) == 2
    assert re.search(r"^error: .*in\.jsonl:42: ", capsys.readouterr().err, re.M)


@pytest.mark.quick
def test_text_files_gz_and_blank_lines(tmp_path, tok_model):
    d = tmp_path / "dir"
    (d / "sub").mkdir(parents=True)
    (d / "a.py").write_text("def a():\n    return 1\n")
    with gzip.open(d / "sub" / "b.txt.gz", "wt") as f:
        f.write("second   doc\n")
    preprocess_main(["--input", str(d), "--output-prefix", str(tmp_path / "o"),
                     "--tokenizer-model", tok_model, "--workers", "1"])
    tok = Tokenizer(tok_model)
    assert _read_all(str(tmp_path / "o")) == tok.encode(["def a():\n    return 1\n",
                                                         "second   doc\n"])
    para = tmp_path / "p.txt"
    para.write_text("one\ntwo\n\n\nthree\n  \nfour")
    preprocess_main(["--input", str(para), "--output-prefix", str(tmp_path / "q"),
                     "--tokenizer-model", tok_model, "--split-on-blank-lines",
                     "--chunk-bytes", "4"])
    assert _read_all(str(tmp_path / "q")) == tok.encode(["one\ntwo", "\nthree", "four"])


@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="shared test data absent")
def test_shakespeare_paragraphs(tmp_path, tok_model):
    preprocess_main(["--input", str(SHAKESPEARE), "--output-prefix", str(tmp_path / "s"),
                     "--tokenizer-model", tok_model, "--split-on-blank-lines", "--workers", "2",
                     "--append-eod"])
    docs = SHAKESPEARE.read_text().split("\n\n")
    tok = Tokenizer(tok_model)
    expect = [[*ids, 2] for ids in tok.encode([d for d in docs if d.strip()])]
    assert _read_all(str(tmp_path / "s")) == expect


def test_malformed_jsonl_names_file_and_line(tmp_path, tok_model, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "ok"}\n{"text": "fine"}\n{"text": broken\n{"other": 1}\n')
    args = ["--input", str(src), "--output-prefix", str(tmp_path / "o"),
            "--tokenizer-model", tok_model, "--workers", "1"]
    assert preprocess_main(args) == 2
    assert re.search(r"^error: .*bad\.jsonl:3: .*--skip-bad-lines", capsys.readouterr().err,
                     re.M)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # nothing left behind
    preprocess_main([*args, "--skip-bad-lines"])
    m = load_manifest(tmp_path / "o.manifest.json")
    assert m.data["skipped"]["bad_lines"] == 2 and m.total_documents == 2


def test_empty_docs_and_invalid_utf8_are_counted(tmp_path, tok_model, capsys):
    src = tmp_path / "x.jsonl"
    src.write_bytes(b'{"text": ""}\n{"text": "   "}\n{"text": "caf\xe9 ok"}\n'
                    b'{"text": "lone \\ud800 surrogate"}\n{"text": "good"}\n')
    preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "o"),
                     "--tokenizer-model", tok_model])
    m = load_manifest(tmp_path / "o.manifest.json")
    assert m.data["skipped"] == {"empty_documents": 2, "bad_lines": 0,
                                 "invalid_utf8_documents_replaced": 2}
    tok = Tokenizer(tok_model)
    assert _read_all(str(tmp_path / "o")) == tok.encode(["caf\ufffd ok", "lone \ufffd surrogate",
                                                         "good"])
    assert "2 empty docs" in capsys.readouterr().out


def test_interrupted_run_leaves_no_valid_shard(tmp_path, tok_model):
    """Kill -9 while the input (a FIFO that never closes) is half read: no final names exist."""
    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    prefix = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "data_tools.preprocess", "--input", str(fifo), "--output-prefix",
         str(prefix), "--tokenizer-model", tok_model, "--workers", "1", "--chunk-bytes", "64"],
        cwd=ROOT, start_new_session=True)
    with open(fifo, "w") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in _docs(50)))
        f.flush()
        deadline = time.time() + 30
        while not list(tmp_path.glob("out_00000.bin.tmp*")) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert list(tmp_path.glob("out_00000.bin.tmp*")), "the run never started writing"
    assert not (tmp_path / "out_00000.bin").exists() and not (tmp_path / "out_00000.idx").exists()
    with pytest.raises(ShardError, match="neither"):
        resolve_prefixes(str(prefix))


def test_no_torch_import():
    code = ("import sys, tokenizer.train, data_tools.preprocess, data_tools.stage; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
