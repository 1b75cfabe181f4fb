"""Tokenize a corpus into Megatron .bin/.idx shards plus a manifest.

    python -m data_tools.preprocess --input PATH [PATH ...] --output-prefix OUT \\
        --tokenizer-model TOK.model [--json-keys text] [--workers N] [--num-shards K] [--append-eod]
    python -m data_tools.preprocess ... --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR

The tokenizer flags are pretrain.py's (Megatron's): --tokenizer-type HuggingFaceTokenizer,
GPT2BPETokenizer (--vocab-file, --merge-file), TikTokenizer, NullTokenizer or sentencepiece
(default); the manifest records them with the vocab size and EOD, which training checks.

Inputs: JSONL (one JSON object per line), plain text (one document per file, or documents
separated by blank lines with --split-on-blank-lines), directories of those, `.gz` of any.
Outputs: `OUT_<i:05d>.bin/.idx` for i < K and `OUT.manifest.json` (the source of global counts);
`--data-path OUT` in pretrain.py then means all K shards. Document i goes to shard i % K.

Streaming with bounded memory: the input is cut into ~256 KiB chunks (workers read plain JSONL
byte ranges themselves; the parent reads other inputs), at most a few per worker are in flight,
and results are written in input order, so the output is byte-identical for any --workers.
Files get temporary names until the run completes. Every PROGRESS_EVERY_S the run records how
many chunks it wrote (`OUT.progress.json`); rerunning the same command after an interruption
continues from there (chunks depend on the inputs only) and writes the same bytes as an
uninterrupted run.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import multiprocessing as mp
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_tools.chunks import CHUNK_BYTES, iter_chunks
from data_tools.encode import BadInputError, Options, Stats, encode_chunk, init_worker
from data_tools.errors import USER_ERRORS, add_debug_flag, run_cli
from megatron_lite.data.format import (
    MANIFEST_SUFFIX,
    ShardWriter,
    optimal_dtype,
    shard_name,
    write_manifest,
)
from tokenizer.corpus import expand_inputs
from tokenizer.spec import add_tokenizer_flags, load_tokenizer, record, spec_from_args
from tokenizer.tokenizer import TokenizerError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m data_tools.preprocess", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="files or directories")
    p.add_argument("--output-prefix", required=True, help="writes OUT_<i>.bin/.idx, OUT" +
                   MANIFEST_SUFFIX)
    p.add_argument("--json-keys", default="text", help="JSONL field holding the document text")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizer processes (default: all cores)")
    p.add_argument("--num-shards", type=int, default=1, help="number of output shards")
    p.add_argument("--append-eod", action="store_true", help="end every document with EOD")
    p.add_argument("--split-on-blank-lines", action="store_true",
                   help="plain text: a blank line ends a document (default: one per file)")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip and count malformed JSONL lines instead of stopping")
    p.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES,
                   help="input bytes per worker task (tuning; does not change the output)")
    add_tokenizer_flags(p)
    add_debug_flag(p)
    args = p.parse_args(argv)
    if args.workers < 1 or args.num_shards < 1:
        p.error("--workers and --num-shards must be >= 1")
    return args


PROGRESS_SUFFIX = ".progress.json"
PROGRESS_EVERY_S = 30.0
"""How often the progress record is rewritten (an interrupted run redoes at most this much)."""
RESUME_TAG = ".tmp"
"""The temporary names' suffix: fixed, so a rerun of the same command finds them."""


class ShardSet:
    """K writers; document number g goes to shard g % K (a function of the input only)."""

    def __init__(self, prefix: str, k: int, dtype: np.dtype,
                 resume: list[dict] | None = None) -> None:
        self.writers = [ShardWriter(shard_name(prefix, i), dtype, RESUME_TAG,
                                    resume[i] if resume else None) for i in range(k)]
        self.next_doc = sum(r["documents"] for r in resume) if resume else 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        k = len(self.writers)
        if k == 1:
            self.writers[0].add_documents(tokens, lengths)
        else:
            # group tokens by shard with one stable (radix) sort instead of K masks
            shard = ((self.next_doc + np.arange(len(lengths))) % k).astype(np.uint16)
            token_shard = np.repeat(shard, lengths)
            grouped = tokens[np.argsort(token_shard, kind="stable")]
            counts = np.bincount(token_shard, minlength=k)
            ends = np.cumsum(counts)
            starts = ends - counts
            for i, w in enumerate(self.writers):
                if np.any(shard == i):
                    w.add_documents(grouped[starts[i]:ends[i]], lengths[shard == i])
        self.next_doc += len(lengths)

    def finalize(self) -> list[dict]:
        return [w.finalize() for w in self.writers]

    def abort(self) -> None:
        for w in self.writers:
            w.abort()


def _progress_key(args: argparse.Namespace, spec: object) -> str:
    """What must match for a rerun to continue an interrupted one (not --workers: the output
    is the same for any)."""
    return json.dumps([args.input, args.json_keys, args.num_shards, args.append_eod,
                       args.split_on_blank_lines, args.skip_bad_lines, args.chunk_bytes,
                       spec.flags()])


def _load_progress(path: Path, key: str) -> dict | None:
    """The progress record of an interrupted run of the same command, if its files are there."""
    try:
        progress = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return progress if progress.get("key") == key else None


def _save_progress(path: Path, key: str, chunks: int, shards: ShardSet, total: Stats) -> None:
    record = {"key": key, "chunks": chunks, "shards": [w.state() for w in shards.writers],
              "stats": dataclasses.asdict(total)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _run_pool(args: argparse.Namespace, opts: Options, shards: ShardSet, files: list[Path],
              bar: tqdm, progress: tuple[Path, str, dict | None]) -> Stats:
    """Ordered, bounded-memory map of encode_chunk over the chunks (at most 2N+2 in flight);
    records its progress every PROGRESS_EVERY_S and skips the chunks a resumed run has."""
    path, key, resumed = progress
    total = Stats(**resumed["stats"]) if resumed else Stats()
    done = resumed["chunks"] if resumed else 0
    saved_at = time.time()
    t0 = time.time()
    last_postfix = 0.0
    ctx = mp.get_context("fork")
    with ctx.Pool(args.workers, initializer=init_worker, initargs=(opts,)) as pool:
        pending: collections.deque = collections.deque()
        chunks = iter_chunks(files, args.split_on_blank_lines, args.chunk_bytes)
        for _ in range(done):  # chunks depend on the inputs only: the same ones again
            next(chunks)
        exhausted = False
        while pending or not exhausted:
            while not exhausted and len(pending) < 2 * args.workers + 2:
                chunk = next(chunks, None)
                if chunk is None:
                    exhausted = True
                else:
                    pending.append(pool.apply_async(encode_chunk, (chunk,)))
            if not pending:
                break
            tokens, lengths, stats = pending.popleft().get()
            shards.add(tokens, lengths)
            total.add(stats)
            done += 1
            bar.update(stats.documents)
            now = time.time()
            if now - saved_at >= PROGRESS_EVERY_S:
                _save_progress(path, key, done, shards, total)
                saved_at = now
            if now - last_postfix > 0.5:
                dt = max(now - t0, 1e-9)
                bar.set_postfix_str(f"{total.text_bytes / dt / 1e6:.1f} MB/s, "
                                    f"{total.tokens / dt / 1e6:.2f} Mtok/s", refresh=False)
                last_postfix = now
    return total


def preprocess(args: argparse.Namespace, argv: list[str]) -> dict:
    """Run the whole pipeline; returns the manifest written."""
    t0 = time.time()
    files = expand_inputs(args.input)
    spec = spec_from_args(args)
    tok = load_tokenizer(spec)
    if args.append_eod and tok.eod_id is None:
        raise TokenizerError(f"--append-eod: {spec.flags()} names no end-of-document token "
                             "(HuggingFaceTokenizer: an eos_token in tokenizer_config.json)")
    dtype = optimal_dtype(tok.vocab_size)
    opts = Options(spec, args.json_keys, args.append_eod, args.skip_bad_lines, dtype.str)
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    progress_path = Path(args.output_prefix + PROGRESS_SUFFIX)
    key = _progress_key(args, spec)
    resumed = _load_progress(progress_path, key)
    partial = [Path(shard_name(args.output_prefix, i) + f".{kind}{RESUME_TAG}")
               for i in range(args.num_shards) for kind in ("bin", "lengths")]
    if resumed and not all(p.is_file() for p in partial):
        resumed = None  # its files are gone: start over
    if resumed:
        print(f"preprocess: resuming an interrupted run after chunk {resumed['chunks']} "
              f"({resumed['stats']['documents']:,} docs; {progress_path})", flush=True)
    shards = ShardSet(args.output_prefix, args.num_shards, dtype,
                      resumed["shards"] if resumed else None)
    bar = tqdm(unit="doc", unit_scale=True, desc="preprocess", disable=None, file=sys.stderr,
               mininterval=float(os.environ.get("TQDM_MININTERVAL", 1.0)))
    try:
        stats = _run_pool(args, opts, shards, files, bar, (progress_path, key, resumed))
        if stats.documents == 0:  # empty shards would train on nothing, or fail far later
            raise BadInputError(
                f"--input {' '.join(args.input)}: no documents in {len(files)} file(s) "
                f"({stats.empty:,} empty documents, {stats.bad_lines:,} bad lines skipped); "
                f"check the input and --json-keys {args.json_keys}")
        entries = shards.finalize()
    except USER_ERRORS:  # bad input: nothing worth continuing
        shards.abort()
        progress_path.unlink(missing_ok=True)
        raise
    except BaseException:
        # interrupted (Ctrl-C, a crash): the same command continues from the last progress
        # record; its files keep their temporary names, so no shard looks valid meanwhile
        if progress_path.is_file():
            print(f"preprocess: interrupted; rerun the same command to resume from "
                  f"{progress_path}", file=sys.stderr, flush=True)
        else:
            shards.abort()
        raise
    finally:
        bar.close()
    progress_path.unlink(missing_ok=True)
    manifest = {
        "format": "megatron_lite shard manifest", "version": 1,
        "shards": entries, "num_shards": len(entries),
        "total_documents": stats.documents, "total_tokens": stats.tokens,
        "dtype": dtype.name, "append_eod": args.append_eod,
        "tokenizer": record(tok, spec),
        "skipped": {"empty_documents": stats.empty, "bad_lines": stats.bad_lines,
                    "invalid_utf8_documents_replaced": stats.invalid_utf8},
        "command": "python -m data_tools.preprocess " + shlex.join(argv),
    }
    write_manifest(args.output_prefix + MANIFEST_SUFFIX, manifest)
    _summary(stats, len(entries), args.output_prefix, time.time() - t0)
    return manifest


def _summary(s: Stats, num_shards: int, prefix: str, seconds: float) -> None:
    mb = s.text_bytes / 1e6
    print(f"preprocess done: {s.documents:,} docs, {s.tokens:,} tokens, {mb:.1f} MB, "
          f"{num_shards} shards -> {prefix}{MANIFEST_SUFFIX} | skipped: {s.empty:,} empty docs, "
          f"{s.bad_lines:,} bad lines | invalid UTF-8 replaced in {s.invalid_utf8:,} docs | "
          f"{seconds:.2f}s, {s.documents / seconds:,.0f} docs/s, {mb / seconds:.1f} MB/s, "
          f"{s.tokens / seconds / 1e6:.2f} Mtok/s")
    for example in s.bad_examples:
        print(f"  skipped bad line: {example}", file=sys.stderr)


def _main(argv: list[str]) -> int:
    preprocess(parse_args(argv), argv)
    return 0


def main(argv: list[str] | None = None) -> int:
    """A bad input line, path or tokenizer ends in one `error:` line and exit status 2."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
