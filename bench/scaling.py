"""Strong and weak scaling of the training step over DP, TP and PP layouts.

Strong scaling keeps the global batch fixed (more ranks, fewer accumulation steps each); weak
scaling keeps the per-DP-rank batch fixed (the global batch grows with DP). Each layout trains
the same small Llama on mock data: warm-up steps, then whole optimizer steps timed between two
barriers on every rank. Efficiency = throughput(N ranks) / (N x throughput(1 rank)), against
the one-rank run measured in the same invocation. Peak memory per rank is CUDA max allocated,
or the process's peak resident set on CPU (which includes the Python/torch baseline).

    python bench/scaling.py [--steps 6] [--warmup 2] [--repeats 3] [--max-world 2]

One process per rank (gloo on CPU, nccl with GPUs); on CPU each rank gets --threads threads, so
N ranks need N x threads cores for the numbers to mean scaling rather than time-sharing.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.config import (
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from megatron_lite.data.builder import build_data_loaders
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.launch import LaunchEnv
from megatron_lite.training import StepRunner, build_model, train_step

MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
             ffn_hidden_size=704, seq_length=128, vocab_size=2048)


@dataclass(frozen=True)
class Layout:
    name: str
    mode: str  # "strong" or "weak"
    dp: int
    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


def layouts(max_world: int) -> list[Layout]:
    out = [Layout("dp1", "baseline", 1)]
    dps = [n for n in (2, 4, 8) if n <= max_world]
    out += [Layout(f"dp{n}", "strong", n) for n in dps]
    if max_world >= 2:
        out += [Layout("tp2", "strong", 1, tp=2), Layout("pp2", "strong", 1, pp=2)]
    if max_world >= 4:
        out += [Layout("dp2-tp2", "strong", 2, tp=2), Layout("dp2-pp2", "strong", 2, pp=2)]
    out += [Layout(f"dp{n}", "weak", n) for n in dps]
    return out


def _config(lay: Layout, micro: int, per_rank_batch: int, global_batch: int) -> Config:
    gbs = per_rank_batch * lay.dp if lay.mode == "weak" else global_batch
    return Config(model=ModelConfig(**MODEL, make_vocab_size_divisible_by=64),
                  parallel=ParallelConfig(tensor_model_parallel_size=lay.tp,
                                          pipeline_model_parallel_size=lay.pp,
                                          distributed_backend="auto"),
                  optim=OptimConfig(lr=1e-3), data=DataConfig(mock_data=True),
                  train=TrainConfig(micro_batch_size=micro, global_batch_size=gbs, seed=0),
                  logging=LoggingConfig())


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _rank_main(rank: int, world: int, init_file: str, cfg: Config, steps: int, warmup: int,
               threads: int, results: mp.Queue) -> None:
    torch.set_num_threads(threads)
    env = LaunchEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                    master_addr="127.0.0.1", master_port=0, source="bench", node_rank=0,
                    num_nodes=1)
    ps = None
    try:
        ps = parallel_state.initialize(cfg, env, init_method=f"file://{init_file}")
        chunks = build_model(cfg, ps)
        optimizer = Optimizer(cfg, chunks, ps)
        loader, _ = build_data_loaders(cfg, ps.dp_rank, ps.dp_size)
        runner = StepRunner(cfg, ps, chunks)
        for _ in range(warmup):
            train_step(runner, optimizer, loader, ps, 1e-3)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            train_step(runner, optimizer, loader, ps, 1e-3)
        dist.barrier()
        elapsed = time.perf_counter() - start
        results.put((rank, True, (elapsed, _peak_memory_gib(ps.device),
                                  loader.global_batch_size)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if ps is not None:
            parallel_state.destroy(ps)


def run_layout(lay: Layout, cfg: Config, steps: int, warmup: int, threads: int) -> dict:
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank_main, args=(r, lay.world, init_file, cfg, steps,
                                                      warmup, threads, results), daemon=True)
                 for r in range(lay.world)]
        for p in procs:
            p.start()
        out: dict[int, tuple] = {}
        try:
            for _ in procs:
                rank, ok, payload = results.get(timeout=600)
                if not ok:
                    raise RuntimeError(f"{lay.name} rank {rank} failed:\n{payload}")
                out[rank] = payload
        except queue.Empty:
            raise RuntimeError(f"{lay.name}: ranks did not finish in 600 s") from None
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    elapsed = max(v[0] for v in out.values())
    gbs = out[0][2]
    return {"layout": lay.name, "mode": lay.mode, "world": lay.world, "dp": lay.dp,
            "tp": lay.tp, "pp": lay.pp, "global_batch": gbs, "steps": steps,
            "step_s": elapsed / steps, "samples_per_s": gbs * steps / elapsed,
            "peak_mem_gib_per_rank": [out[r][1] for r in range(lay.world)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--max-world", type=int,
                        default=torch.cuda.device_count() if torch.cuda.is_available() else 2)
    parser.add_argument("--repeats", type=int, default=3, help="runs per layout (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--per-rank-batch", type=int, default=8,
                        help="weak scaling: samples per DP rank per step")
    parser.add_argument("--global-batch", type=int, default=8, help="strong scaling batch")
    parser.add_argument("--output", default="bench/results/scaling.json")
    args = parser.parse_args()
    plan = layouts(args.max_world)
    runs: list[list[dict]] = [[] for _ in plan]
    for rep in range(args.repeats):  # round-robin, so machine noise hits every layout alike
        for i, lay in enumerate(plan):
            cfg = _config(lay, args.micro_batch_size, args.per_rank_batch, args.global_batch)
            runs[i].append(run_layout(lay, cfg, args.steps, args.warmup, args.threads))
            print(f"  repeat {rep}: {lay.mode:<8} {lay.name:<8} "
                  f"{runs[i][-1]['samples_per_s']:.2f} samples/s", flush=True)
    rows = []
    for tries in runs:
        best = sorted(tries, key=lambda r: r["samples_per_s"])[len(tries) // 2]  # median
        rows.append({**best, "samples_per_s_all": [r["samples_per_s"] for r in tries]})
    base = rows[0]["samples_per_s"]
    for row in rows:
        # Weak scaling with a bigger global batch: throughput(1) is still the one-rank rate.
        row["efficiency"] = row["samples_per_s"] / (row["world"] * base)
        row["speedup"] = row["samples_per_s"] / base
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else \
        f"CPU, {args.threads} thread(s) per rank, {os.cpu_count()} cores"
    print(f"\nscaling on {device}; model {MODEL}; {args.steps} timed steps after "
          f"{args.warmup} warm-up, median of {args.repeats} runs\n")
    print(f"{'mode':<8} {'layout':<8} {'ranks':>5} {'gbs':>4} {'step s':>7} {'samples/s':>9} "
          f"{'speedup':>7} {'effic.':>6} {'peak mem GiB/rank':>18}")
    for r in rows:
        mem = "/".join(f"{m:.2f}" for m in r["peak_mem_gib_per_rank"])
        print(f"{r['mode']:<8} {r['layout']:<8} {r['world']:>5} {r['global_batch']:>4} "
              f"{r['step_s']:>7.3f} {r['samples_per_s']:>9.2f} {r['speedup']:>7.2f} "
              f"{r['efficiency']:>6.2f} {mem:>18}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device, "model": MODEL, "args": vars(args),
                               "rows": rows}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
