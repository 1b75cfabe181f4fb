"""Measure what the planner's step-time model assumes, on this device: the calibration file.

Times the GEMMs one rank of a planned model runs (its layers' and output layer's at TP 1, 2,
4, 8 with a micro-batch of --micro-batch-size x --seq-length tokens, plus thin ones down to a
head dim of 64), the model's attention kernel (causal SDPA forward + backward), the streaming
bandwidth (a large copy), the cost of one tiny kernel, and, with
--ranks >= 2 (default: every GPU here), all-reduce / all-gather / reduce-scatter bus bandwidth
over sizes (bus bandwidth = ring factor x bytes / time, nccl-tests' definition). Writes
OUT/calibration.json, which `scripts/plan.py --calibration FILE` reads (plan_time.load_calibration
fits the GEMM curve to it), and OUT/calibration.txt. scripts/gpu_check.sh runs it (part
calibrate); on a CPU it runs the same code small (tests/test_gpu_calibrate.py).

    python bench/gpu_calibrate.py --out gpu_check [--preset 8B] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_lite import plan_time  # noqa: E402
from megatron_lite.devices import device_peak  # noqa: E402
from megatron_lite.planner import PRESETS, model_shape  # noqa: E402

FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
           "reduce_scatter": lambda n: (n - 1) / n}
"""Ring bus-bandwidth factors, as plan_time.collective_s charges them."""


def _timed(fn, device: torch.device, seconds: float) -> float:
    """Median seconds of `fn` (synchronised on CUDA) over at least `seconds`, after a warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def gemm_shapes(preset: str, tokens: int, tps: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(m, n, k) of one rank's layer and output-layer GEMMs at each TP, and thin GEMMs whose
    smallest dimension is 64..512 (the curve's knee), deduplicated."""
    model = PRESETS[preset][1]
    shapes = []
    for tp in tps:
        shape = model_shape(model, tp)
        work = plan_time.Work(tokens, model.seq_length, tp)
        body, _ = plan_time.layer_passes(shape, work, plan_time.PRESETS["h100-sxm"])
        shapes += [(int(m), int(n), int(k)) for m, n, k, _ in body.gemms]
        shapes.append((tokens, shape.vocab // tp, shape.hidden))
    shapes += [(tokens, model.hidden_size, d) for d in (64, 128, 256, 512)]
    return sorted(set(shapes))


def time_gemms(shapes: list[tuple[int, int, int]], device: torch.device, dtype: torch.dtype,
               seconds: float) -> list[dict]:
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        s = _timed(lambda a=a, b=b: a @ b, device, seconds)
        out.append({"m": m, "n": n, "k": k, "seconds": s, "tflops": 2 * m * n * k / s / 1e12})
    return out


def time_attention(preset: str, tokens: int, device: torch.device, dtype: torch.dtype,
                   seconds: float) -> dict:
    """The model's causal SDPA forward + backward at TP 1 on `tokens` tokens (sequences of
    --seq-length), at the rate of the planner's count of its FLOPs (plan_time.flash_core):
    `Hardware.attention_tflops`."""
    model = PRESETS[preset][1]
    shape, seq = model_shape(model, 1), min(model.seq_length, tokens)
    batch = max(1, tokens // seq)
    q, k, v = (torch.randn(batch, n, seq, shape.head_dim, device=device, dtype=dtype,
                           requires_grad=True)
               for n in (shape.heads, shape.query_groups, shape.query_groups))
    grad = torch.randn_like(q)

    def core() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=shape.query_groups != shape.heads)
        torch.autograd.grad(out, (q, k, v), grad)

    s = _timed(core, device, seconds)
    flops = plan_time.flash_core(batch * seq, seq, shape.heads, shape.head_dim).flops_per_step
    return {"batch": batch, "seq": seq, "heads": shape.heads, "groups": shape.query_groups,
            "head_dim": shape.head_dim, "seconds": s, "tflops": flops / s / 1e12}


def time_memory(device: torch.device, nbytes: int, seconds: float) -> tuple[float, float]:
    """(copy GB/s counting read + write, microseconds per tiny kernel)."""
    src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    gbps = 2 * nbytes / _timed(lambda: dst.copy_(src), device, seconds) / 1e9
    tiny = torch.zeros(1, device=device)
    op_s = _timed(lambda: [tiny.add_(1) for _ in range(100)], device, seconds) / 100
    return gbps, op_s * 1e6


def _collective_rank(rank: int, world: int, init: str, backend: str, sizes: list[int],
                     seconds: float, out: str) -> None:
    """One rank of the collective sweep; rank 0 writes the results to `out`."""
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    rows = []
    for nbytes in sizes:
        full = torch.ones(nbytes // 2, device=device, dtype=torch.bfloat16)
        shard = torch.empty(nbytes // 2 // world, device=device, dtype=torch.bfloat16)
        ops = {"all_reduce": lambda full=full: dist.all_reduce(full),
               "all_gather": lambda full=full, shard=shard: dist.all_gather_single(full,
                                                                                      shard),
               "reduce_scatter": lambda full=full, shard=shard: dist.reduce_scatter_single(
                   shard, full)}
        for op, fn in ops.items():
            s = _timed(fn, device, seconds)
            rows.append({"op": op, "ranks": world, "bytes": nbytes, "seconds": s,
                         "busbw_gbps": FACTORS[op](world) * nbytes / s / 1e9})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def time_collectives(ranks: int, backend: str, sizes: list[int], seconds: float) -> list[dict]:
    """The sweep on `ranks` spawned processes (file rendezvous), rank 0's timings."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "collectives.json")
        mp.spawn(_collective_rank, args=(ranks, f"file://{tmp}/rendezvous", backend, sizes,
                                         seconds, out), nprocs=ranks, join=True)
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="8B")
    ap.add_argument("--seq-length", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ranks", type=int, help="collective ranks (default: the GPUs here; "
                                              "they are timed with 2+)")
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--collective-mib", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--seconds", type=float, default=0.2, help="per timing")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = args.seq_length * args.micro_batch_size
    gemms = time_gemms(gemm_shapes(args.preset, tokens, tuple(args.tp)), device, dtype,
                       args.seconds)
    peak, source = device_peak(device, dtype) if device.type == "cuda" else (
        max(g["tflops"] for g in gemms), "the fastest GEMM timed here")
    gbps, op_us = time_memory(device, args.copy_mib * 2**20, args.seconds)
    core = time_attention(args.preset, tokens, device, dtype, args.seconds)
    ranks = args.ranks or (torch.cuda.device_count() if device.type == "cuda" else 1)
    collectives = time_collectives(ranks, "nccl" if device.type == "cuda" else "gloo",
                                   [m * 2**20 for m in args.collective_mib], args.seconds) \
        if ranks >= 2 else []
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    record = {"device": name, "dtype": str(dtype), "peak_tflops": peak, "peak_source": source,
              "gemms": gemms, "hbm_gbps": gbps, "op_us": op_us, "attention": core,
              "attention_tflops": core["tflops"], "collectives": collectives}
    e_max, half = plan_time.fit_gemm_curve([(min(g["m"], g["n"], g["k"]), g["tflops"] / peak)
                                            for g in gemms])
    record["fit"] = {"gemm_efficiency": e_max, "gemm_half_dim": half}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.json").write_text(json.dumps(record, indent=1))
    lines = [f"calibration ({name}, {dtype}): peak {peak:g} TFLOP/s ({source}); GEMM curve "
             f"e_max {e_max:.3f}, d_half {half:.0f} (planner's fit: "
             f"{plan_time.H100_FIT['gemm_efficiency']}, {plan_time.H100_FIT['gemm_half_dim']:g})",
             f"  copy {gbps:,.0f} GB/s, {op_us:.1f} us per tiny kernel",
             f"  attention (causal SDPA fwd + bwd, {core['batch']} x {core['seq']} tokens, "
             f"{core['heads']}/{core['groups']} heads of {core['head_dim']}): "
             f"{core['tflops']:.4g} TFLOP/s ({core['tflops'] / peak:.0%})"]
    lines += [f"  gemm {g['m']} x {g['n']} x {g['k']}: {g['tflops']:.4g} TFLOP/s "
              f"({g['tflops'] / peak:.0%})" for g in gemms]
    lines += [f"  {c['op']} x{c['ranks']} {c['bytes'] / 2**20:g} MiB: bus {c['busbw_gbps']:.3g} "
              "GB/s" for c in collectives] or [
                  "  collectives: one GPU here (bus bandwidth is timed with 2+)"]
    (args.out / "calibration.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
