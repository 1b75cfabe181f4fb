"""Input discovery shared by tokenizer training and `data_tools.preprocess`.

Inputs are files or directories (searched recursively, sorted so every run sees the same order).
`.jsonl` / `.json` files hold one JSON object per line; anything else is plain text. A trailing
`.gz` is decompressed on the fly.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizer.tokenizer import TokenizerError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


def expand_inputs(paths: Iterable[str | Path], suffixes: tuple[str, ...] | None = None
                  ) -> list[Path]:
    """Files behind the given paths; directories contribute their files in sorted order."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(f for f in sorted(p.rglob("*"))
                         if f.is_file() and (suffixes is None or f.name.endswith(suffixes)))
        elif p.exists():
            files.append(p)
        else:
            raise TokenizerError(f"--input {p}: no such file or directory")
    if not files:
        raise TokenizerError(f"--input {' '.join(map(str, paths))}: no input files found")
    return files


def is_jsonl(path: Path) -> bool:
    name = path.name.removesuffix(".gz")
    return name.endswith(JSONL_SUFFIXES)


def open_binary(path: Path) -> io.BufferedIOBase:
    """Raw bytes of a file, decompressing `.gz`."""
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def iter_texts(path: Path, json_key: str = "text") -> Iterator[str]:
    """Documents of one file as text (invalid UTF-8 replaced, malformed JSON lines skipped).

    Used for tokenizer training, where a bad line should not stop a sample; the preprocessor
    has its own strict reader that reports `file:line`.
    """
    import json

    with open_binary(path) as f:
        if not is_jsonl(path):
            yield f.read().decode("utf-8", errors="replace")
            return
        for line in f:
            try:
                text = json.loads(line)[json_key]
            except (ValueError, KeyError, TypeError):
                continue
            if isinstance(text, str):
                yield text
