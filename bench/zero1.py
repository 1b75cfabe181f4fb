"""ZeRO-1 vs plain data parallelism: step time, optimizer memory and DP bytes per rank.

Each rank builds one model + optimizer per variant (plain DP, plain DP with overlapped
gradient reduction, ZeRO-1, ZeRO-1 with overlapped reduction and parameter gather) and then
runs full training steps round-robin over the variants, so machine noise hits all of them
alike; the median step time of each is compared with plain DP's. Memory is what each
optimizer holds (`Optimizer.memory()`), bytes are what the DP collectives sent (ring volume).
Targets at DP=2: ZeRO-1 step time <= 1.05 x plain, optimizer memory <= 0.51 x plain.

    python bench/zero1.py [--nproc 2] [--steps 20] [--size small|medium]   # CPU, gloo
    torchrun --nproc_per_node=2 bench/zero1.py                              # GPUs, nccl
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

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.config import Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.launch import LaunchEnv, detect_launch_env
from megatron_lite.parallel.state import ParallelState
from megatron_lite.training import StepRunner, build_model, global_token_count

SIZES = {
    "small": dict(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=704,
                  seq_length=128, vocab_size=4096),
    "medium": dict(num_layers=8, hidden_size=512, num_attention_heads=8, ffn_hidden_size=1408,
                   seq_length=256, vocab_size=8192),
}
VARIANTS = {
    "plain": {},
    "plain+overlap": {"overlap_grad_reduce": True, "ddp_bucket_size": 1_000_000},
    "zero1": {"use_distributed_optimizer": True},
    "zero1+overlap": {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                      "overlap_param_gather": True, "ddp_bucket_size": 1_000_000},
}
MICRO, ACCUMULATION = 2, 2


def _config(size: str, dp: int, flags: dict) -> Config:
    return Config(model=ModelConfig(**SIZES[size], make_vocab_size_divisible_by=128),
                  parallel=ParallelConfig(**flags),
                  optim=OptimConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0),
                  train=TrainConfig(micro_batch_size=MICRO, seed=0,
                                    global_batch_size=MICRO * ACCUMULATION * dp,
                                    bf16=torch.cuda.is_available()))


def batches(step: int, pstate: ParallelState, cfg: Config) -> list[dict[str, torch.Tensor]]:
    """Step `step`'s ACCUMULATION random micro-batches of this DP rank (bench/sharding.py too)."""
    g = torch.Generator().manual_seed(step * 1000 + pstate.dp_rank)
    seq = cfg.model.seq_length
    tokens = torch.randint(0, cfg.model.vocab_size, (ACCUMULATION, MICRO, seq + 1), generator=g)
    return [{"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(MICRO, seq)}
            for t in tokens]


def timed_step(runner: StepRunner, opt: Optimizer, pstate: ParallelState, cfg: Config,
               step: int) -> float:
    """Seconds of one whole training step (backward, DP reduction, update, parameter sync)."""
    data = batches(step, pstate, cfg)
    if pstate.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    opt.zero_grad()
    loss = runner(data, global_token_count(data, pstate))
    opt.finalize_grads()
    opt.step(cfg.optim.lr)
    opt.finish_param_sync()
    if pstate.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    if not torch.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss.item()}")
    return elapsed


def _measure(pstate: ParallelState, size: str, steps: int) -> dict[str, dict]:
    setups = {}
    for name, flags in VARIANTS.items():
        cfg = _config(size, pstate.dp_size, flags)
        chunks = build_model(cfg, pstate)
        opt = Optimizer(cfg, chunks, pstate)
        setups[name] = (cfg, StepRunner(cfg, pstate, chunks), opt)
    times: dict[str, list[float]] = {name: [] for name in setups}
    for step in range(steps + 2):  # two warm-up rounds
        for name, (cfg, runner, opt) in setups.items():
            opt.traffic.reset()
            elapsed = timed_step(runner, opt, pstate, cfg, step)
            if step >= 2:
                times[name].append(elapsed)
    out = {}
    for name, (_, _, opt) in setups.items():
        mem = opt.memory()
        out[name] = {"step_s": statistics.median(times[name]), "state_bytes": mem.state_bytes,
                     "grad_buffer_bytes": mem.grad_buffer_bytes, "params": mem.local_params,
                     "padding": mem.padding_elements, "dp_bytes": opt.traffic.total_bytes,
                     "dp_calls": dict(opt.traffic.calls)}
    return out


def _spawned(rank: int, world: int, init_file: str, measure: Callable, args: tuple,
             queue) -> None:
    torch.set_num_threads(1)
    env = LaunchEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                    master_addr="127.0.0.1", master_port=0, source="bench", node_rank=0,
                    num_nodes=1)
    cfg = Config(parallel=ParallelConfig(distributed_backend="gloo"))
    pstate = parallel_state.initialize(cfg, env=env, init_method=f"file://{init_file}")
    try:
        queue.put((rank, measure(pstate, *args)))
    finally:
        parallel_state.destroy(pstate)


def spawn_ranks(world: int, measure: Callable, *args: object) -> list:
    """`measure(pstate, *args)` on `world` spawned gloo ranks (one thread each): their results
    by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "rendezvous")
    procs = [ctx.Process(target=_spawned, args=(r, world, init_file, measure, args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


def _run(args: argparse.Namespace) -> tuple[list[dict], str]:
    if "LOCAL_RANK" in os.environ:  # under torchrun
        pstate = parallel_state.initialize(Config(), env=detect_launch_env())
        try:
            local = _measure(pstate, args.size, args.steps)
            gathered: list = [None] * pstate.world_size
            torch.distributed.all_gather_object(gathered, local)
        finally:
            parallel_state.destroy(pstate)
        return (gathered if pstate.rank == 0 else []), str(pstate.device)
    return (spawn_ranks(args.nproc, _measure, args.size, args.steps),
            "cpu (gloo, 1 thread per rank)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn on CPU")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--output", default="bench/results/zero1.json")
    args = parser.parse_args()
    ranks, device = _run(args)
    if not ranks:
        return
    base = ranks[0]["plain"]
    print(f"DP={len(ranks)}, {args.size} model ({base['params'] / 1e6:.2f} M params), {device}, "
          f"median of {args.steps} steps; ratios to plain DP (targets: zero1 time <= 1.05, "
          "memory <= 0.51)")
    print(f"{'variant':<15} {'step ms':>8} {'time x':>7} {'opt MiB':>8} {'mem x':>6} "
          f"{'DP MiB/step':>11} {'bytes x':>7}  calls/step")
    rows = []
    for name in VARIANTS:
        # The slowest rank sets the step time; memory and bytes are per rank (rank 0).
        step_s = max(r[name]["step_s"] for r in ranks)
        base_s = max(r["plain"]["step_s"] for r in ranks)
        r0 = ranks[0][name]
        row = {"variant": name, **r0, "step_s": step_s, "time_ratio": step_s / base_s,
               "memory_ratio": r0["state_bytes"] / base["state_bytes"],
               "bytes_ratio": r0["dp_bytes"] / base["dp_bytes"]}
        rows.append(row)
        print(f"{name:<15} {step_s * 1e3:>8.1f} {row['time_ratio']:>7.3f} "
              f"{r0['state_bytes'] / 2**20:>8.2f} {row['memory_ratio']:>6.3f} "
              f"{r0['dp_bytes'] / 2**20:>11.2f} {row['bytes_ratio']:>7.3f}  {r0['dp_calls']}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"dp": len(ranks), "size": args.size, "device": device,
                               "steps": args.steps, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
