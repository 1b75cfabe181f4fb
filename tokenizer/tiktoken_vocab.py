"""Megatron's TikTokenizer: a `tiktoken` BPE read from Megatron's JSON vocabulary file.

The file is a JSON list; entry i is {"rank": i, "token_bytes": base64, "token_str": text}, and
the first 256 entries are the single bytes 0..255 in order. The ids are
[special tokens (--tiktoken-num-special-tokens, default 1000)] + [the first
--vocab-size - that many ranks]; --vocab-size defaults to 131072. The special tokens are
--tokenizer-special-tokens (default <unk> <s> </s> <mask> <pad> <cls> <sep>) padded with
<SPECIAL_i>; EOD is </s>'s index (2), BOS <s>'s, pad <pad>'s. Special tokens written in the
text are encoded as themselves. --tiktoken-pattern picks the pre-tokenizer regex (default v2).
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import tiktoken
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as FastTokenizer

from tokenizer.tokenizer import TokenizerError

# Megatron's two splitting regexes, character for character (the ids depend on them).
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
REQUIRED_SPECIALS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
DEFAULT_VOCAB = 2**17


def read_ranks(path: Path) -> list[bytes]:
    """The token bytes of each rank, checked against the format."""
    flag = f"--tokenizer-model {path}"
    if not path.is_file():
        raise TokenizerError(f"{flag}: no such file (TikTokenizer reads Megatron's tiktoken "
                             "vocabulary .json)")
    try:
        entries = json.loads(path.read_text())
    except ValueError as e:
        raise TokenizerError(f"{flag}: not JSON ({e}); TikTokenizer reads a JSON list of "
                             '{"rank", "token_bytes", "token_str"}') from None
    if not isinstance(entries, list):
        raise TokenizerError(f"{flag}: a TikTokenizer vocabulary is a JSON list of ranks, not a "
                             f"{type(entries).__name__} (a tokenizer.json needs "
                             "--tokenizer-type HuggingFaceTokenizer)")
    ranks = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or entry.get("rank") != i or "token_bytes" not in entry:
            raise TokenizerError(f"{flag}: entry {i} is not {{\"rank\": {i}, \"token_bytes\": "
                                 "base64, \"token_str\": ...}")
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise TokenizerError(f"{flag}: entries 0..255 must be the single bytes in order; "
                                 f"entry {i} is {token!r}")
        ranks.append(token)
    if len(set(ranks)) != len(ranks):
        raise TokenizerError(f"{flag}: the same token bytes appear at two ranks")
    return ranks


class TikTokenizer:
    """Megatron's TikTokenizer ids, encoded by tiktoken."""

    def __init__(self, path: str | Path, pattern: str = "v2", num_special_tokens: int = 1000,
                 special_tokens: list[str] | None = None, vocab_size: int | None = None) -> None:
        self.path = Path(path)
        if pattern not in PATTERNS:
            raise TokenizerError(f"--tiktoken-pattern {pattern}: use v1 or v2")
        self.pattern = PATTERNS[pattern]
        specials = list(special_tokens or REQUIRED_SPECIALS)
        missing = [t for t in REQUIRED_SPECIALS if t not in specials]
        if missing or len(set(specials)) != len(specials):
            raise TokenizerError("--tokenizer-special-tokens must list each token once and "
                                 f"include {' '.join(REQUIRED_SPECIALS)}")
        vocab = vocab_size or DEFAULT_VOCAB
        if not len(specials) <= num_special_tokens < vocab:
            raise TokenizerError(f"--tiktoken-num-special-tokens {num_special_tokens} must be at "
                                 f"least the {len(specials)} special tokens and below "
                                 f"--vocab-size {vocab}")
        ranks = read_ranks(self.path)
        inner = vocab - num_special_tokens
        if len(ranks) < inner:
            raise TokenizerError(
                f"--vocab-size {vocab} with --tiktoken-num-special-tokens {num_special_tokens} "
                f"takes {inner} ranks, but --tokenizer-model {path} has {len(ranks)}: pass "
                f"--vocab-size {len(ranks) + num_special_tokens} (or less)")
        self.ranks = ranks[:inner]
        self.specials = specials + [f"<SPECIAL_{i}>" for i in range(len(specials),
                                                                    num_special_tokens)]
        self.num_special = num_special_tokens
        self.enc = tiktoken.Encoding(
            name=self.path.stem, pat_str=self.pattern,
            mergeable_ranks={t: r + num_special_tokens for r, t in enumerate(self.ranks)},
            special_tokens={t: i for i, t in enumerate(self.specials)})

    @property
    def vocab_size(self) -> int:
        return self.num_special + len(self.ranks)

    @property
    def eod_id(self) -> int:
        return self.specials.index("</s>")

    @property
    def bos_id(self) -> int:
        return self.specials.index("<s>")

    @property
    def pad_id(self) -> int:
        return self.specials.index("<pad>")

    def encode(self, text: list[str]) -> list[list[int]]:
        return self.enc.encode_batch(text, num_threads=1, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    def save_hf(self, out: Path) -> None:
        """The same ids as a Hugging Face byte-level BPE (tokenizer.json), plus Megatron's
        vocabulary file as tiktoken.json."""
        (out / "tiktoken.json").write_bytes(self.path.read_bytes())
        to_fast(self).save(str(out / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                  "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: byte b as one printable character (printable bytes stand
    for themselves, the rest take code points from 256 up, in byte order)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 256
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _halves(token: bytes, rank: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The last merge that builds `token`: BPE over its bytes with the lower ranks only."""
    parts = [token[i:i + 1] for i in range(len(token))]
    limit = rank[token]
    while len(parts) > 2:
        best = min(range(len(parts) - 1),
                   key=lambda i: rank.get(parts[i] + parts[i + 1], limit))
        if rank.get(parts[best] + parts[best + 1], limit) >= limit:
            return None
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def to_fast(tok: TikTokenizer) -> FastTokenizer:
    """A `tokenizers` BPE giving tiktoken's ids: merges in rank order, whole-word lookups first
    (tiktoken's rule), the same regex split, special tokens matched in the text."""
    alphabet = byte_chars()

    def text(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    rank = {t: r for r, t in enumerate(tok.ranks)}
    vocab = {s: i for i, s in enumerate(tok.specials)}
    vocab.update({text(t): r + tok.num_special for r, t in enumerate(tok.ranks)})
    merges = []
    for t in tok.ranks[256:]:
        halves = _halves(t, rank)
        if halves is not None:
            merges.append((text(halves[0]), text(halves[1])))
    fast = FastTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    fast.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tok.pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    fast.decoder = decoders.ByteLevel()
    fast.add_special_tokens(tok.specials)
    return fast
