"""Cost of checking every token id of a shard (`IndexedShard.token_range`, what a shard's first
use pays before its verdict is cached) against baselines measured in the same run: one plain
`np.max` over the whole memory map, and `min` + `max` over it (the two passes the check needs,
each over the whole array). Also the cost of `fingerprint` (what every later start pays).

A synthetic uint16 shard (documents of 500-1500 tokens, ids below 32,000) is written to a
temporary directory and read from the page cache (warm: it was just written), so the numbers
are memory bandwidth, not disk; a cold read is bounded by the disk instead. One thread.

    python bench/token_scan.py [--tokens 250000000] [--repeats 3]
Target (issue): >= 1 GB/s per core.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_lite.data.format import IndexedShard, ShardWriter, fingerprint

TARGET_GBS = 1.0


def write_shard(prefix: Path, tokens: int) -> None:
    rng = np.random.default_rng(0)
    writer = ShardWriter(prefix, np.uint16)
    step = 1 << 24
    for start in range(0, tokens, step):
        n = min(step, tokens - start)
        lengths = rng.integers(500, 1501, size=n // 500 + 2).astype(np.int64)
        ends = np.cumsum(lengths)
        lengths = lengths[:np.searchsorted(ends, n) + 1]
        lengths[-1] -= int(lengths.sum()) - n
        writer.add_documents(rng.integers(0, 32000, size=n, dtype=np.uint16),
                             lengths)
    writer.finalize()


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, list[float]]:
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs), runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=250_000_000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "scan"
        write_shard(prefix, args.tokens)
        shard = IndexedShard(prefix)
        data = shard._bin
        nbytes = shard.num_tokens * data.dtype.itemsize
        cases = {
            "np.max (whole map)": lambda: int(data.max()),
            "np.min + np.max (whole map)": lambda: (int(data.min()), int(data.max())),
            "token_range (chunked)": shard.token_range,
            "fingerprint": lambda: fingerprint(str(prefix)),
        }
        rows = {}
        for name, fn in cases.items():
            fn()  # warm: page cache, first touch of the map
            median, runs = timed(fn, args.repeats)
            rows[name] = {"median_s": median, "runs_s": runs,
                          "gb_per_s": nbytes / median / 1e9,
                          "s_per_billion_tokens": median * 1e9 / shard.num_tokens}
    base = rows["np.max (whole map)"]["median_s"]
    print(f"{shard.num_tokens:,} tokens ({nbytes / 1e9:.2f} GB, uint16), median of "
          f"{args.repeats}, one thread")
    print(f"{'case':<30} {'s':>8} {'GB/s':>7} {'s / 1B tokens':>14} {'vs np.max':>10}")
    for name, r in rows.items():
        print(f"{name:<30} {r['median_s']:>8.4f} {r['gb_per_s']:>7.2f} "
              f"{r['s_per_billion_tokens']:>14.3f} {r['median_s'] / base:>9.2f}x")
    ours = rows["token_range (chunked)"]["gb_per_s"]
    print(f"target >= {TARGET_GBS} GB/s per core: {'met' if ours >= TARGET_GBS else 'MISSED'}")
    out = Path(__file__).parent / "results" / "token_scan.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"tokens": shard.num_tokens, "bytes": nbytes,
                               "target_gb_per_s": TARGET_GBS, "cases": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
