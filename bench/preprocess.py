"""Preprocess throughput: `python -m data_tools.preprocess` (whole command, start-up included)
against sentencepiece alone encoding the same documents in memory with the same number of
worker processes, in the same run.

    python bench/preprocess.py [--mb 20] [--workers 2] [--vocab-size 8000]
Corpus: the standard library's .py files as JSONL (cut at --mb MB of text). Target (issue):
ratio >= 0.9 (Megatron's preprocess_data.py: 0.77 once running, 0.44 with its imports).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from megatron_lite.data.format import load_manifest  # noqa: E402
from tokenizer.tokenizer import Tokenizer  # noqa: E402

_TOK: list[Tokenizer] = []


def _init(model: str) -> None:
    _TOK.append(Tokenizer(model))


def _encode(texts: list[str]) -> int:
    return sum(len(ids) for ids in _TOK[0].encode(texts))


def make_corpus(path: Path, mb: float) -> list[str]:
    docs, total = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        docs.append(text)
        total += len(text.encode())
        if total >= mb * 1e6:
            break
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


def tokenizer_alone(model: str, docs: list[str], workers: int) -> tuple[float, int]:
    """Seconds and tokens for a fork pool encoding chunks of 16 in-memory documents."""
    chunks = [docs[i:i + 16] for i in range(0, len(docs), 16)]
    with mp.get_context("fork").Pool(workers, _init, (model,)) as pool:
        pool.map(_encode, chunks[:workers])  # warm-up
        t = time.perf_counter()
        tokens = sum(pool.imap(_encode, chunks))
        return time.perf_counter() - t, tokens


def ours(corpus: Path, model: str, out: Path, workers: int) -> tuple[float, int]:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "data_tools.preprocess", "--input", str(corpus),
                    "--output-prefix", str(out), "--tokenizer-model", model,
                    "--workers", str(workers)], check=True, cwd=ROOT, capture_output=True)
    seconds = time.perf_counter() - t
    return seconds, load_manifest(f"{out}.manifest.json").total_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mb", type=float, default=20)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        docs = make_corpus(d / "corpus.jsonl", args.mb)
        subprocess.run([sys.executable, "-m", "tokenizer.train", "--input",
                        str(d / "corpus.jsonl"), "--output-prefix", str(d / "tok"),
                        "--vocab-size", str(args.vocab_size), "--input-sentence-size",
                        "300000"], check=True, cwd=ROOT, capture_output=True)
        model = str(d / "tok.model")
        base, mine = [], []
        for r in range(args.repeats):  # interleaved so machine noise hits both alike
            base.append(tokenizer_alone(model, docs, args.workers))
            mine.append(ours(d / "corpus.jsonl", model, d / f"out{r}", args.workers))
    mb = sum(len(x.encode()) for x in docs) / 1e6
    tb, tokens = statistics.median(s for s, _ in base), base[0][1]
    tm = statistics.median(s for s, _ in mine)
    rows = [("sentencepiece alone (in memory)", tb, tokens), ("data_tools.preprocess (whole "
            "command)", tm, mine[0][1])]
    print(f"corpus: {len(docs):,} docs, {mb:.1f} MB, workers {args.workers}, "
          f"vocab {args.vocab_size}")
    print(f"{'':<40} {'s (median)':>10} {'Mtok/s':>8} {'MB/s':>6}")
    for name, s, n in rows:
        print(f"{name:<40} {s:>10.2f} {n / s / 1e6:>8.2f} {mb / s:>6.1f}")
    ratio = (mine[0][1] / tm) / (tokens / tb)
    print(f"ratio (ours / tokenizer alone, tokens/s): {ratio:.2f}  (target >= 0.9)")
    out = ROOT / "bench" / "results" / "preprocess.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"docs": len(docs), "mb": mb, "workers": args.workers,
                               "tokenizer_alone_s": [s for s, _ in base],
                               "preprocess_s": [s for s, _ in mine], "tokens": tokens,
                               "ratio": ratio}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
