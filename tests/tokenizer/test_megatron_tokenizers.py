"""Megatron's tokenizer types on small tokenizers built here: HuggingFaceTokenizer and
GPT2BPETokenizer give transformers' ids, vocabulary and EOS; TikTokenizer gives plain tiktoken's
ids shifted past Megatron's special tokens; each preprocesses a corpus, and a Megatron Llama-3
style run (--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR --eod-mask-loss)
preprocesses, trains, finds its document ends, exports a tokenizer AutoTokenizer loads, and
generates with the tokenizer its checkpoint names."""

from __future__ import annotations

import base64
import json
import math
import runpy
from pathlib import Path

import pytest
import tiktoken
import torch
from tokenizers import Tokenizer as FastTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from data_tools.preprocess import main as preprocess_main
from megatron_lite.arguments import parse_config
from megatron_lite.config import ConfigError
from megatron_lite.data.builder import build_loaders, resolve_tokenizer
from megatron_lite.data.format import IndexedShard, load_manifest
from megatron_lite.export import export, load_model, model_logits
from megatron_lite.training import run
from tokenizer.spec import TokenizerSpec, load_tokenizer
from tokenizer.tiktoken_vocab import PATTERNS, byte_chars
from tokenizer.tokenizer import TokenizerError

transformers = pytest.importorskip("transformers")

LINES = ["The quick brown fox jumps over the lazy dog.", "Hello, world! 1234 ünïcödé 日本語 🚀",
         "def f(x):\n    return x * 2\n", "Tokenizers turn text into ids and back again."]
TEXTS = [*LINES, "  two  spaces\tand a tab", "a<|endoftext|>b </s> <s>", "😀 🦙 ∑≠∞"]
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def _bpe(special: list[str]) -> FastTokenizer:
    tok = FastTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES * 20, trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A Llama-3-style tokenizer directory, GPT-2 vocab.json + merges.txt, and a tiktoken
    vocabulary with the GPT-2 merges as ranks."""
    root = tmp_path_factory.mktemp("tokenizers")
    llama = root / "llama3"
    llama.mkdir()
    tok = _bpe(["<|reserved|>", BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    tok.save(str(llama / "tokenizer.json"))
    (llama / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS,
         "eos_token": EOS}))
    gpt2 = root / "gpt2"
    gpt2.mkdir()
    _bpe(["<|endoftext|>"]).model.save(str(gpt2))
    byte_of = {c: b for b, c in enumerate(byte_chars())}
    merges = [line.split() for line in (gpt2 / "merges.txt").read_text().splitlines()
              if line and not line.startswith("#")]
    ranks = [bytes([b]) for b in range(256)]
    ranks += [bytes(byte_of[c] for c in a + b) for a, b in merges]
    (root / "tiktoken.json").write_text(json.dumps([
        {"rank": i, "token_bytes": base64.b64encode(t).decode(),
         "token_str": t.decode("utf-8", "replace")} for i, t in enumerate(ranks)]))
    return {"llama3": llama, "gpt2": gpt2, "tiktoken": root / "tiktoken.json",
            "num_ranks": len(ranks)}  # type: ignore[dict-item]


@pytest.mark.quick
def test_huggingface_tokenizer_is_transformers_autotokenizer(files) -> None:
    """Same ids (BOS from the post-processor), vocabulary (len) and EOS/BOS ids, from the
    directory and from its tokenizer.json; decode gives the text back."""
    ref = transformers.AutoTokenizer.from_pretrained(str(files["llama3"]))
    for model in (files["llama3"], files["llama3"] / "tokenizer.json"):
        tok = load_tokenizer(TokenizerSpec("HuggingFaceTokenizer", str(model)))
        assert (tok.vocab_size, tok.eod_id, tok.bos_id) == (
            len(ref), ref.eos_token_id, ref.bos_token_id)
        assert tok.eod_id == ref.convert_tokens_to_ids(EOS)
        ids = tok.encode(TEXTS)
        assert ids == [ref(t).input_ids for t in TEXTS]
        assert [tok.decode(x[1:]) for x in ids] == TEXTS and ids[0][0] == tok.bos_id
    plain = load_tokenizer(TokenizerSpec("HuggingFaceTokenizer", str(files["llama3"]),
                                         hf_include_special_tokens=False))
    assert plain.encode(TEXTS) == [ref(t, add_special_tokens=False).input_ids for t in TEXTS]


def test_gpt2_bpe_tokenizer_is_transformers_gpt2(files) -> None:
    """--vocab-file/--merge-file: transformers' GPT-2 ids (no BOS), EOD = <|endoftext|>'s id
    in vocab.json, vocabulary = the entries of vocab.json."""
    gpt2 = files["gpt2"]
    ref = transformers.GPT2TokenizerFast.from_pretrained(str(gpt2))
    tok = load_tokenizer(TokenizerSpec("GPT2BPETokenizer", vocab_file=str(gpt2 / "vocab.json"),
                                       merge_file=str(gpt2 / "merges.txt")))
    vocab = json.loads((gpt2 / "vocab.json").read_text())
    assert (tok.vocab_size, tok.eod_id) == (len(vocab), vocab["<|endoftext|>"])
    assert (len(ref), ref.eos_token_id) == (tok.vocab_size, tok.eod_id)
    ids = tok.encode(TEXTS)
    assert ids == [ref(t).input_ids for t in TEXTS]
    assert [tok.decode(x) for x in ids] == TEXTS


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktoken_ids_are_plain_tiktoken_shifted_past_the_special_tokens(files, pattern,
                                                                          tmp_path) -> None:
    """Megatron's layout: 1000 special tokens (</s> = EOD = 2), then the ranks; --vocab-size
    keeps that many ids. The export's tokenizer.json gives the same ids in transformers."""
    n = files["num_ranks"]
    tok = load_tokenizer(TokenizerSpec("TikTokenizer", str(files["tiktoken"]), vocab_size=1000 + n,
                                       tiktoken_pattern=pattern))
    assert (tok.vocab_size, tok.eod_id, tok.bos_id, tok.pad_id) == (1000 + n, 2, 1, 4)
    entries = json.loads(files["tiktoken"].read_text())
    plain = tiktoken.Encoding("plain", pat_str=PATTERNS[pattern], special_tokens={},
                              mergeable_ranks={base64.b64decode(e["token_bytes"]): e["rank"]
                                               for e in entries})
    ids = tok.encode(LINES)
    assert ids == [[i + 1000 for i in plain.encode_ordinary(t)] for t in LINES]
    assert tok.encode(["x</s>y"])[0][1] == 2  # special tokens in the text are themselves
    assert [tok.decode(x) for x in tok.encode(TEXTS)] == TEXTS
    fewer = load_tokenizer(TokenizerSpec("TikTokenizer", str(files["tiktoken"]),
                                         vocab_size=1300, tiktoken_num_special_tokens=1000))
    assert fewer.vocab_size == 1300 and max(max(x) for x in fewer.encode(TEXTS)) < 1300
    tok.save_hf(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert [ref(t).input_ids for t in TEXTS] == tok.encode(TEXTS)
    assert (len(ref), ref.eos_token_id) == (tok.vocab_size, 2)


def test_null_tokenizer_eod_and_ids() -> None:
    tok = load_tokenizer(TokenizerSpec("NullTokenizer", vocab_size=128256))
    assert tok.eod_id == 128255
    tok = load_tokenizer(TokenizerSpec("NullTokenizer", vocab_size=128256,
                                       null_tokenizer_eod_id=128001))
    assert tok.eod_id == 128001 and tok.encode(["5 17 128001"]) == [[5, 17, 128001]]
    with pytest.raises(TokenizerError, match="--null-tokenizer-eod-id 128256 is outside"):
        load_tokenizer(TokenizerSpec("NullTokenizer", vocab_size=128256,
                                     null_tokenizer_eod_id=128256))


def test_bad_input_names_the_flag(files, tmp_path, capsys) -> None:
    gpt2, llama = files["gpt2"], files["llama3"]
    cases = [
        (TokenizerSpec("GPT2BPETokenizer", vocab_file=str(gpt2 / "vocab.json")),
         "pass --merge-file"),
        (TokenizerSpec("GPT2BPETokenizer", vocab_file=str(tmp_path / "nope.json"),
                       merge_file=str(gpt2 / "merges.txt")), "--vocab-file .*nope.json: no such"),
        (TokenizerSpec("GPT2BPETokenizer", str(llama), str(gpt2 / "vocab.json"),
                       str(gpt2 / "merges.txt")), "not --tokenizer-model"),
        (TokenizerSpec("HuggingFaceTokenizer", str(llama), vocab_file=str(gpt2 / "vocab.json")),
         "--vocab-file is read by --tokenizer-type GPT2BPETokenizer only"),
        (TokenizerSpec("HuggingFaceTokenizer", str(tmp_path)), "no tokenizer.json"),
        (TokenizerSpec(None, str(llama)), "needs --tokenizer-type HuggingFaceTokenizer"),
        (TokenizerSpec("TikTokenizer", str(llama / "tokenizer.json")),
         "needs --tokenizer-type HuggingFaceTokenizer"),
        (TokenizerSpec("TikTokenizer", str(files["tiktoken"])),
         "--vocab-size 131072 .* pass --vocab-size"),
        (TokenizerSpec("HuggingFaceTokenizer", str(llama), special_tokens=["<x>"]),
         "--tokenizer-special-tokens is read by --tokenizer-type TikTokenizer only"),
        (TokenizerSpec("HuggingFaceTokenizer", str(llama), null_tokenizer_eod_id=3),
         "--null-tokenizer-eod-id is read by --tokenizer-type NullTokenizer only"),
    ]
    for spec, message in cases:
        with pytest.raises(TokenizerError, match=message):
            load_tokenizer(spec)
    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "hi"}\n')
    code = preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "o"),
                            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                            str(gpt2 / "vocab.json")])
    assert code == 2 and "pass --merge-file" in capsys.readouterr().err


def _preprocess(tmp_path: Path, name: str, *tok_flags: str) -> tuple[str, list[str]]:
    docs = [f"{LINES[i % 4]} document {i}" for i in range(60)]
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prefix = str(tmp_path / name)
    assert preprocess_main(["--input", str(src), "--output-prefix", prefix, "--workers", "1",
                            "--append-eod", *tok_flags]) == 0
    return prefix, docs


@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "GPT2BPETokenizer", "TikTokenizer"])
def test_preprocess_writes_the_ids_and_records_the_tokenizer(files, tmp_path, kind) -> None:
    gpt2, n = files["gpt2"], files["num_ranks"]
    spec = {"HuggingFaceTokenizer": TokenizerSpec(kind, str(files["llama3"])),
            "GPT2BPETokenizer": TokenizerSpec(kind, vocab_file=str(gpt2 / "vocab.json"),
                                              merge_file=str(gpt2 / "merges.txt")),
            "TikTokenizer": TokenizerSpec(kind, str(files["tiktoken"]), vocab_size=1000 + n)}[kind]
    prefix, docs = _preprocess(tmp_path, "c", *spec.flags().split())
    shard = IndexedShard(prefix + "_00000")
    tok = load_tokenizer(spec)
    assert [shard[i].tolist() for i in range(len(shard))] == [
        [*x, tok.eod_id] for x in tok.encode(docs)]
    t = load_manifest(prefix + ".manifest.json").tokenizer
    assert (t["type"], t["vocab_size"], t["eod_id"]) == (kind, tok.vocab_size, tok.eod_id)
    assert t["flags"].startswith(f"--tokenizer-type {kind}")


def test_llama3_style_run_preprocesses_trains_finds_documents_and_exports(files, tmp_path,
                                                                          capsys) -> None:
    tok_flags = ["--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-model", str(files["llama3"])]
    prefix, _ = _preprocess(tmp_path, "llama", *tok_flags)
    argv = [*tok_flags, "--data-path", prefix, "--split", "90,10,0", "--eod-mask-loss",
            "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
            "--eval-iters", "0", "--lr", "1e-3", "--peak-tflops", "1",
            "--save", str(tmp_path / "ckpt"), "--save-interval", "3"]
    cfg = parse_config(argv)
    eod = load_tokenizer(TokenizerSpec("HuggingFaceTokenizer", str(files["llama3"]))).eod_id
    info = resolve_tokenizer(cfg)
    assert info.eod_id == eod and cfg.model.vocab_size == info.vocab_size
    batch = build_loaders(cfg, 0, 1).train.next_step()[0]
    ends = batch["tokens"] == eod
    assert ends.sum() >= 2  # document boundaries found, and the loss skips them
    assert batch["loss_mask"].eq((~ends).float()).all()
    losses = run(parse_config(argv)).losses
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses

    out = tmp_path / "hf"
    export(tmp_path / "ckpt", out)
    ref = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = load_tokenizer(TokenizerSpec("HuggingFaceTokenizer", str(files["llama3"])))
    assert [ref(t).input_ids for t in TEXTS] == ours.encode(TEXTS)
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eod

    wrong = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(info.vocab_size),
             "--null-tokenizer-eod-id", str(eod - 1)]
    with pytest.raises(ConfigError, match=r"tokenizer mismatch.*--null-tokenizer-eod-id.*"
                       r"made with --tokenizer-type HuggingFaceTokenizer"):
        resolve_tokenizer(parse_config([*argv[4:], *wrong]))
    same = [*wrong[:-1], str(eod)]  # Megatron's way to read Llama-3 shards without the files
    assert resolve_tokenizer(parse_config([*argv[4:], *same])).eod_id == eod

    # scripts/generate.py finds the run's tokenizer in the checkpoint: greedy ids, decoded
    generate = runpy.run_path(str(Path(__file__).parents[2] / "scripts" / "generate.py"))
    assert generate["main"](["--load", str(tmp_path / "ckpt"), "--prompt", "Hello",
                             "--max-new-tokens", "3"]) == 0
    model_cfg, chunk = load_model(tmp_path / "ckpt")
    prompt = ours.encode(["Hello"])[0]
    ids = list(prompt)
    for _ in range(3):
        ids.append(int(model_logits(chunk, torch.tensor([ids]), model_cfg.vocab_size)[0, -1]
                       .argmax()))
        if ids[-1] == eod:
            break
    assert capsys.readouterr().out.splitlines()[-1] == "Hello" + ours.decode(ids[len(prompt):])
