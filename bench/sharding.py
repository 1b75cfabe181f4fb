"""--data-parallel-sharding-strategy: step time, peak memory and DP bytes per strategy.

For each DP size (default 2 and 4, one spawn each) every rank builds one model + optimizer
per strategy and runs full training steps round-robin over them, so machine noise hits all
alike; the median step time of each is compared with no_shard's. Memory: the states each
optimizer keeps between steps (`Optimizer.memory()` plus its parameter storage, ZeRO-3's
shards), and the peak of one whole step
(model, optimizer and every tensor allocated in the step, including the gradient buckets in
flight), counted by `memory.LiveBytes` while that first step runs (untimed: counting slows
every op). Bytes are what the DP collectives sent per step (ring volume, `comms.Traffic`).
Two micro-batches per step, so ZeRO-2's per-micro-batch reduce-scatter shows its cost next to
the full-buffer accumulation.

    python bench/sharding.py [--dp 2 4] [--steps 10] [--size small|medium]   # CPU, gloo
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.zero1 import ACCUMULATION, MICRO, SIZES, spawn_ranks, timed_step
from megatron_lite.config import Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from megatron_lite.memory import LiveBytes
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel.state import ParallelState
from megatron_lite.training import StepRunner, build_model

BUCKET = 250_000
"""Elements per gradient bucket: several buckets per model, so ZeRO-2 can drop them in turn."""
VARIANTS = {
    "no_shard": {"data_parallel_sharding_strategy": "no_shard"},
    "optim": {"data_parallel_sharding_strategy": "optim"},
    "optim_grads": {"data_parallel_sharding_strategy": "optim_grads"},
    "optim_grads/full-buffer": {"data_parallel_sharding_strategy": "optim_grads",
                                "sharded_grad_accumulation": "full-buffer"},
    "optim_grads_params": {"data_parallel_sharding_strategy": "optim_grads_params"},
}


def _config(size: str, dp: int, flags: dict) -> Config:
    return Config(model=ModelConfig(**SIZES[size], make_vocab_size_divisible_by=128),
                  parallel=ParallelConfig(**flags, ddp_bucket_size=BUCKET,
                                          overlap_grad_reduce=True),
                  optim=OptimConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0),
                  train=TrainConfig(micro_batch_size=MICRO, seed=0,
                                    global_batch_size=MICRO * ACCUMULATION * dp))


def _build(pstate: ParallelState, size: str, flags: dict) -> tuple | str:
    """(cfg, runner, optimizer, peak bytes of the first step) or why the strategy is out."""
    cfg = _config(size, pstate.dp_size, flags)
    with LiveBytes(pstate.device) as live:
        chunks = build_model(cfg, pstate)
        try:
            opt = Optimizer(cfg, chunks, pstate)
        except ValueError as e:  # a strategy this build does not have
            return str(e)
        runner = StepRunner(cfg, pstate, chunks, on_grads_ready=opt.start_grad_sync)
        timed_step(runner, opt, pstate, cfg, step=0)
        peak = live.peak
    return cfg, runner, opt, peak


def _measure(pstate: ParallelState, size: str, steps: int) -> dict[str, dict]:
    setups, out = {}, {}
    for name, flags in VARIANTS.items():
        built = _build(pstate, size, flags)
        if isinstance(built, str):
            out[name] = {"unavailable": built}
        else:
            setups[name] = built
    times: dict[str, list[float]] = {name: [] for name in setups}
    for step in range(1, steps + 2):  # one more warm-up round
        for name, (cfg, runner, opt, _) in setups.items():
            opt.traffic.reset()
            elapsed = timed_step(runner, opt, pstate, cfg, step)
            if step >= 2:
                times[name].append(elapsed)
    for name, (_, _, opt, peak) in setups.items():
        mem = opt.memory()
        param_bytes = sum(t.numel() * t.element_size() for t in opt.param_tensors())
        out[name] = {"step_s": statistics.median(times[name]), "params": mem.local_params,
                     "state_bytes": param_bytes + mem.grad_buffer_bytes + mem.state_bytes,
                     "peak_bytes": peak, "dp_bytes": opt.traffic.total_bytes,
                     "dp_calls": dict(opt.traffic.calls)}
        opt.close()
    return out


def _table(dp: int, ranks: list[dict]) -> list[dict]:
    base = ranks[0]["no_shard"]
    base_s = max(r["no_shard"]["step_s"] for r in ranks)
    print(f"\nDP={dp}: ratios to no_shard (time: slowest rank; bytes: rank 0)")
    print(f"{'strategy':<24} {'step ms':>8} {'time x':>7} {'states MiB':>10} {'x':>6} "
          f"{'peak MiB':>9} {'x':>6} {'DP MiB/step':>11} {'x':>6}  calls/step")
    rows = []
    for name in VARIANTS:
        r0 = ranks[0][name]
        if "unavailable" in r0:
            print(f"{name:<24} (not measured: {r0['unavailable']})")
            rows.append({"strategy": name, **r0})
            continue
        step_s = max(r[name]["step_s"] for r in ranks)
        row = {"strategy": name, **r0, "step_s": step_s, "time_ratio": step_s / base_s,
               "state_ratio": r0["state_bytes"] / base["state_bytes"],
               "peak_ratio": r0["peak_bytes"] / base["peak_bytes"],
               "bytes_ratio": r0["dp_bytes"] / base["dp_bytes"]}
        rows.append(row)
        mib = 2**20
        print(f"{name:<24} {step_s * 1e3:>8.1f} {row['time_ratio']:>7.3f} "
              f"{r0['state_bytes'] / mib:>10.2f} {row['state_ratio']:>6.3f} "
              f"{r0['peak_bytes'] / mib:>9.2f} {row['peak_ratio']:>6.3f} "
              f"{r0['dp_bytes'] / mib:>11.2f} {row['bytes_ratio']:>6.3f}  {r0['dp_calls']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="DP sizes to spawn")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--output", default="bench/results/sharding.json")
    args = parser.parse_args()
    print(f"{args.size} model, fp32, cpu (gloo, 1 thread per rank), {MICRO * ACCUMULATION} "
          f"samples per rank per step in {ACCUMULATION} micro-batches, buckets of {BUCKET:,} "
          f"elements, median of {args.steps} steps")
    results = {}
    for dp in args.dp:
        results[dp] = _table(dp, spawn_ranks(dp, _measure, args.size, args.steps))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"size": args.size, "device": "cpu (gloo)", "steps": args.steps,
                               "micro_batches": ACCUMULATION, "bucket": BUCKET,
                               "by_dp": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
