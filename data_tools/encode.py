"""Worker side of the preprocessor: parse one chunk, tokenize it, return a flat token array.

Returning one numpy array (plus lengths) instead of Python lists keeps the pipe cheap and the
parent nearly idle, so almost all CPU goes to sentencepiece.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from data_tools.chunks import _BLANK_LINE, Chunk, line_number, read_range
from tokenizer.spec import TextTokenizer, TokenizerSpec, load_tokenizer

_SURROGATE = re.compile("[\ud800-\udfff]")


class BadInputError(ValueError):
    """A malformed input line; the message starts with `file:line`."""


@dataclass
class Stats:
    """Counts reported in the summary."""

    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    empty: int = 0
    bad_lines: int = 0
    invalid_utf8: int = 0
    bad_examples: list[str] = field(default_factory=list)

    def add(self, other: Stats) -> None:
        for name in ("documents", "tokens", "text_bytes", "empty", "bad_lines", "invalid_utf8"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.bad_examples = (self.bad_examples + other.bad_examples)[:5]


@dataclass
class Options:
    tokenizer: TokenizerSpec
    json_key: str
    append_eod: bool
    skip_bad_lines: bool
    dtype: str


_STATE: dict = {}


def init_worker(opts: Options) -> None:
    _STATE["opts"] = opts
    _STATE["tok"] = load_tokenizer(opts.tokenizer)


def _decode(raw: bytes, stats: Stats) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats.invalid_utf8 += 1
        return raw.decode("utf-8", errors="replace")


def _jsonl_texts(name: str, first_line: int | Callable[[], int], raw: bytes, opts: Options,
                 stats: Stats) -> list[str]:
    """`first_line`: the number of raw's first line, or a function that counts it (slow; only
    called for an error message)."""
    texts = []
    for i, line in enumerate(raw.split(b"\n")):
        if not line.strip():
            continue
        try:
            obj = json.loads(_decode(line, stats))
            text = obj[opts.json_key]
            if not isinstance(text, str):
                raise TypeError(f"field {opts.json_key!r} is {type(text).__name__}, not a string")
        except (ValueError, KeyError, TypeError) as e:
            reason = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            if callable(first_line):
                first_line = first_line()
            msg = f"{name}:{first_line + i}: {reason}"
            if not opts.skip_bad_lines:
                raise BadInputError(msg + " (fix the line, or pass --skip-bad-lines to skip such "
                               "lines and count them)") from None
            stats.bad_lines += 1
            stats.bad_examples.append(msg)
            continue
        texts.append(text)
    return texts


def _texts(chunk: Chunk, opts: Options, stats: Stats) -> list[str]:
    if chunk.span is not None:
        name, start, end = chunk.span
        offset, raw = read_range(name, start, end)
        stats.text_bytes = len(raw)
        return _jsonl_texts(name, partial(line_number, name, offset), raw, opts, stats)
    texts: list[str] = []
    for name, first_line, raw in chunk.items:
        if chunk.kind == "jsonl":
            texts.extend(_jsonl_texts(name, first_line, raw, opts, stats))
        elif chunk.kind == "blank":
            texts.extend(_decode(d, stats) for d in _BLANK_LINE.split(raw) if d.strip())
        else:
            texts.append(_decode(raw, stats))
    return texts


def _encode(tok: TextTokenizer, texts: list[str], stats: Stats) -> list[list[int]]:
    try:
        return tok.encode(texts)
    except (UnicodeEncodeError, TypeError):  # lone surrogates (JSON escapes): replace, count
        fixed = []
        for t in texts:
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                stats.invalid_utf8 += 1
                t = _SURROGATE.sub("\ufffd", t)
            fixed.append(t)
        return tok.encode(fixed)


def encode_chunk(chunk: Chunk) -> tuple[np.ndarray, np.ndarray, Stats]:
    """(flat tokens, int32 lengths, stats) of the non-empty documents of a chunk, in order."""
    opts: Options = _STATE["opts"]
    tok: TextTokenizer = _STATE["tok"]
    stats = Stats(text_bytes=chunk.nbytes)
    raw_texts = _texts(chunk, opts, stats)
    texts = [t for t in raw_texts if t.strip()]
    ids = [x for x in _encode(tok, texts, stats) if x]
    stats.empty = len(raw_texts) - len(ids)
    if opts.append_eod:
        eod = tok.eod_id
        for x in ids:
            x.append(eod)
    lengths = np.fromiter(map(len, ids), dtype=np.int32, count=len(ids))
    tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=opts.dtype,
                         count=int(lengths.sum(dtype=np.int64)))
    stats.documents = len(ids)
    stats.tokens = len(tokens)
    return tokens, lengths, stats
