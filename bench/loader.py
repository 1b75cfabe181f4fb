"""Loader throughput: samples/s that MicroBatchLoader delivers from real shards, against the
samples/s a training step consumes (the demo-sized model on this machine), in the same run.

    python bench/loader.py [--seq-length 256] [--micro-batch-size 8]
A ratio well above 1 means data loading is not the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from megatron_lite.config import Config, ModelConfig  # noqa: E402
from megatron_lite.data.dataset import build_datasets  # noqa: E402
from megatron_lite.data.format import ShardWriter, shard_name, write_manifest  # noqa: E402
from megatron_lite.data.loader import MicroBatchLoader  # noqa: E402


def make_shards(prefix: Path, tokens: int, shards: int = 4) -> None:
    rng = np.random.default_rng(0)
    entries = []
    for s in range(shards):
        w = ShardWriter(shard_name(prefix, s), np.uint16)
        sizes = rng.integers(100, 3000, size=tokens // shards // 1550)
        w.add_documents(rng.integers(0, 8000, size=int(sizes.sum())), sizes)
        entries.append(w.finalize())
    write_manifest(f"{prefix}.manifest.json", {
        "shards": entries, "total_documents": sum(e["documents"] for e in entries),
        "total_tokens": sum(e["tokens"] for e in entries)})


def loader_rate(prefix: Path, seq: int, mbs: int, steps: int) -> float:
    ds = build_datasets([str(prefix)], "100,0,0", seq, 0, [steps * mbs * 4, 0, 0])[0]
    loader = MicroBatchLoader(ds, micro_batch_size=mbs, global_batch_size=mbs * 4,
                              dp_rank=0, dp_size=1)
    loader.next_step()
    t = time.perf_counter()
    n = 0
    for _ in range(steps):
        n += sum(len(b["tokens"]) for b in loader.next_step())
    return n / (time.perf_counter() - t)


def train_rate(seq: int, mbs: int) -> float:
    """Samples/s of the training loop on mock data (start-up cancelled by two run lengths)."""
    import torch

    from megatron_lite.training import run

    torch.set_num_threads(2)
    times = {}
    for iters in (2, 6):
        cfg = Config(model=ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4,
                                       seq_length=seq, vocab_size=8000))
        cfg.data.mock_data = True
        cfg.train.micro_batch_size, cfg.train.train_iters = mbs, iters
        cfg.train.eval_iters, cfg.logging.log_interval = 0, 1000
        t = time.perf_counter()
        run(cfg)
        times[iters] = time.perf_counter() - t
    return 4 * mbs / ((times[6] - times[2]) / 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--tokens", type=int, default=20_000_000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        make_shards(Path(tmp) / "c", args.tokens)
        load = loader_rate(Path(tmp) / "c", args.seq_length, args.micro_batch_size, 50)
    train = train_rate(args.seq_length, args.micro_batch_size)
    print(f"{'':<36} {'samples/s':>10}")
    print(f"{'loader (real shards, 1 process)':<36} {load:>10.0f}")
    print(f"{'training step consumes (4x256 model)':<36} {train:>10.1f}")
    print(f"ratio loader / training: {load / train:.0f}x")
    out = ROOT / "bench" / "results" / "loader.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({**vars(args), "loader_samples_s": load,
                               "train_samples_s": train, "ratio": load / train}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
