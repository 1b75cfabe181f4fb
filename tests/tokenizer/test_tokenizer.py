"""Tokenizer training and loading: exact round trip, fixed ids, batch API, clear errors."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import sentencepiece as spm

from tokenizer import Tokenizer, TokenizerError
from tokenizer.train import main as train_main
from tokenizer.train import reservoir_sample

SAMPLES = [
    "def f(x):\n    if x:\n\t\treturn  x   # two spaces, tab\n\n\n    return None\n",
    "        deeply    indented\n",
    " leading space and trailing   ",
    "unicode: ünïcödé, 日本語, emoji 🚀🦙, math ∑ ≠ ∞\r\nwindows line",
    "digits 1234567890 and 3.14159",
    "",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A few stdlib sources as a directory, with one JSONL.gz file mixed in."""
    d = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "string.py", "bisect.py", "shlex.py"):
        (d / name).write_text((stdlib / name).read_text(encoding="utf-8"))
    with gzip.open(d / "extra.jsonl.gz", "wt") as f:
        for s in SAMPLES:
            f.write(json.dumps({"text": s}) + "\n")
    return d


@pytest.mark.parametrize("model_type,vocab", [("bpe", 600), ("unigram", 600), ("char", 400)])
def test_round_trip(corpus, tmp_path, model_type, vocab):
    train_main(["--input", str(corpus), "--output-prefix", str(tmp_path / "tok"),
                "--vocab-size", str(vocab), "--model-type", model_type, "--num-threads", "1"])
    assert (tmp_path / "tok.vocab").is_file()
    tok = Tokenizer(tmp_path / "tok.model")
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id, tok.eod_id) == (0, 1, 2, 3, 2)
    assert tok.vocab_size == vocab
    code = (corpus / "textwrap.py").read_text()
    for text in [*SAMPLES, code]:
        assert tok.decode(tok.encode(text)) == text
    batch = tok.encode(SAMPLES)
    assert batch == [tok.encode(s) for s in SAMPLES]
    assert tok.decode(batch) == SAMPLES


@pytest.mark.quick
def test_bpe_learns_indentation(corpus, tmp_path):
    """Runs of spaces become pieces (not one token per space): whitespace-only pieces allowed."""
    train_main(["--input", str(corpus), "--output-prefix", str(tmp_path / "t"),
                "--vocab-size", "600", "--num-threads", "1"])
    tok = Tokenizer(tmp_path / "t.model")
    assert len(tok.encode("        ")) < 8


def test_loads_foreign_model(corpus, tmp_path):
    """A model trained elsewhere with Llama's ids (no pad) loads; pad reports None."""
    text = tmp_path / "t.txt"
    text.write_text((corpus / "string.py").read_text())
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "llama"),
                                   vocab_size=300, pad_id=-1, minloglevel=2)
    tok = Tokenizer(tmp_path / "llama.model")
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, None, 300)


def test_vocab_too_large_is_reported(corpus, tmp_path, capsys):
    assert train_main(["--input", str(corpus / "bisect.py"), "--output-prefix",
                       str(tmp_path / "t"), "--vocab-size", "100000"]) == 2
    err = capsys.readouterr().err
    assert "\nerror: tokenizer training failed" in err and "Check --vocab-size 100000" in err


def test_missing_or_unreadable_inputs(tmp_path):
    with pytest.raises(TokenizerError, match="--input"):
        train_main(["--input", str(tmp_path / "nope"), "--output-prefix", "x",
                    "--vocab-size", "10", "--debug"])
    with pytest.raises(TokenizerError, match=r"--tokenizer-model .*no such file"):
        Tokenizer(tmp_path / "nope.model")
    (tmp_path / "junk.model").write_text("not a model")
    with pytest.raises(TokenizerError, match=r"--tokenizer-model .*not a sentencepiece model"):
        Tokenizer(tmp_path / "junk.model")


def test_reservoir_sample_is_uniform_and_seeded():
    lines = [str(i) for i in range(1000)]
    a, seen = reservoir_sample(iter(lines), 100, seed=1)
    assert seen == 1000 and len(a) == 100 and len(set(a)) == 100
    assert a == reservoir_sample(iter(lines), 100, seed=1)[0]
    counts = [0] * 10
    for seed in range(200):
        for x in reservoir_sample(iter(lines), 100, seed)[0]:
            counts[int(x) // 100] += 1
    assert max(counts) < 1.25 * min(counts)  # each tenth of the stream ~equally represented


def test_no_torch_import():
    code = ("import sys, tokenizer.train; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=Path(__file__).resolve().parents[2])
