"""Index build time for synthetic corpora (1B tokens / 1M docs and 10B tokens / 10M docs, seq
2048, one epoch): document + sample + shuffle index together, ours against a baseline written
the way Megatron's Python side does it (mgrid/RandomState document index, a per-sample Python
loop stands in for its C++ helper on a 1% slice, scaled), in the same run. "ours s" is the
median of 3 builds in one process (every run is in the JSON; the first pays for touching fresh
memory). The build uses a thread per core (at most 8); pin with `taskset` to compare.

    python bench/index_build.py [--skip-10b]
Targets (issue): <= 0.1 s for 1B tokens, <= 1 s for 10B tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_lite.data.index import build_epoch_index, samples_per_epoch

SEQ = 2048


def baseline(sizes: np.ndarray, seq: int) -> float:
    """Megatron-style: int32 mgrid doc index + RandomState.shuffle, sample index by a sequential
    scan (timed on 1% of the samples and scaled), uint32 arange + shuffle. Returns seconds."""
    t0 = time.perf_counter()
    rs = np.random.RandomState(0)
    doc_idx = np.mgrid[0:1, 0:len(sizes)][1].reshape(-1).astype(np.int32)
    rs.shuffle(doc_idx)
    n = samples_per_epoch(int(sizes.sum(dtype=np.int64)), seq)
    t_doc = time.perf_counter() - t0
    part = max(1, n // 100)
    t1 = time.perf_counter()
    d, off, k = 0, 0, 0
    out = np.empty((part + 1, 2), dtype=np.int64)
    while k <= part:
        out[k] = (d, off)
        remaining = seq
        while remaining > 0:
            left = int(sizes[doc_idx[d]]) - off
            if left > remaining:
                off += remaining
                remaining = 0
            else:
                remaining -= left
                d, off = d + 1, 0
        k += 1
    t_sample = (time.perf_counter() - t1) * n / part
    t2 = time.perf_counter()
    shuffle = np.arange(n, dtype=np.uint32)
    rs.shuffle(shuffle)
    return t_doc + t_sample + time.perf_counter() - t2


def measure(num_docs: int, repeats: int) -> dict:
    sizes = np.random.default_rng(0).integers(500, 1501, size=num_docs).astype(np.int32)
    ours = []
    for _ in range(repeats):
        t = time.perf_counter()
        build_epoch_index(sizes, SEQ, 1, 1234)
        ours.append(time.perf_counter() - t)
    base = baseline(sizes, SEQ)
    return {"docs": num_docs, "tokens": int(sizes.sum(dtype=np.int64)),
            "samples": samples_per_epoch(int(sizes.sum(dtype=np.int64)), SEQ),
            "ours_s": statistics.median(ours), "ours_runs_s": ours, "baseline_s": base,
            "speedup": base / statistics.median(ours)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--skip-10b", action="store_true")
    args = p.parse_args()
    rows = {"1B": (measure(1_000_000, 3), 0.1)}
    if not args.skip_10b:
        rows["10B"] = (measure(10_000_000, 3), 1.0)
    print(f"{'corpus':>7} {'tokens':>15} {'samples':>10} {'ours s':>8} {'target s':>9} "
          f"{'baseline s':>11} {'speedup':>8}")
    for name, (r, target) in rows.items():
        print(f"{name:>7} {r['tokens']:>15,} {r['samples']:>10,} {r['ours_s']:>8.3f} "
              f"{target:>9.2f} {r['baseline_s']:>11.2f} {r['speedup']:>7.1f}x")
    out = Path(__file__).parent / "results" / "index_build.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({k: {**r, "target_s": t} for k, (r, t) in rows.items()},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
