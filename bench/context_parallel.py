"""Long context: attention with document masks against without, and how document masks are run.

Document masks (`document_masks`): forward + backward of one attention layer on packed
sequences of `n` documents (random cuts), three ways, round-robin so machine noise hits all
alike; median times as ratios against plain causal attention (no documents) in the same run:
  causal       attention() without documents: the plain SDPA causal call (the baseline)
  pairs        attention() with documents: one flash call per document run (what we ship)
  sdpa+mask    SDPA with the s x s boolean mask (causal and same document)
The last column is pairs / sdpa+mask, the measurement behind layers/attention.py's choice.

    python bench/context_parallel.py [--seq 2048 4096] [--docs 1 8 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.layers.attention import attention

HEADS, GROUPS, HEAD_DIM = 8, 8, 64


def _documents(s: int, n: int, gen: torch.Generator) -> torch.Tensor:
    ids = torch.zeros(1, s, dtype=torch.int32)
    ids[0, torch.randperm(s - 1, generator=gen)[: n - 1] + 1] = 1
    return ids.cumsum(1).to(torch.int32)


def _variants(s: int, docs: torch.Tensor) -> dict[str, Callable]:
    index = torch.arange(s)
    mask = torch.ones(s, s, dtype=torch.bool).tril() & (docs[0, :, None] == docs[0, None, :])
    return {
        "causal": lambda q, k, v: attention(q, k, v, token_index=index),
        "pairs": lambda q, k, v: attention(q, k, v, token_index=index, documents=docs),
        "sdpa+mask": lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=GROUPS != HEADS),
    }


def _time(fn: Callable, tensors: list[torch.Tensor], dout: torch.Tensor) -> float:
    start = time.perf_counter()
    out = fn(*tensors)
    torch.autograd.grad(out, tensors, dout)
    return time.perf_counter() - start


def document_masks(seqs: list[int], doc_counts: list[int], repeats: int) -> list[dict]:
    """One row per (sequence length, documents): median fwd+bwd seconds of each variant."""
    rows = []
    for s in seqs:
        gen = torch.Generator().manual_seed(s)
        tensors = [torch.randn(1, h, s, HEAD_DIM, generator=gen).requires_grad_()
                   for h in (HEADS, GROUPS, GROUPS)]
        dout = torch.randn(1, HEADS, s, HEAD_DIM, generator=gen)
        for n in doc_counts:
            variants = _variants(s, _documents(s, n, gen))
            for fn in variants.values():  # warm-up
                _time(fn, tensors, dout)
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(repeats):
                for name, fn in variants.items():
                    times[name].append(_time(fn, tensors, dout))
            med = {name: statistics.median(t) for name, t in times.items()}
            rows.append(dict(seq=s, documents=n, seconds=med,
                             vs_causal={name: t / med["causal"] for name, t in med.items()},
                             pairs_vs_mask=med["pairs"] / med["sdpa+mask"]))
    return rows


def print_document_masks(rows: list[dict]) -> None:
    print(f"attention fwd+bwd, b=1, {HEADS} heads ({GROUPS} KV) x {HEAD_DIM}, "
          f"{torch.get_num_threads()} threads; ms (x causal)")
    print(f"{'seq':>6} {'docs':>5} {'causal ms':>10} {'pairs ms':>15} {'sdpa+mask ms':>17} "
          f"{'pairs/mask':>11}")
    for r in rows:
        sec, rel = r["seconds"], r["vs_causal"]
        print(f"{r['seq']:>6} {r['documents']:>5} {sec['causal'] * 1e3:>10.1f} "
              f"{sec['pairs'] * 1e3:>8.1f} ({rel['pairs']:.2f}x) "
              f"{sec['sdpa+mask'] * 1e3:>9.1f} ({rel['sdpa+mask']:.2f}x) "
              f"{r['pairs_vs_mask']:>10.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--docs", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default="bench/results/context_parallel.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = document_masks(args.seq, args.docs, args.repeats)
    print_document_masks(rows)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "document_masks": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
