"""HF export: transformers LlamaForCausalLM gives our logits; import gives our weights."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from megatron_lite.checkpoint import CheckpointReader
from megatron_lite.export import load_model, main, model_logits, single_process_state
from tests.checkpoint.common import run_sequence, run_train
from tests.distributed import run_ranks

transformers = pytest.importorskip("transformers")

TINY = ["--num-layers", "2", "--train-iters", "2"]


def _hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    model, info = transformers.LlamaForCausalLM.from_pretrained(
        hf_dir, output_loading_info=True, dtype=torch.float32)
    # A missing weight would be silently random-initialised: require a complete load.
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        return model(tokens).logits


def _check_round_trip(ckpt: Path, tmp_path: Path, *extra: str) -> Path:
    hf = tmp_path / "hf"
    assert main(["--load", str(ckpt), "--output", str(hf), *extra]) == 0
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    cfg, chunk = load_model(ckpt)
    ours = model_logits(chunk, tokens, cfg.vocab_size)
    theirs = _hf_logits(hf, tokens)
    assert theirs.shape == ours.shape == (2, 16, 97)
    assert (theirs - ours).abs().max().item() <= 1e-4
    back = tmp_path / "back"
    assert main(["--from-hf", str(hf), "--save", str(back)]) == 0
    a, b = CheckpointReader(ckpt / "iter_0000002"), CheckpointReader(back / "iter_0000000")
    assert sorted(a.where) == sorted(b.where)
    for name in a.where:
        assert torch.equal(a.full_weight(name), b.full_weight(name)), name
    return hf


def test_tp2_tied_export_matches_transformers(tmp_path) -> None:
    ckpt = tmp_path / "ck"
    run_ranks(run_sequence, 2, tmp_path, tp=2, runs=[
        [*TINY, "--tensor-model-parallel-size", "2", "--save", str(ckpt)]])
    from tokenizer.train import main as train_tokenizer

    text = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    train_tokenizer(["--input", str(text), "--output-prefix", str(tmp_path / "tok"),
                     "--vocab-size", "400", "--num-threads", "1"])
    hf = _check_round_trip(ckpt, tmp_path, "--tokenizer-model", str(tmp_path / "tok.model"))
    config = json.loads((hf / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["num_key_value_heads"] == 2
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert (hf / "tokenizer.model").read_bytes() == (tmp_path / "tok.model").read_bytes()


def test_untied_sharded_export(tmp_path) -> None:
    ckpt = tmp_path / "ck"
    run_train(single_process_state(), [*TINY, "--untie-embeddings-and-output-weights",
                                       "--save", str(ckpt)])
    hf = _check_round_trip(ckpt, tmp_path, "--max-shard-size", "30KB")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((hf / s).is_file() for s in shards)
    assert "lm_head.weight" in index["weight_map"]
