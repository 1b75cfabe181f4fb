"""HuggingFaceTokenizer and GPT2BPETokenizer on the `tokenizers` library (no transformers).

Megatron builds both with transformers' AutoTokenizer; the ids it trains on are those of the
fast tokenizer's tokenizer.json (its post-processor adds BOS for Llama-3), and the special tokens
come from tokenizer_config.json / special_tokens_map.json. EOD is the eos token (the sep token
when there is no eos; Llama-3: <|end_of_text|> = 128001); the vocabulary counts added tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tokenizers import Tokenizer as FastTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from tokenizer.tokenizer import TokenizerError

_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "sep_token", "cls_token", "unk_token")
GPT2_EOD = "<|endoftext|>"


class HuggingFaceTokenizer:
    """A fast tokenizer plus the special tokens its configuration names."""

    def __init__(self, path: str | Path, include_special_tokens: bool = True, *,
                 fast: FastTokenizer | None = None, specials: dict[str, str] | None = None,
                 flag: str = "--tokenizer-model", extra_files: tuple[Path, ...] = ()) -> None:
        self.flag = f"{flag} {path}"
        self.extra_files = extra_files
        """Copied next to tokenizer.json on export (GPT-2's vocab.json and merges.txt)."""
        self.config_dir: Path | None = None
        self.include_special_tokens = include_special_tokens
        # preprocess forks its workers: the library's own threads would be off there anyway
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if fast is None:
            self.json_path, self.config_dir = _locate(Path(path))
            try:
                fast = FastTokenizer.from_file(str(self.json_path))
            except Exception as e:  # the library raises bare Exceptions on a bad file
                raise TokenizerError(f"{self.flag}: {self.json_path} is not a Hugging Face "
                                     f"tokenizer.json ({e})") from None
            specials = _configured_specials(self.config_dir)
        self.fast = fast
        self.specials = dict(specials or {})
        # Megatron's fallbacks: eos from sep, bos from cls
        if "eos_token" not in self.specials and "sep_token" in self.specials:
            self.specials["eos_token"] = self.specials["sep_token"]
        if "bos_token" not in self.specials and "cls_token" in self.specials:
            self.specials["bos_token"] = self.specials["cls_token"]
        self._ids = {name: self._id(name) for name in self.specials}

    def _id(self, name: str) -> int:
        token = self.specials[name]
        token_id = self.fast.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{self.flag}: its {name} {token!r} is not in the vocabulary; "
                                 "fix tokenizer_config.json or add the token to tokenizer.json")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self.fast.get_vocab_size(with_added_tokens=True)

    @property
    def eod_id(self) -> int | None:
        return self._ids.get("eos_token")

    @property
    def bos_id(self) -> int | None:
        return self._ids.get("bos_token")

    @property
    def pad_id(self) -> int | None:
        return self._ids.get("pad_token")

    def encode(self, text: list[str]) -> list[list[int]]:
        encodings = self.fast.encode_batch(text, add_special_tokens=self.include_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: list[int]) -> str:
        return self.fast.decode(ids, skip_special_tokens=False)

    def sha256(self) -> str:
        return hashlib.sha256(self.fast.to_str().encode()).hexdigest()

    def save_hf(self, out: Path) -> None:
        """tokenizer.json plus the configuration that names its special tokens (the original
        files when there are some, so a chat template or tokenizer class survives)."""
        self.fast.save(str(out / "tokenizer.json"))
        for file, name in zip(self.extra_files, ("vocab.json", "merges.txt"), strict=False):
            (out / name).write_bytes(file.read_bytes())
        copied = False
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if self.config_dir is not None and (self.config_dir / name).is_file():
                (out / name).write_bytes((self.config_dir / name).read_bytes())
                copied = True
        if not copied:
            config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.specials}
            (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def _locate(path: Path) -> tuple[Path, Path]:
    """(tokenizer.json, the directory whose config files name the special tokens)."""
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(
                f"--tokenizer-model {path}: no tokenizer.json in that directory; "
                "HuggingFaceTokenizer loads a fast tokenizer (convert a slow one once with "
                "transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))")
        return path / "tokenizer.json", path
    if not path.is_file():
        raise TokenizerError(f"--tokenizer-model {path}: no such file or directory (pass a "
                             "tokenizer.json or the directory holding it)")
    return path, path.parent


def _configured_specials(directory: Path) -> dict[str, str]:
    """Special tokens named by tokenizer_config.json, then special_tokens_map.json."""
    found: dict[str, str] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = directory / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text())
        except ValueError as e:
            raise TokenizerError(f"{file}: not valid JSON ({e})") from None
        for key in _SPECIAL_NAMES:
            value = data.get(key)
            if isinstance(value, dict):  # {"content": "<|end_of_text|>", ...}
                value = value.get("content")
            if isinstance(value, str) and key not in found:
                found[key] = value
    return found


def gpt2_bpe(vocab_file: str, merge_file: str) -> HuggingFaceTokenizer:
    """GPT-2's byte-level BPE from vocab.json + merges.txt; EOD (and BOS, as in transformers'
    GPT-2 tokenizer) = <|endoftext|>; no token is added to a document."""
    for flag, file in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if not Path(file).is_file():
            raise TokenizerError(f"{flag} {file}: no such file (GPT2BPETokenizer needs "
                                 "--vocab-file vocab.json and --merge-file merges.txt)")
    try:
        model = models.BPE.from_file(vocab_file, merge_file)
    except Exception as e:  # the library raises bare Exceptions
        raise TokenizerError(f"--vocab-file {vocab_file} / --merge-file {merge_file}: not a "
                             f"GPT-2 vocab.json and merges.txt ({e})") from None
    fast = FastTokenizer(model)
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    fast.post_processor = processors.ByteLevel(trim_offsets=False)
    if fast.token_to_id(GPT2_EOD) is None:
        raise TokenizerError(f"--vocab-file {vocab_file} has no {GPT2_EOD} token, "
                             "GPT2BPETokenizer's end of document")
    fast.add_special_tokens([GPT2_EOD])
    return HuggingFaceTokenizer(vocab_file, fast=fast, flag="--vocab-file",
                                specials={"bos_token": GPT2_EOD, "eos_token": GPT2_EOD,
                                          "unk_token": GPT2_EOD},
                                extra_files=(Path(vocab_file), Path(merge_file)))
