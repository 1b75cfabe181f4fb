"""The one definition of the shard format: Megatron-LM's indexed dataset, byte for byte.

A shard is `<prefix>.bin` (tokens, no header) plus `<prefix>.idx`:
magic `MMIDIDX\\0\\0`, u64 version 1, u8 dtype code, u64 sequence count S, u64 document-index
length D1 (= documents + 1, Megatron's convention), int32[S] lengths, int64[S] byte pointers,
int64[D1] document index. Everything is little-endian. Offsets and counts are int64 throughout so
shards beyond 2^31 tokens work. A corpus of K shards is described by `<prefix>.manifest.json`
(file names, sizes, checksums, counts, tokenizer): the source of global counts.

This module is imported by `data_tools` too, so it depends only on numpy, the stdlib and
megatron_lite.errors (itself stdlib only).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_lite.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, doc-index entries
DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODES = {dt: code for code, dt in DTYPES.items()}
MANIFEST_SUFFIX = ".manifest.json"
REGENERATE_HINT = ("regenerate it with `python -m data_tools.preprocess --input ... "
                   "--output-prefix ... --tokenizer-model ...`")
_CHUNK = 1 << 22  # entries per chunk when streaming index arrays (bounded memory)
SCAN_CHUNK = 1 << 20  # tokens per chunk of the id scan: 2 MiB of uint16, stays in cache


class ShardError(UserError, ValueError):
    """A shard or manifest that cannot be read; the message names the file and the fix."""


def optimal_dtype(vocab_size: int) -> np.dtype:
    """Megatron's rule: uint16 below 65,500 tokens, int32 otherwise."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def shard_name(prefix: str | Path, index: int) -> str:
    return f"{prefix}_{index:05d}"


def shards_for_dp_rank(num_shards: int, dp_rank: int, dp_size: int) -> list[int]:
    """Shards a data-parallel rank reads in node-local mode (round robin, shard i -> i % dp).

    Shared by `data_tools.stage` (which copies them) and the dataset (which reads them), so the
    two can never disagree.
    """
    if num_shards < dp_size:
        raise ShardError(
            f"{num_shards} shards cannot feed {dp_size} data-parallel ranks in node-local mode; "
            f"re-run data_tools.preprocess with --num-shards >= {dp_size} (a multiple is best) "
            "or use --data-sharding global"
        )
    return list(range(dp_rank, num_shards, dp_size))


def sha256_file(path: str | Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- writing


def write_index(path: str | Path, dtype: np.dtype, lengths: np.ndarray,
                doc_idx: np.ndarray) -> None:
    """Write a `.idx` for `lengths` (int32, one per sequence) and the document index.

    Pointers are accumulated in int64 chunk by chunk, so neither a > 2^31-token shard nor a
    huge sequence count needs more than one chunk of temporary memory.
    """
    dtype = np.dtype(dtype)
    if doc_idx[0] != 0 or doc_idx[-1] != len(lengths):
        raise ValueError("document index must start at 0 and end at the sequence count")
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, CODES[dtype], len(lengths), len(doc_idx)))
        for start in range(0, len(lengths), _CHUNK):
            f.write(np.asarray(lengths[start:start + _CHUNK], dtype="<i4").tobytes())
        offset = 0
        for start in range(0, len(lengths), _CHUNK):
            chunk = np.asarray(lengths[start:start + _CHUNK], dtype=np.int64) * dtype.itemsize
            ends = np.cumsum(chunk) + offset
            f.write((ends - chunk).astype("<i8").tobytes())
            offset = int(ends[-1])
        for start in range(0, len(doc_idx), _CHUNK):
            f.write(np.asarray(doc_idx[start:start + _CHUNK], dtype="<i8").tobytes())


class _GrowableArray:
    """An append-only int array that spills to a temporary file, so memory stays bounded;
    `count` > 0 reopens the file of an interrupted run, cut back to that many values."""

    def __init__(self, path: Path, dtype: str, count: int = 0) -> None:
        self.path, self.dtype = path, np.dtype(dtype)
        self._file = open(path, "r+b" if count else "wb")  # noqa: SIM115 - closed in finish()
        if count:
            self._file.truncate(count * self.dtype.itemsize)
            self._file.seek(0, os.SEEK_END)
        self.count = count

    def flush(self) -> None:
        self._file.flush()

    def extend(self, values: np.ndarray) -> None:
        self._file.write(np.asarray(values, dtype=self.dtype).tobytes())
        self.count += len(values)

    def finish(self) -> np.ndarray:
        self._file.close()
        if self.count == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.count,))


class ShardWriter:
    """Streams documents (one sequence each) into `<prefix>.bin/.idx` under temporary names.

    Nothing named `<prefix>.bin/.idx` exists until `finalize()`: `.idx` is renamed last, so a
    crash at any point leaves no shard that looks valid.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype, tag: str | None = None,
                 resume: dict | None = None) -> None:
        """`tag`: the temporary names' suffix (default per process); `resume`: a `state()`
        of an interrupted writer with the same tag, whose files it continues."""
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        tag = tag or f".tmp{os.getpid()}"
        self.tmp_bin = Path(f"{prefix}.bin{tag}")
        self.tmp_idx = Path(f"{prefix}.idx{tag}")
        self._hash = hashlib.sha256()
        self.documents = resume["documents"] if resume else 0
        self.tokens = resume["tokens"] if resume else 0
        self._lengths = _GrowableArray(Path(f"{prefix}.lengths{tag}"), "<i4", self.documents)
        self._bin = open(self.tmp_bin, "r+b" if resume else "wb")  # noqa: SIM115 - closed in finalize()/abort()
        if resume:  # cut back to what the progress record covers; the hash covers it again
            self._bin.truncate(resume["bin_bytes"])
            while block := self._bin.read(1 << 24):
                self._hash.update(block)

    def state(self) -> dict:
        """What a resumed writer needs; everything written so far is flushed first."""
        self._bin.flush()
        self._lengths.flush()
        return {"bin_bytes": self._bin.tell(), "documents": self.documents,
                "tokens": self.tokens}

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as one flat token array and their lengths."""
        data = np.ascontiguousarray(tokens, dtype=self.dtype.newbyteorder("<")).tobytes()
        self._bin.write(data)
        self._hash.update(data)
        self._lengths.extend(lengths)
        self.documents += len(lengths)
        self.tokens += int(np.sum(lengths, dtype=np.int64))

    def finalize(self) -> dict:
        """Write the index, rename both files into place, return the manifest entry."""
        self._bin.close()
        lengths = self._lengths.finish()
        write_index(self.tmp_idx, self.dtype, lengths,
                    np.arange(len(lengths) + 1, dtype=np.int64))
        del lengths
        self._lengths.path.unlink()
        bin_path, idx_path = Path(f"{self.prefix}.bin"), Path(f"{self.prefix}.idx")
        os.replace(self.tmp_bin, bin_path)
        os.replace(self.tmp_idx, idx_path)
        return {
            "prefix": self.prefix.name, "bin": bin_path.name, "idx": idx_path.name,
            "bin_bytes": bin_path.stat().st_size, "idx_bytes": idx_path.stat().st_size,
            "bin_sha256": self._hash.hexdigest(), "idx_sha256": sha256_file(idx_path),
            "documents": self.documents, "tokens": self.tokens,
        }

    def abort(self) -> None:
        """Remove the temporary files (an interrupted run leaves nothing behind)."""
        self._bin.close()
        self._lengths.finish()
        for p in (self.tmp_bin, self.tmp_idx, self._lengths.path):
            p.unlink(missing_ok=True)


# ---------------------------------------------------------------- reading


def _fail(path: Path, what: str, hint: str | None) -> ShardError:
    return ShardError(f"{path}: {what}; {hint or REGENERATE_HINT}")


class IndexedShard:
    """Read-only memory map of one `.bin/.idx` pair, validated on open.

    Checks beyond Megatron's reader: `.idx` size matches its header, the document index is
    well formed, pointers are contiguous, and the `.bin` length equals the token count.
    `hint` is the command that regenerates the file (from the manifest when there is one).
    """

    def __init__(self, prefix: str | Path, hint: str | None = None,
                 check_pointers: bool = True) -> None:
        self.prefix = str(prefix)
        self.idx_path, self.bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise _fail(p, "missing (shard files come in .bin/.idx pairs)", hint)
        self._read_index(hint)
        self._check_bin(hint, check_pointers)

    def _read_index(self, hint: str | None) -> None:
        path = self.idx_path
        size = path.stat().st_size
        if size < HEADER.size:
            raise _fail(path, f"truncated: {size} bytes is shorter than the {HEADER.size}-byte "
                        "header", hint)
        with open(path, "rb") as f:
            magic, version, code, n_seq, n_doc = HEADER.unpack(f.read(HEADER.size))
        if magic != MAGIC:
            raise _fail(path, f"bad magic {magic!r}, expected {MAGIC!r}: not a Megatron "
                        "indexed-dataset index", hint)
        if version != VERSION:
            raise _fail(path, f"unsupported version {version}, expected {VERSION}", hint)
        if code not in DTYPES:
            raise _fail(path, f"unknown dtype code {code} (known: {sorted(DTYPES)})", hint)
        expected = HEADER.size + 12 * n_seq + 8 * n_doc
        if size not in (expected, expected + n_seq):  # + n_seq: Megatron's multimodal modes
            raise _fail(path, f"size {size} bytes does not match its header ({n_seq} sequences, "
                        f"{n_doc} document-index entries -> {expected} bytes); truncated?", hint)
        self.dtype = DTYPES[code]
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        self._idx_mm = mm
        off = HEADER.size
        self.lengths = mm[off:off + 4 * n_seq].view("<i4")
        off += 4 * n_seq
        self.pointers = mm[off:off + 8 * n_seq].view("<i8")
        off += 8 * n_seq
        self.doc_idx = mm[off:off + 8 * n_doc].view("<i8")
        if n_doc < 1 or self.doc_idx[0] != 0 or self.doc_idx[-1] != n_seq:
            raise _fail(path, f"document index must run from 0 to the sequence count {n_seq}",
                        hint)

    def _check_bin(self, hint: str | None, check_pointers: bool) -> None:
        """Pointers must be contiguous and end exactly at the `.bin` size (chunked check).

        Without `check_pointers` (a cached verdict vouches for them, `ShardVerdicts`) only the
        last pointer is compared with the `.bin` size: O(1) instead of a pass over the index.
        """
        itemsize = self.dtype.itemsize
        offset = 0
        if not check_pointers and len(self.lengths):
            offset = int(self.pointers[-1]) + int(self.lengths[-1]) * itemsize
        for start in range(0, len(self.lengths) if check_pointers else 0, _CHUNK):
            lens = self.lengths[start:start + _CHUNK].astype(np.int64)
            ptrs = self.pointers[start:start + _CHUNK]
            if np.any(lens < 0):
                raise _fail(self.idx_path, "negative sequence length", hint)
            expect = np.cumsum(lens * itemsize) - lens * itemsize + offset
            bad = np.flatnonzero(ptrs != expect)
            if bad.size:
                i = start + int(bad[0])
                raise _fail(self.idx_path, f"pointer of sequence {i} is {int(self.pointers[i])}, "
                            f"expected {int(expect[bad[0]])}; .idx does not match the .bin", hint)
            offset = int(expect[-1] + lens[-1] * itemsize)
        bin_size = self.bin_path.stat().st_size
        if bin_size != offset:
            raise _fail(self.bin_path, f"size {bin_size} bytes, but its .idx describes {offset} "
                        f"bytes ({offset // itemsize} tokens of {self.dtype}); .bin/.idx counts "
                        "do not match (truncated or mixed files)", hint)
        self.num_tokens = offset // itemsize
        self._bin = (np.memmap(self.bin_path, dtype=self.dtype, mode="r")
                     if bin_size else np.zeros(0, self.dtype))

    def token_range(self, chunk: int = SCAN_CHUNK) -> tuple[int, int]:
        """(smallest, largest) token id over the whole shard; (0, -1) for an empty shard.

        Every token is read once, in cache-sized chunks so that the max pass reads what the
        min pass just brought into cache (memory bandwidth, not two trips to RAM per token);
        `bench/token_scan.py` measures it. What `ShardVerdicts` caches."""
        lows, highs = [], []
        for start in range(0, self.num_tokens, chunk):
            piece = self._bin[start:start + chunk]
            lows.append(int(piece.min()))
            highs.append(int(piece.max()))
        return (min(lows), max(highs)) if lows else (0, -1)

    def check_vocab(self, vocab_size: int, chunk: int = SCAN_CHUNK) -> None:
        """Every token id must be in [0, vocab_size); the error names the file, the token
        offset and the id (the first bad one), so the user can see which data is wrong."""
        for lo in range(0, self.num_tokens, chunk):
            piece = self._bin[lo:lo + chunk]
            if int(piece.max()) >= vocab_size or int(piece.min()) < 0:
                bad = np.flatnonzero((piece >= vocab_size) | (piece < 0))[0]
                raise _fail(self.bin_path, f"token id {int(piece[bad])} at token offset "
                            f"{lo + int(bad)} is outside the vocabulary [0, {vocab_size}) "
                            "of the tokenizer (not the padded one); the shard was made with "
                            "another tokenizer (pass that --tokenizer-model) or is corrupt", None)

    def __len__(self) -> int:
        return len(self.lengths)

    def get(self, seq: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence `seq` from `offset`, `length` of them (default: to its end)."""
        start = int(self.pointers[seq]) // self.dtype.itemsize + offset
        n = int(self.lengths[seq]) - offset if length is None else length
        return self._bin[start:start + n]

    def __getitem__(self, seq: int) -> np.ndarray:
        return self.get(seq)


# ---------------------------------------------------------------- validation verdicts


FINGERPRINT_SAMPLES = 64  # blocks of each file hashed into a shard's fingerprint
_FINGERPRINT_BLOCK = 4096


def fingerprint(prefix: str) -> str:
    """What a verdict is cached under: the identity of both files' current contents, as far
    as it can be known without reading them all.

    Per file: size, inode, modification time and *change* time (ctime), plus a hash of
    `FINGERPRINT_SAMPLES` 4 KiB blocks spread evenly over it (first and last included) and the
    `.idx` header (in its first block). Any write through the filesystem moves ctime, and only
    a change of the system clock sets it back (`touch`/`os.utime` restoring the mtime moves
    it too), so a shard rewritten or patched in place with its size and mtime kept is
    scanned again. What it cannot see: bytes changed beneath the filesystem (bit rot, a
    raw-device write) outside the sampled blocks; only `--verify-checksums` (every byte
    against the manifest's sha256) catches those. Copying a shard (a new inode and ctime)
    makes it a new shard: scanned once more. No device number: a shared filesystem's differs
    between nodes, and every node must find the verdict one rank wrote.
    """
    h = hashlib.blake2b(digest_size=12)
    for path in (Path(f"{prefix}.idx"), Path(f"{prefix}.bin")):
        st = path.stat()
        h.update(struct.pack("<5q", st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns,
                             FINGERPRINT_SAMPLES))
        last = max(0, st.st_size - _FINGERPRINT_BLOCK)
        with open(path, "rb") as f:
            for k in range(FINGERPRINT_SAMPLES):
                f.seek(last * k // (FINGERPRINT_SAMPLES - 1))
                h.update(f.read(_FINGERPRINT_BLOCK))
    return h.hexdigest()


class ShardVerdicts:
    """Shard validation done once per file, its verdict cached as JSON in `directory`.

    Validating a shard means the header and size checks, the pointer pass over its index and
    (with a vocabulary) the scan of every token id. On a thousand ranks that restart, doing it
    everywhere every time is the slow part of start-up; so the first rank to do it records the
    verdict (the token-id range it found) keyed by the shard's `fingerprint`, and later
    readers (other ranks, restarts) only read the header and the fingerprint's samples.
    A rank that scans says so in one `data: rank R scanned ...` line. `required` (a multi-rank
    job's preparing rank): an unwritable directory is an error, since every rank would redo
    the work; otherwise a warning.
    """

    def __init__(self, directory: str | Path | None, rank: int = 0, required: bool = False,
                 flag: str = "--data-cache-path") -> None:
        self.directory = None if directory is None else Path(directory) / "shard_checks"
        self.rank, self.required, self.flag = rank, required, flag
        self._warned = False

    def _path(self, prefix: str) -> Path | None:
        if self.directory is None:
            return None
        return self.directory / f"{Path(prefix).name}.{fingerprint(prefix)}.json"

    def _load(self, path: Path | None, vocab_size: int | None) -> dict | None:
        if path is None or not path.is_file():
            return None
        try:
            verdict = json.loads(path.read_text())
        except (OSError, ValueError):
            return None  # unreadable or half-written by an old version: validate again
        return verdict if vocab_size is None or verdict.get("scan") == "full" else None

    def open(self, prefix: str, hint: str | None = None,
             vocab_size: int | None = None) -> IndexedShard:
        """The shard, validated now or by an earlier verdict; every token id checked against
        `vocab_size` (the tokenizer's, not the padded one) when given."""
        if not (Path(f"{prefix}.idx").is_file() and Path(f"{prefix}.bin").is_file()):
            return IndexedShard(prefix, hint)  # raises, naming the missing file
        path = self._path(prefix)
        verdict = self._load(path, vocab_size)
        if verdict is not None:
            shard = IndexedShard(prefix, hint, check_pointers=False)
            if vocab_size is not None and not _in_vocab(verdict, vocab_size):
                shard.check_vocab(vocab_size)  # raises, naming the offset
            return shard
        if self.required:
            self._check_writable()  # before the work that nobody could reuse
        started = time.perf_counter()
        shard = IndexedShard(prefix, hint)
        verdict = {"prefix": str(prefix), "tokens": shard.num_tokens, "scan": None,
                   "min_id": 0, "max_id": -1, "rank": self.rank}
        if vocab_size is not None:
            verdict["scan"] = "full"
            verdict["min_id"], verdict["max_id"] = shard.token_range()
            print(f"data: rank {self.rank} scanned {prefix} ({shard.num_tokens:,} tokens, all; "
                  f"ids {verdict['min_id']}..{verdict['max_id']}) in "
                  f"{time.perf_counter() - started:.2f} s", flush=True)
        self._save(path, verdict)
        if vocab_size is not None and not _in_vocab(verdict, vocab_size):
            shard.check_vocab(vocab_size)  # raises, naming the token offset
        return shard

    def _message(self, error: OSError | str) -> str:
        reason = error if isinstance(error, str) else (error.strerror or str(error))
        return (f"cannot record shard verdicts in {self.directory} ({reason}); set {self.flag} "
                "to a writable directory")

    def _check_writable(self) -> None:
        assert self.directory is not None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ShardError(f"{self._message(e)}: without it every rank validates every shard "
                             "again") from e
        if not os.access(self.directory, os.W_OK):
            raise ShardError(f"{self._message('not writable')}: without it every rank validates "
                             "every shard again")

    def _save(self, path: Path | None, verdict: dict) -> None:
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps(verdict, indent=1))
            os.replace(tmp, path)
        except OSError as e:
            if not self._warned:
                print(f"warning: {self._message(e)} to validate each shard only once",
                      file=sys.stderr)
                self._warned = True


def _in_vocab(verdict: dict, vocab_size: int) -> bool:
    """The verdict's token-id range lies in [0, vocab_size) (an empty shard's always does)."""
    return verdict["max_id"] < 0 or (verdict["min_id"] >= 0 and verdict["max_id"] < vocab_size)


# ---------------------------------------------------------------- manifest


@dataclass
class Manifest:
    """`<prefix>.manifest.json`: shard list with sizes, checksums and counts, plus totals."""

    path: Path
    data: dict

    @property
    def shards(self) -> list[dict]:
        return self.data["shards"]

    @property
    def total_tokens(self) -> int:
        return int(self.data["total_tokens"])

    @property
    def total_documents(self) -> int:
        return int(self.data["total_documents"])

    @property
    def tokenizer(self) -> dict:
        return self.data.get("tokenizer", {})

    @property
    def command(self) -> str:
        return self.data.get("command") or REGENERATE_HINT

    def shard_prefix(self, i: int, directory: str | Path | None = None) -> str:
        """Absolute prefix of shard i (relative names resolve next to the manifest)."""
        return str(Path(directory or self.path.parent) / self.shards[i]["prefix"])

    def hint(self) -> str:
        cmd = self.command if len(self.command) < 400 else self.command[:400] + " ..."
        return f"regenerate it with `{cmd}` (full command in {self.path})"

    def verify_checksums(self, indices: Iterable[int] | None = None,
                         directory: str | Path | None = None) -> None:
        """Compare the sha256 of every (or the given) shard file with the manifest."""
        for i in range(len(self.shards)) if indices is None else indices:
            entry = self.shards[i]
            base = Path(directory or self.path.parent)
            for kind in ("bin", "idx"):
                path = base / entry[kind]
                if not path.is_file():
                    raise _fail(path, f"missing (listed in {self.path})", self.hint())
                got = sha256_file(path)
                if got != entry[f"{kind}_sha256"]:
                    raise _fail(path, f"checksum mismatch: sha256 {got[:16]}..., manifest "
                                f"{self.path} says {entry[f'{kind}_sha256'][:16]}... "
                                "(corrupted or from another run)", self.hint())


def write_manifest(path: str | Path, data: dict) -> None:
    """Atomically write a manifest (temporary name, then rename)."""
    tmp = Path(f"{path}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def load_manifest(path: str | Path) -> Manifest:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        for key in ("shards", "total_tokens", "total_documents"):
            data[key]
    except (OSError, ValueError, KeyError) as e:
        raise ShardError(f"{path}: not a readable manifest ({e}); {REGENERATE_HINT}") from e
    return Manifest(path, data)


def find_manifest(path: str) -> Path | None:
    """`--data-path X` means the manifest X or X.manifest.json when one exists."""
    for candidate in (Path(path), Path(path + MANIFEST_SUFFIX)):
        if candidate.name.endswith(MANIFEST_SUFFIX) and candidate.is_file():
            return candidate
    return None


def resolve_prefixes(path: str) -> tuple[list[str], Manifest | None]:
    """Shard prefixes behind one `--data-path` entry: a manifest's shards or one plain prefix."""
    manifest_path = find_manifest(path)
    if manifest_path is not None:
        m = load_manifest(manifest_path)
        return [m.shard_prefix(i) for i in range(len(m.shards))], m
    if Path(path + ".idx").is_file() or Path(path + ".bin").is_file():
        return [path], None
    raise ShardError(f"--data-path {path}: neither {path}{MANIFEST_SUFFIX} nor {path}.bin/.idx "
                     f"exists; {REGENERATE_HINT}")
