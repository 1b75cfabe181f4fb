"""Cut the inputs into ~256 KiB chunks of whole documents, in a fixed order.

Parsing and tokenizing happen in the workers. A plain (uncompressed, regular) JSONL file is
cut into byte ranges that each worker reads from disk itself, so the parent never reads or
pipes its bytes; other inputs are read by the parent, which finds the cut points. Chunks depend
on the inputs alone (never on the worker count), which is what makes the output byte-identical
for any `--workers`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizer.corpus import is_jsonl, open_binary

CHUNK_BYTES = 1 << 18  # small enough that the last tasks balance across workers
_BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*\n")


@dataclass
class Chunk:
    """Work for one worker task. kind: "jsonl" | "docs" (each item one document) | "blank",
    or "range": the JSONL lines that start in bytes [start, end) of a file, read by the worker
    (`read_range`); `span` holds (file name, start, end) and items is empty."""

    kind: str
    items: list[tuple[str, int, bytes]]  # (file name, first line number, raw bytes)
    span: tuple[str, int, int] | None = None  # "range": (file name, start, end)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for _, _, b in self.items)


def read_range(name: str, start: int, end: int) -> tuple[int, bytes]:
    """(offset, bytes) of the whole lines of a file that start in [start, end).

    A line cut by `start` belongs to the range before; one cut by `end` is read to its end.
    """
    with open(name, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            if f.read(1) != b"\n":
                f.readline()  # the rest of a line that started before `start`
        offset = f.tell()
        if offset >= end:
            return offset, b""
        data = f.read(end - offset)
        if data and not data.endswith(b"\n"):
            data += f.readline()
        return offset, data


def line_number(name: str, offset: int) -> int:
    """1-based number of the line starting at byte `offset` (for error messages only)."""
    count, done = 1, 0
    with open(name, "rb") as f:
        while done < offset and (block := f.read(min(1 << 20, offset - done))):
            count += block.count(b"\n")
            done += len(block)
    return count


def _range_chunks(path: Path, size: int) -> Iterator[Chunk]:
    """Ranges of `size` bytes, then eighths over the file's last 4 x `size`, so that the
    workers finish a large file together instead of one waiting on the other's last range."""
    total = path.stat().st_size
    start = 0
    while start < total:
        step = size if total - start > 4 * size else max(1, size // 8)
        yield Chunk("range", [], (str(path), start, min(start + step, total)))
        start += step


def _jsonl_chunks(path: Path, size: int) -> Iterator[Chunk]:
    line = 1
    rest = b""
    with open_binary(path) as f:
        while block := f.read(size):
            data = rest + block
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # one line longer than a block: keep reading
                rest = data
                continue
            yield Chunk("jsonl", [(str(path), line, data[:cut])])
            line += data.count(b"\n", 0, cut)
            rest = data[cut:]
    if rest:
        yield Chunk("jsonl", [(str(path), line, rest)])


def _blank_line_chunks(path: Path, size: int) -> Iterator[Chunk]:
    """Plain text split into documents at blank lines; chunks end at a blank line."""
    line = 1
    rest = b""
    with open_binary(path) as f:
        while block := f.read(size):
            data = rest + block
            ends = [m.end() for m in _BLANK_LINE.finditer(data, max(0, len(rest) - 256))]
            if not ends:
                rest = data
                continue
            cut = ends[-1]
            yield Chunk("blank", [(str(path), line, data[:cut])])
            line += data.count(b"\n", 0, cut)
            rest = data[cut:]
    if rest:
        yield Chunk("blank", [(str(path), line, rest)])


def iter_chunks(files: list[Path], split_on_blank_lines: bool,
                size: int = CHUNK_BYTES) -> Iterator[Chunk]:
    """All chunks of all files, in file order. Whole-file documents are batched together."""
    pending: list[tuple[str, int, bytes]] = []
    pending_bytes = 0
    for path in files:
        if is_jsonl(path) or split_on_blank_lines:
            if pending:
                yield Chunk("docs", pending)
                pending, pending_bytes = [], 0
            if not is_jsonl(path):
                yield from _blank_line_chunks(path, size)
            elif path.is_file() and not path.name.endswith(".gz"):  # seekable: workers read
                yield from _range_chunks(path, size)
            else:
                yield from _jsonl_chunks(path, size)
            continue
        with open_binary(path) as f:
            data = f.read()
        pending.append((str(path), 1, data))
        pending_bytes += len(data)
        if pending_bytes >= size:
            yield Chunk("docs", pending)
            pending, pending_bytes = [], 0
    if pending:
        yield Chunk("docs", pending)
