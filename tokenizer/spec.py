"""Which tokenizer a run or a preprocessing job uses: Megatron-LM's flags, one meaning in both.

`--tokenizer-type` picks the library, as in Megatron:
- SentencePieceTokenizer / GPTSentencePieceTokenizer / Llama2Tokenizer (or no type):
  `--tokenizer-model TOK.model`, EOD = the model's EOS piece;
- HuggingFaceTokenizer: `--tokenizer-model` = a tokenizer.json or the directory holding one
  (the `tokenizers` library), EOD = the `eos_token` of tokenizer_config.json (Llama-3: 128001);
- GPT2BPETokenizer: `--vocab-file vocab.json --merge-file merges.txt`, EOD = <|endoftext|>;
- TikTokenizer: `--tokenizer-model` = Megatron's JSON list of base64 ranks (`tiktoken`), with
  `--tiktoken-pattern`, `--tiktoken-num-special-tokens`, `--tokenizer-special-tokens` and
  `--vocab-size`; EOD = the id of `</s>` among the special tokens (2 by default);
- NullTokenizer: no file; vocab = --vocab-size, EOD = --null-tokenizer-eod-id (default
  vocab - 1), documents are whitespace-separated ids.
The shard manifest records `record(tok, spec)`; start-up compares it with the run's tokenizer.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tokenizer.tokenizer import Tokenizer, TokenizerError

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = (*SENTENCEPIECE_TYPES, "HuggingFaceTokenizer", "GPT2BPETokenizer",
                   "TikTokenizer", "NullTokenizer")
TIKTOKEN_DEFAULT_VOCAB = 2**17
"""Megatron's TikTokenizer vocabulary when --vocab-size is not given (131072)."""


class TextTokenizer(Protocol):
    """What preprocessing, training and export need of every tokenizer."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def eod_id(self) -> int | None: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def pad_id(self) -> int | None: ...

    def encode(self, text: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[int]) -> str: ...
    def sha256(self) -> str | None: ...
    def save_hf(self, out: Path) -> None:
        """Write the files `transformers.AutoTokenizer.from_pretrained(out)` loads."""


@dataclass
class TokenizerSpec:
    """The tokenizer flags of a run (DataConfig) or of data_tools.preprocess, as Megatron's."""

    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None
    """--vocab-size: NullTokenizer's vocabulary; TikTokenizer's (default 131072)."""
    tiktoken_pattern: str | None = None
    tiktoken_num_special_tokens: int = 1000
    special_tokens: list[str] = field(default_factory=list)
    null_tokenizer_eod_id: int | None = None
    hf_include_special_tokens: bool = True

    @classmethod
    def from_data_config(cls, data: Mapping[str, Any], vocab_size: int | None
                         ) -> TokenizerSpec | None:
        """From megatron_lite's DataConfig fields (a dict: checkpoints store it so); None when
        no tokenizer flag is set. `vocab_size`: --vocab-size, None where it was not given."""
        if not any(data.get(k) for k in ("tokenizer_type", "tokenizer_model", "vocab_file",
                                         "merge_file")):
            return None
        return cls(data.get("tokenizer_type"), data.get("tokenizer_model"),
                   data.get("vocab_file"), data.get("merge_file"), vocab_size,
                   data.get("tiktoken_pattern"), data.get("tiktoken_num_special_tokens", 1000),
                   list(data.get("special_tokens") or []), data.get("null_tokenizer_eod_id"),
                   not data.get("tokenizer_hf_no_include_special_tokens", False))

    @property
    def kind(self) -> str:
        return self.tokenizer_type or "SentencePieceTokenizer"

    def check(self) -> None:
        """Each type's files given, and no flag that belongs to another type."""
        kind = self.kind
        if kind not in TOKENIZER_TYPES:
            raise TokenizerError(f"--tokenizer-type {kind}: not one of "
                                 + ", ".join(TOKENIZER_TYPES))
        if kind == "GPT2BPETokenizer":
            missing = [f for f, v in (("--vocab-file", self.vocab_file),
                                      ("--merge-file", self.merge_file)) if not v]
            if missing:
                raise TokenizerError("--tokenizer-type GPT2BPETokenizer reads --vocab-file "
                                     "vocab.json and --merge-file merges.txt; pass "
                                     + " and ".join(missing))
            if self.tokenizer_model:
                raise TokenizerError("--tokenizer-type GPT2BPETokenizer reads --vocab-file and "
                                     "--merge-file, not --tokenizer-model: drop one of them")
        else:
            for flag, value in (("--vocab-file", self.vocab_file),
                                ("--merge-file", self.merge_file)):
                if value:
                    raise TokenizerError(f"{flag} is read by --tokenizer-type GPT2BPETokenizer "
                                         f"only, not {kind}: drop it or change the type")
        if kind == "NullTokenizer":
            if self.tokenizer_model:
                raise TokenizerError("--tokenizer-type NullTokenizer reads no file (vocab = "
                                     "--vocab-size); drop --tokenizer-model")
        elif kind != "GPT2BPETokenizer" and not self.tokenizer_model:
            what = {"HuggingFaceTokenizer": "a tokenizer.json or its directory",
                    "TikTokenizer": "the tiktoken vocabulary .json"}.get(kind, "the .model file")
            raise TokenizerError(f"--tokenizer-type {kind} loads --tokenizer-model: pass {what}")
        if self.special_tokens and kind != "TikTokenizer":
            raise TokenizerError("--tokenizer-special-tokens is read by --tokenizer-type "
                                 f"TikTokenizer only here; {kind} takes its special tokens from "
                                 "its files")
        if self.null_tokenizer_eod_id is not None and kind != "NullTokenizer":
            raise TokenizerError("--null-tokenizer-eod-id is read by --tokenizer-type "
                                 f"NullTokenizer only; {kind} takes EOD from its files")

    def flags(self) -> str:
        """The flags that rebuild this tokenizer (for error messages and the manifest)."""
        parts = [f"--tokenizer-type {self.kind}"]
        for flag, value in (("--tokenizer-model", self.tokenizer_model),
                            ("--vocab-file", self.vocab_file), ("--merge-file", self.merge_file)):
            if value:
                parts.append(f"{flag} {value}")
        if self.kind == "TikTokenizer":
            parts.append(f"--tiktoken-pattern {self.tiktoken_pattern or 'v2'} "
                         f"--tiktoken-num-special-tokens {self.tiktoken_num_special_tokens}")
        if self.kind in ("TikTokenizer", "NullTokenizer") and self.vocab_size:
            parts.append(f"--vocab-size {self.vocab_size}")
        if self.null_tokenizer_eod_id is not None:
            parts.append(f"--null-tokenizer-eod-id {self.null_tokenizer_eod_id}")
        return " ".join(parts)


def load_tokenizer(spec: TokenizerSpec) -> TextTokenizer:
    """The tokenizer the flags describe; a wrong combination or file raises TokenizerError."""
    spec.check()
    kind = spec.kind
    if kind in SENTENCEPIECE_TYPES:
        model = Path(spec.tokenizer_model or "")
        if model.is_dir() or model.suffix == ".json":
            raise TokenizerError(f"--tokenizer-model {model} is not a sentencepiece .model; a "
                                 "Hugging Face tokenizer needs --tokenizer-type "
                                 "HuggingFaceTokenizer")
        return Tokenizer(model)
    if kind == "HuggingFaceTokenizer":
        from tokenizer.huggingface import HuggingFaceTokenizer

        return HuggingFaceTokenizer(spec.tokenizer_model or "", spec.hf_include_special_tokens)
    if kind == "GPT2BPETokenizer":
        from tokenizer.huggingface import gpt2_bpe

        return gpt2_bpe(spec.vocab_file or "", spec.merge_file or "")
    if kind == "TikTokenizer":
        from tokenizer.tiktoken_vocab import TikTokenizer

        return TikTokenizer(spec.tokenizer_model or "", spec.tiktoken_pattern or "v2",
                            spec.tiktoken_num_special_tokens, spec.special_tokens or None,
                            spec.vocab_size)
    return NullTokenizer(spec.vocab_size, spec.null_tokenizer_eod_id)


def record(tok: TextTokenizer, spec: TokenizerSpec) -> dict:
    """The manifest's `tokenizer` entry: what made the shards, and the ids training needs."""
    files = {"model": spec.tokenizer_model, "vocab_file": spec.vocab_file,
             "merge_file": spec.merge_file}
    out: dict = {"type": spec.kind, "flags": spec.flags()}
    out.update({k: str(Path(v).resolve()) for k, v in files.items() if v})
    out.update(sha256=tok.sha256(), vocab_size=tok.vocab_size, eod_id=tok.eod_id,
               bos_id=tok.bos_id, pad_id=tok.pad_id)
    return out


class NullTokenizer:
    """Megatron's NullTokenizer: a document is its ids written as text ("5 17 3")."""

    def __init__(self, vocab_size: int | None, eod_id: int | None) -> None:
        if not vocab_size or vocab_size < 1:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size N")
        self._vocab_size = vocab_size
        self._eod = vocab_size - 1 if eod_id is None else eod_id
        if not 0 <= self._eod < vocab_size:
            raise TokenizerError(f"--null-tokenizer-eod-id {eod_id} is outside the vocabulary "
                                 f"0..{vocab_size - 1} (--vocab-size {vocab_size})")

    vocab_size = property(lambda self: self._vocab_size)
    eod_id = property(lambda self: self._eod)
    bos_id = pad_id = property(lambda self: None)

    def encode(self, text: list[str]) -> list[list[int]]:
        try:
            ids = [[int(x) for x in t.split()] for t in text]
        except ValueError as e:
            raise TokenizerError(f"--tokenizer-type NullTokenizer reads documents of integer "
                                 f"ids separated by spaces ({e})") from None
        bad = next((i for doc in ids for i in doc if not 0 <= i < self._vocab_size), None)
        if bad is not None:
            raise TokenizerError(f"--tokenizer-type NullTokenizer: id {bad} is outside "
                                 f"--vocab-size {self._vocab_size}")
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))

    def sha256(self) -> None:
        return None

    def save_hf(self, out: Path) -> None:
        """No files: a NullTokenizer run's ids are the text."""


def add_tokenizer_flags(parser: argparse.ArgumentParser) -> None:
    """The tokenizer flags of data_tools.preprocess: the names and meaning pretrain.py has."""
    g = parser.add_argument_group("tokenizer (the flags pretrain.py takes)")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, help="default: sentencepiece")
    g.add_argument("--tokenizer-model", help="sentencepiece .model, Hugging Face tokenizer.json "
                   "(or its directory), or tiktoken vocabulary .json")
    g.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--vocab-size", type=int, help="NullTokenizer's vocabulary; TikTokenizer's "
                   f"(default {TIKTOKEN_DEFAULT_VOCAB})")
    g.add_argument("--tiktoken-pattern", choices=["v1", "v2"], help="default: v2")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    g.add_argument("--tokenizer-special-tokens", nargs="*", default=[],
                   help="TikTokenizer's special tokens (must include <unk> <s> </s> <mask> "
                   "<pad> <cls> <sep>)")
    g.add_argument("--null-tokenizer-eod-id", type=int, help="NullTokenizer's EOD "
                   "(default vocab - 1)")
    g.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true",
                   help="HuggingFaceTokenizer: do not add the post-processor's BOS/EOS")


def spec_from_args(args: argparse.Namespace) -> TokenizerSpec:
    return TokenizerSpec(args.tokenizer_type, args.tokenizer_model, args.vocab_file,
                         args.merge_file, args.vocab_size, args.tiktoken_pattern,
                         args.tiktoken_num_special_tokens, args.tokenizer_special_tokens,
                         args.null_tokenizer_eod_id,
                         not args.tokenizer_hf_no_include_special_tokens)
