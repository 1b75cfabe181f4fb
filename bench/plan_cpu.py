"""The planner's step time on this CPU against pretrain.py's measured iteration time.

For scripts/demo.sh's model (4 x 192, 4 heads, seq 128, micro-batch 16, vocab 4096) and
scripts/shakespeare_char_cpu.sh's (nanoGPT's 4 x 128, ffn 384, seq 64, batch 12, its char
vocabulary), both fp32 on one process: `--hardware cpu` measures this machine (matmul rate,
copy bandwidth, the cost of one small op, SDPA at the model's heads: plan_time.cpu_hardware),
and, for a second prediction, the model's own GEMMs (cold caches) and attention cores are
timed for its GEMM peak and attention rate (a CPU's rate depends on the shape); the planner
predicts one iteration from each, and pretrain.py runs the same model on mock data (same
shapes, same work per iteration) for --iters iterations, --rounds times. The constants are
measured before, between and after the runs and the median prediction is compared with the
median iteration after --warmup: this machine's speed drifts by 30% within a minute as other
jobs come and go. Target: prediction within +-30%. Prints a table and writes
bench/results/plan_cpu.json.

    OMP_NUM_THREADS=1 python bench/plan_cpu.py [--iters 30] [--warmup 5] [--rounds 2]
    python bench/plan_cpu.py --count-ops      # aten ops of one layer (CPU_KERNELS_PER_LAYER)
    python bench/plan_cpu.py --gemm-curve     # fp32 GEMM rate by size (CPU_GEMM_HALF_DIM)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_lite import plan_time  # noqa: E402
from megatron_lite.arguments import parse_config  # noqa: E402
from megatron_lite.planner import Cluster, Layout, Recompute, RunOptions, evaluate  # noqa: E402

MODELS = {
    "demo": ["--num-layers", "4", "--hidden-size", "192", "--num-attention-heads", "4",
             "--seq-length", "128", "--micro-batch-size", "16", "--vocab-size", "4096"],
    # the char tokenizer of Tiny Shakespeare: 65 characters + sentencepiece's specials
    "shakespeare_char": ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads",
                         "4", "--ffn-hidden-size", "384", "--seq-length", "64",
                         "--micro-batch-size", "12", "--vocab-size", "68"],
}
"""Each script's model and batch, as its pretrain.py command gives them."""


def _median_s(fn, seconds: float, cold: bool = False) -> float:
    """Median seconds of `fn` over at least `seconds` of calls (and 3 calls), after one
    warm-up; `cold`: each call after overwriting a buffer larger than the caches, as a
    training step's GEMM runs after the ops between have evicted its operands."""
    fn()
    times, spent = [], 0.0
    while spent < seconds or len(times) < 3:
        if cold:
            _EVICT.fill_(1.0)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        spent += times[-1]
    return sorted(times)[len(times) // 2]


_EVICT = torch.empty(2**24)
"""64 MiB, twice this CPU's last-level cache: `_median_s(cold=True)` writes it."""


def model_gemm_rate(flags: list[str], seconds: float = 0.1) -> tuple[float, float]:
    """(TFLOP/s of the model's own GEMMs on this CPU, as autograd runs them; of its attention
    core). Each layer and head GEMM forward (x @ wᵀ), its input gradient (dy @ w) and its
    weight gradient (dyᵀ @ x), and one causal SDPA forward and backward at the model's
    [b, heads, s, d], medians. The GEMMs run with cold caches (their weights and saved inputs
    come from memory in a training step: timed warm, the Shakespeare model's GEMMs took 43 ms
    per step, cold 49, inside pretrain.py's step under torch.profiler 50); the attention core
    warm (q, k, v are the previous op's output; warm 1.47 ms per layer, cold 2.6, in the step
    1.74). The FLOPs are the planner's own (the core's causal half; 2 matmuls forward, 5
    backward), so at these two rates the planner's GEMM time is the timed sum."""
    from megatron_lite.planner import model_shape

    cfg = parse_config(["--mock-data", *flags])
    shape = model_shape(cfg.model, 1)
    mbs, seq = cfg.train.micro_batch_size, cfg.model.seq_length
    work = plan_time.Work(seq * mbs, seq, e=4)
    body, core = plan_time.layer_passes(shape, work, plan_time.PRESETS["cpu"])
    gemms = [(m, n, k) for m, n, k, _ in body.gemms] + [(work.tokens, shape.vocab, shape.hidden)]
    layers = cfg.model.num_layers
    flops = seconds_total = 0.0
    for i, (m, n, k) in enumerate(gemms):
        times = layers if i < len(body.gemms) else 1  # each layer's GEMMs; the head once
        x, w, dy = (torch.randn(int(r), int(c)) for r, c in ((m, k), (n, k), (m, n)))
        for a, b in ((x, w.t()), (dy, w), (dy.t(), x)):
            flops += times * 2 * m * n * k
            seconds_total += times * _median_s(lambda a=a, b=b: a @ b, seconds, cold=True)
    q, k, v = (torch.randn(mbs, heads, seq, shape.head_dim, requires_grad=True)
               for heads in (shape.heads, shape.query_groups, shape.query_groups))
    grad = torch.randn(mbs, shape.heads, seq, shape.head_dim)

    def attention() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=shape.query_groups != shape.heads)
        torch.autograd.grad(out, (q, k, v), grad)

    return flops / seconds_total / 1e12, core.flops_per_step / _median_s(attention, seconds) / 1e12


def plan_py_hardware(flags: list[str]) -> plan_time.Hardware:
    """What scripts/plan.py --hardware cpu --fp32 measures for this model."""
    from megatron_lite.planner import model_shape

    cfg = parse_config(["--mock-data", *flags])
    return plan_time.cpu_hardware(model_shape(cfg.model, 1), cfg.model.seq_length, 4)


def predict(flags: list[str], hw: plan_time.Hardware) -> dict:
    """The planner's fp32 iteration on one CPU process, and its parts."""
    cfg = parse_config(["--mock-data", *flags])
    mbs = cfg.train.micro_batch_size
    plan = evaluate(cfg.model, Layout(1, 1, 1, 1, mbs, "no_shard", Recompute(), False),
                    Cluster.from_hardware(1, hw), mbs, 1e9, RunOptions(dtype_bytes=4))
    return {"step_s": plan.step_s, "gemm_s": plan.compute_s, "memory_s": plan.memory_s,
            "overhead_s": plan.overhead_s, "optimizer_s": plan.optimizer_s}


def measure(flags: list[str], iters: int, warmup: int) -> tuple[list[float], float]:
    """pretrain.py on mock data: its iteration times after `warmup`, and the CPU share the run
    got (its CPU seconds over its wall seconds; 1 thread on a core of its own gives 1.0, other
    jobs on the cores less)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "metrics.jsonl"
        cmd = [sys.executable, str(ROOT / "pretrain.py"), "--mock-data", *flags,
               "--train-iters", str(iters), "--lr", "1e-3", "--eval-iters", "0",
               "--log-interval", "1", "--wandb-mode", "disabled", "--seed", "1",
               "--log-jsonl", str(log)]
        before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
        times = [json.loads(line)["iter_time_ms"] / 1e3 for line in log.read_text().splitlines()
                 if '"iter_time_ms"' in line][warmup:]
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return times, cpu / wall


def summary(times: list[float], shares: list[float]) -> dict:
    """Median iteration time, its p10-p90 spread, and the runs' smallest CPU share."""
    times = sorted(times)
    return {"median_s": statistics.median(times), "p10_s": times[len(times) // 10],
            "p90_s": times[len(times) * 9 // 10], "samples": len(times),
            "cpu_share": min(shares)}


def count_ops(flags: list[str]) -> dict[str, int]:
    """aten ops one transformer layer dispatches outside its GEMMs, forward and backward, on
    the CPU reference path (what CPU_KERNELS_PER_LAYER stands for)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_lite.layers.context import LayerContext
    from megatron_lite.model.llama import LlamaChunk
    from megatron_lite.parallel.state import single_process_state

    gemms = ("mm", "addmm", "bmm", "matmul", "linear", "_scaled_dot_product")

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.__name__.split(".")[0].startswith(gemms):
                self.n += 1
            return func(*args, **(kwargs or {}))

    cfg = parse_config(["--mock-data", *flags])
    layer = LlamaChunk(cfg.model, LayerContext.from_state(single_process_state(), seed=0),
                       range(1), pre_process=False, post_process=False)
    x = torch.randn(cfg.model.seq_length, cfg.train.micro_batch_size, cfg.model.hidden_size,
                    requires_grad=True)
    with Count() as fwd:
        out = layer(x)
    with Count() as bwd:
        out.sum().backward()
    return {"forward": fwd.n, "backward": bwd.n}


def gemm_curve(seconds: float = 0.3) -> tuple[list[tuple[int, float]], float, float]:
    """fp32 GFLOP/s of 2048 x d x d GEMMs (medians) and the (e_max, d_half) fitted to them,
    relative to the d = 1024 rate."""
    rates = []
    for d in (16, 32, 64, 128, 256, 512, 1024):
        a, b = torch.randn(2048, d), torch.randn(d, d)
        rates.append((d, 2 * 2048 * d * d / _median_s(lambda a=a, b=b: a @ b, seconds) / 1e9))
    top = rates[-1][1]
    e_max, half = plan_time.fit_gemm_curve([(d, r / top) for d, r in rates])
    return rates, e_max, half


def _model_row(name: str, flags: list[str], args: argparse.Namespace) -> dict:
    """One model's measured and predicted step: constants before, between and after
    --rounds runs, the median of the predictions from each (a shared CPU's speed drifts within
    minutes: another job's burst can halve one measurement, so constants from one other
    moment mislead)."""
    preds, hws, times, shares, generic = [], [], [], [], []
    for i in range(args.rounds + 1):
        if i:
            run_times, share = measure(flags, args.iters, args.warmup)
            times, shares = times + run_times, [*shares, share]
        hw = plan_py_hardware(flags)
        rate, core_rate = model_gemm_rate(flags)
        hws.append({**dataclasses.asdict(hw), "model_tflops": rate,
                    "model_attention_tflops": core_rate})
        preds.append(predict(flags, dataclasses.replace(hw, peak_tflops=rate,
                                                        attention_tflops=core_rate)))
        generic.append(predict(flags, hw)["step_s"])
    pred = sorted(preds, key=lambda p: p["step_s"])[len(preds) // 2]
    got = summary(times, shares)
    return {"model": name, "hardware": hws, "predicted": pred, "measured": got,
            "ratio": pred["step_s"] / got["median_s"],
            "plan_py_ratio": statistics.median(generic) / got["median_s"]}


def _print_table(rows: list[dict], threads: int) -> None:
    print(f"CPU, {threads} thread(s); constants measured around each run; the median prediction"
          "; pred/meas at the model's own GEMM and attention rates; plan.py: scripts/plan.py "
          "--hardware cpu --fp32's (its peak the 2048 x 256 x 256 matmul, its attention SDPA "
          "at the model's heads and sequence)")
    print(f"{'model':<17} {'matmul GF/s':>11} {'attn GF/s':>9} {'GEMMs':>8} {'attn':>8} "
          f"{'us/op':>7} "
          f"{'predicted ms':>12} {'(gemm':>6} {'memory':>6} {'ops':>5} {'optim)':>6} "
          f"{'measured ms':>11} {'p10-p90':>13} {'CPU share':>9} {'pred/meas':>9} {'plan.py':>7}")
    for r in rows:
        p, m, hw = r["predicted"], r["measured"], r["hardware"]

        def pair(key: str, scale: float = 1e3, width: int = 11, h=hw) -> str:
            return f"{'/'.join(f'{scale * x[key]:.0f}' for x in h):>{width}}"

        print(f"{r['model']:<17} {pair('peak_tflops')} {pair('attention_tflops', width=9)} "
              f"{pair('model_tflops', width=8)} {pair('model_attention_tflops', width=8)} "
              f"{pair('op_us', 1, 7)} "
              f"{1e3 * p['step_s']:>12.1f} {1e3 * p['gemm_s']:>6.1f} {1e3 * p['memory_s']:>6.1f} "
              f"{1e3 * p['overhead_s']:>5.1f} {1e3 * p['optimizer_s']:>6.1f} "
              f"{1e3 * m['median_s']:>11.1f} {1e3 * m['p10_s']:>6.1f}-{1e3 * m['p90_s']:<6.1f} "
              f"{m['cpu_share']:>9.2f} {r['ratio']:>9.2f} {r['plan_py_ratio']:>7.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2,
                    help="pretrain.py runs per model, constants measured around each")
    ap.add_argument("--count-ops", action="store_true")
    ap.add_argument("--gemm-curve", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "plan_cpu.json")
    args = ap.parse_args(argv)
    if args.count_ops:
        for name, flags in MODELS.items():
            print(name, count_ops(flags))
        return 0
    threads = int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))
    torch.set_num_threads(threads)
    if args.gemm_curve:
        rates, e_max, half = gemm_curve()
        print(" ".join(f"d={d}: {r:.0f}" for d, r in rates), "GFLOP/s")
        print(f"fit vs d=1024: e_max {e_max:.2f}, d_half {half:.0f}")
        return 0
    rows = [_model_row(name, flags, args) for name, flags in MODELS.items()]
    _print_table(rows, threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": threads, "rows": rows},
                                   indent=1))
    print(f"wrote {args.out}")
    return 0 if all(0.7 <= r[key] <= 1.3 for r in rows for key in ("ratio", "plan_py_ratio")) \
        else 1


if __name__ == "__main__":
    raise SystemExit(main())
