"""--train-data-path / --valid-data-path / --test-data-path, --eval-iters 0, and
--tokenizer-type NullTokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.config import ConfigError
from megatron_lite.data.builder import build_loaders, resolve_tokenizer
from megatron_lite.data.format import ShardWriter, shard_name, write_manifest
from megatron_lite.training import run

VOCAB, EOD = 500, 2


def corpus(path, low: int, high: int, manifest: bool = True) -> str:
    """Documents of tokens drawn from [low, high), each ending in EOD; the data path."""
    rng = np.random.default_rng(low)
    w = ShardWriter(shard_name(path, 0), np.uint16)
    for _ in range(60):
        doc = np.append(rng.integers(low, high, size=int(rng.integers(5, 30))), EOD)
        w.add_documents(doc, np.array([len(doc)]))
    entry = w.finalize()
    if manifest:
        write_manifest(f"{path}.manifest.json", {
            "shards": [entry], "total_documents": 60, "total_tokens": entry["tokens"],
            "tokenizer": {"vocab_size": VOCAB, "eod_id": EOD, "sha256": None}})
        return str(path)
    return shard_name(path, 0)  # a bare Megatron .bin/.idx prefix


def flags(tmp_path, *extra: str) -> list[str]:
    return ["--seq-length", "16", "--train-iters", "4", "--eval-iters", "2",
            "--eval-interval", "2", "--peak-tflops", "1", "--log-jsonl",
            str(tmp_path / "log.jsonl"), *extra]


@pytest.mark.quick
def test_validation_and_test_sets_come_from_their_own_corpora(tmp_path) -> None:
    a, b = corpus(tmp_path / "a", 3, 250), corpus(tmp_path / "b", 300, 400)
    cfg = parse_config(flags(tmp_path, "--train-data-path", a, "--valid-data-path", b,
                             "--test-data-path", b))
    resolve_tokenizer(cfg)
    loaders = build_loaders(cfg, 0, 1)
    for loader, (low, high) in ((loaders.train, (3, 250)), (loaders.valid, (300, 400)),
                                (loaders.test, (300, 400))):
        tokens = loader.next_step()[0]["tokens"]
        assert ((tokens == EOD) | ((tokens >= low) & (tokens < high))).all()
    result = run(cfg)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["eval_loss"] for r in records if "eval_loss" in r] == result.eval_losses
    assert len(result.eval_losses) == 2 and result.test_loss is not None
    assert [r["test_loss"] for r in records if "test_loss" in r] == [result.test_loss]


def test_eval_iters_0_skips_evaluation(tmp_path) -> None:
    a = corpus(tmp_path / "a", 3, 250)
    result = run(parse_config([*flags(tmp_path, "--train-data-path", a, "--valid-data-path", a,
                                      "--test-data-path", a), "--eval-iters", "0"]))
    assert result.eval_losses == [] and result.test_loss is None and len(result.losses) == 4


def test_split_paths_do_not_mix_with_data_path(tmp_path) -> None:
    with pytest.raises(ConfigError, match="pass one of them"):
        parse_config(["--data-path", "x", "--train-data-path", "y"])
    with pytest.raises(ConfigError, match="need --train-data-path"):
        parse_config(["--valid-data-path", "y"])


def test_null_tokenizer_takes_vocab_and_eod_from_vocab_size(tmp_path, capsys) -> None:
    """Shards without a manifest (as Megatron's preprocessor writes them with NullTokenizer):
    the vocabulary is --vocab-size and EOD its last id, as Megatron defines it."""
    a = corpus(tmp_path / "a", 3, 250, manifest=False)
    cfg = parse_config(flags(tmp_path, "--data-path", a, "--tokenizer-type", "NullTokenizer",
                             "--vocab-size", str(VOCAB)))
    info = resolve_tokenizer(cfg)
    assert (info.vocab_size, info.eod_id) == (VOCAB, VOCAB - 1)
    assert len(run(cfg).losses) == 4
    with pytest.raises(ConfigError, match="--tokenizer-model"):
        parse_config(["--tokenizer-type", "Llama2Tokenizer"])
    with pytest.raises(ConfigError, match="--tokenizer-model"):
        parse_config(["--tokenizer-type", "HuggingFaceTokenizer"])
