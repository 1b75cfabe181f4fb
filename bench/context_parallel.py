"""Long context: attention with document masks against without, and how document masks are run.

Document masks (`document_masks`): forward + backward of one attention layer on packed
sequences of `n` documents (random cuts), three ways, round-robin so machine noise hits all
alike; median times as ratios against plain causal attention (no documents) in the same run:
  causal       attention() without documents: the plain SDPA causal call (the baseline)
  pairs        attention() with documents: one flash call per document run (what we ship)
  sdpa+mask    SDPA with the s x s boolean mask (causal and same document)
The last column is pairs / sdpa+mask, the measurement behind layers/attention.py's choice.

The ring (`ring`): forward + backward of a small model (2 layers, h 256, 4 heads of 64) on one
sequence of s tokens, CP=1 in one process against CP=2 in two gloo processes (one thread
each), the same tokens; the CP=2 time is the slower rank's. Ideal is 0.5x (half the tokens
per rank); what is above it is the ring's p2p (K/V forward, K/V + dK/dV backward) and the
per-block planning, which a longer sequence amortizes. The CPU-time ratio (work per rank)
is shown too: on a machine whose cores other processes share, wall time cannot reach 0.5x.

    python bench/context_parallel.py [--seq 2048 4096] [--docs 1 8 32] [--repeats 5]
    python bench/context_parallel.py --part ring [--ring-seq 512 1024 2048 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.config import Config, ModelConfig, ParallelConfig, TrainConfig
from megatron_lite.data.loader import SequenceLayout, to_batch
from megatron_lite.layers.attention import attention
from megatron_lite.parallel import comms
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.launch import LaunchEnv
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.training import StepRunner, build_model, global_token_count

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


RING_MODEL = dict(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=4,
                  ffn_hidden_size=704, vocab_size=4096)


def _ring_config(seq: int, cp: int) -> Config:
    return Config(model=ModelConfig(**RING_MODEL, seq_length=seq),
                  parallel=ParallelConfig(context_parallel_size=cp, distributed_backend="gloo"),
                  train=TrainConfig(micro_batch_size=1, global_batch_size=1, seed=0))


def ring_times(pstate: ParallelState, seqs: list[int], repeats: int
               ) -> dict[int, tuple[float, float]]:
    """Median fwd+bwd (wall, CPU) seconds of one sequence per length, at this state's CP size.
    CPU time (this process, all threads) is the work a rank does; wall time adds its waits for
    the ring and for cores other processes hold."""
    out = {}
    for s in seqs:
        cfg = _ring_config(s, pstate.cp_size)
        chunks = build_model(cfg, pstate)
        runner = StepRunner(cfg, pstate, chunks)
        sample = np.random.default_rng(s).integers(0, RING_MODEL["vocab_size"], s + 1)
        batch = to_batch([sample], None, False, SequenceLayout(pstate.cp_rank, pstate.cp_size))
        count = global_token_count([batch], pstate)
        wall, cpu = [], []
        for _ in range(repeats + 1):  # the first is a warm-up
            comms.barrier(pstate.world_group, pstate.device)
            start, start_cpu = time.perf_counter(), time.process_time()
            runner([batch], count)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
        out[s] = statistics.median(wall[1:]), statistics.median(cpu[1:])
    return out


def _ring_rank(rank: int, init_file: str, seqs: list[int], repeats: int, queue) -> None:
    torch.set_num_threads(1)
    env = LaunchEnv(rank=rank, local_rank=rank, world_size=2, local_world_size=2,
                    master_addr="127.0.0.1", master_port=0, source="bench", node_rank=0,
                    num_nodes=1)
    pstate = parallel_state.initialize(_ring_config(seqs[0], 2), env=env,
                                       init_method=f"file://{init_file}")
    try:
        queue.put((rank, ring_times(pstate, seqs, repeats)))
    finally:
        parallel_state.destroy(pstate)


def ring(seqs: list[int], repeats: int) -> list[dict]:
    """CP=1 (this process) against CP=2 (two spawned ranks) per sequence length."""
    single = ring_times(single_process_state(), seqs, repeats)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "rendezvous")
    procs = [ctx.Process(target=_ring_rank, args=(r, init_file, seqs, repeats, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    ranks = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    rows = []
    for s in seqs:
        wall, cpu = (max(ranks[r][s][i] for r in ranks) for i in (0, 1))
        rows.append(dict(seq=s, cp1_s=single[s][0], cp2_s=wall, cp2_vs_cp1=wall / single[s][0],
                         cp1_cpu_s=single[s][1], cp2_cpu_s=cpu,
                         cp2_vs_cp1_cpu=cpu / single[s][1]))
    return rows


def print_ring(rows: list[dict]) -> None:
    print(f"model fwd+bwd, one sequence, {RING_MODEL}; CP=2 = two gloo ranks of 1 thread "
          "(slower rank); ideal 0.50x")
    print(f"{'seq':>6} {'CP=1 ms':>9} {'CP=2 ms':>9} {'CP2/CP1':>8} {'CPU CP2/CP1':>12}")
    for r in rows:
        print(f"{r['seq']:>6} {r['cp1_s'] * 1e3:>9.1f} {r['cp2_s'] * 1e3:>9.1f} "
              f"{r['cp2_vs_cp1']:>7.2f}x {r['cp2_vs_cp1_cpu']:>11.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--docs", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default="bench/results/context_parallel.json")
    parser.add_argument("--part", choices=["documents", "ring", "all"], default="all")
    parser.add_argument("--ring-seq", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {"threads": args.threads}
    if args.part in ("documents", "all"):
        result["document_masks"] = rows = document_masks(args.seq, args.docs, args.repeats)
        print_document_masks(rows)
    if args.part in ("ring", "all"):
        result["ring"] = rows = ring(args.ring_seq, args.repeats)
        print_ring(rows)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
