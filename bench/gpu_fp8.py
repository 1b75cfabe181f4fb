"""FP8 against bf16 on one GPU: the GEMMs at a model's shapes, then training speed and loss.

    python bench/gpu_fp8.py --model 1b [--steps 200 --warmup 10] [--out DIR]
    python bench/gpu_fp8.py --model tiny --device cpu --steps 4 --warmup 1   # CPU smoke

1. GEMMs: the four projections of one transformer layer (QKV, attention output, gate+up, down)
   at the model's tokens per micro-batch, timed as the bf16 matmul, as `torch._scaled_mm` on
   operands already in FP8 (what the tensor cores give), and as layers/fp8.py's `fp8_matmul`
   (both operands' amax, scale and cast included: what a linear pays when nothing is fused).
2. Training: `pretrain.py` twice on the same mock samples, `--bf16` and `--bf16 --fp8-format
   hybrid --fp8-recipe tensorwise`, both compiled with the Triton kernels on CUDA. tokens/s,
   TFLOP/s and MFU are medians after the warm-up steps; MFU divides by the bf16 dense peak on
   both sides (what the log reports), so the FP8 gain shows as a higher MFU. The losses are
   compared over the same steps: the mean of the last 10% of steps, FP8 relative to bf16.
Writes OUT/gpu_fp8_MODEL.json and .txt (the summary lines scripts/gpu_check.sh collects).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_lite.arguments import parse_config  # noqa: E402
from megatron_lite.layers.fp8 import FWD_DTYPE, fp8_matmul, quantize  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from gpu_train import EXIT_SKIPPED, MODELS, runnable  # noqa: E402


def layer_gemms(flags: list[str]) -> list[tuple[str, int, int, int]]:
    """(name, m, k, n) of one layer's projections: m = tokens of one micro-batch."""
    cfg = parse_config(flags)
    m, t = cfg.model, cfg.train
    tokens = t.micro_batch_size * m.seq_length
    d = m.head_dim
    return [("qkv", tokens, m.hidden_size, (m.num_attention_heads + 2 * m.num_query_groups) * d),
            ("attn_out", tokens, m.num_attention_heads * d, m.hidden_size),
            ("gate_up", tokens, m.hidden_size, 2 * m.ffn_hidden_size),
            ("down", tokens, m.ffn_hidden_size, m.hidden_size)]


def _time(fn: Callable[[], torch.Tensor], device: torch.device, reps: int) -> float:
    """Median seconds of one call, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_row(name: str, m: int, k: int, n: int, device: torch.device, reps: int) -> dict:
    """TFLOP/s of one [m, k] x [k, n] GEMM in bf16, in FP8 (`_scaled_mm`), and in FP8 with
    the casts."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    b = torch.randn(k, n, generator=g, device=device).to(torch.bfloat16)
    a8, a_inv = quantize(a, FWD_DTYPE)
    bt8, b_inv = quantize(b.t().contiguous(), FWD_DTYPE)  # column-major, as _scaled_mm wants
    flops = 2.0 * m * k * n
    seconds = {
        "bf16": _time(lambda: a @ b, device, reps),
        "fp8": _time(lambda: torch._scaled_mm(a8, bt8.t(), scale_a=a_inv, scale_b=b_inv,
                                              out_dtype=torch.bfloat16), device, reps),
        "fp8_with_casts": _time(lambda: fp8_matmul(a, b), device, reps)}
    row = {"gemm": name, "m": m, "k": k, "n": n}
    row.update({f"{key}_tflops": flops / s / 1e12 for key, s in seconds.items()})
    row["fp8_speedup"] = seconds["bf16"] / seconds["fp8"]
    row["fp8_with_casts_speedup"] = seconds["bf16"] / seconds["fp8_with_casts"]
    return row


def train(flags: list[str], jsonl: Path, device: str) -> list[dict]:
    """pretrain.py with `flags` in its own process; its per-step JSONL records."""
    jsonl.unlink(missing_ok=True)  # the logger appends
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, str(ROOT / "pretrain.py"), *flags, "--log-jsonl", str(jsonl)]
    print(f"== gpu_fp8: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=False)
    if not jsonl.exists():
        return []
    return [r for r in map(json.loads, jsonl.read_text().splitlines()) if "loss" in r]


def train_flags(args: argparse.Namespace) -> list[str]:
    flags = [*MODELS[args.model], "--mock-data", "--bf16", "--train-iters", str(args.steps),
             "--lr", "3e-4", "--lr-warmup-iters", str(args.warmup), "--lr-decay-style",
             "cosine", "--eval-iters", "0", "--log-interval", "1", "--seed", "1",
             "--wandb-mode", "disabled"]
    micro = parse_config(flags).train.micro_batch_size
    flags += ["--global-batch-size", str(micro)]
    if args.device == "cuda":
        flags += ["--triton-kernels", "on", "--compile"]
    return flags


def side(records: list[dict], warmup: int) -> dict | None:
    measured = records[warmup:]
    if not measured:
        return None
    return {key: statistics.median(r[key] for r in measured)
            for key in ("tokens_per_sec", "tflops_per_device", "mfu")} | {
            "losses": [r["loss"] for r in records]}


def compare(bf16: dict | None, fp8: dict | None, steps: int) -> dict:
    if not bf16 or not fp8 or len(bf16["losses"]) != steps or len(fp8["losses"]) != steps:
        return {"ok": False}
    tail = max(1, steps // 10)
    loss_bf16 = statistics.fmean(bf16["losses"][-tail:])
    loss_fp8 = statistics.fmean(fp8["losses"][-tail:])
    return {"ok": True, "tail_steps": tail, "loss_bf16": loss_bf16, "loss_fp8": loss_fp8,
            "loss_relative_difference": (loss_fp8 - loss_bf16) / loss_bf16,
            "speedup": fp8["tokens_per_sec"] / bf16["tokens_per_sec"]}


def report_lines(row: dict) -> list[str]:
    lines = [f"FP8 vs bf16, {row['model']} ({row['device']}):",
             f"  {'GEMM':<9} {'m':>6} {'k':>6} {'n':>6} {'bf16 TF/s':>10} {'fp8 TF/s':>9} "
             f"{'x':>5} {'+casts TF/s':>12} {'x':>5}"]
    for g in row["gemms"]:
        lines.append(f"  {g['gemm']:<9} {g['m']:>6} {g['k']:>6} {g['n']:>6} "
                     f"{g['bf16_tflops']:>10.4g} {g['fp8_tflops']:>9.4g} "
                     f"{g['fp8_speedup']:>5.2f} {g['fp8_with_casts_tflops']:>12.4g} "
                     f"{g['fp8_with_casts_speedup']:>5.2f}")
    for name in ("bf16", "fp8"):
        s = row[name]
        lines.append(f"  train {name}: " + ("no result" if s is None else
                     f"{s['tokens_per_sec']:.0f} tokens/s, {s['tflops_per_device']:.4g} "
                     f"TFLOP/s, MFU {s['mfu']:.1%} (bf16 peak), loss {s['losses'][0]:.3f} -> "
                     f"{s['losses'][-1]:.3f}"))
    c = row["compare"]
    if c["ok"]:
        lines.append(f"  over {row['steps']} steps: fp8 {c['speedup']:.3f}x the tokens/s of "
                     f"bf16; last {c['tail_steps']} steps' mean loss {c['loss_fp8']:.4f} vs "
                     f"{c['loss_bf16']:.4f} ({c['loss_relative_difference']:+.2%})")
    else:
        lines.append("  comparison: a run did not finish all its steps")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="1b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=200, help="training steps per side")
    parser.add_argument("--warmup", type=int, default=10, help="first steps not measured")
    parser.add_argument("--gemm-reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    if not runnable(parser, args, "bench/gpu_fp8.py"):
        return EXIT_SKIPPED
    args.out.mkdir(parents=True, exist_ok=True)
    flags = train_flags(args)
    stem = args.out / f"gpu_fp8_{args.model}"
    row: dict = {"model": args.model, "steps": args.steps, "device": (
        torch.cuda.get_device_name() if args.device == "cuda" else "cpu"),
        "gemms": [gemm_row(*gemm, torch.device(args.device), args.gemm_reps)
                  for gemm in layer_gemms(flags)]}
    fp8_flags = [*flags, "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    for name, run in (("bf16", flags), ("fp8", fp8_flags)):
        row[name] = side(train(run, stem.with_suffix(f".{name}.jsonl"), args.device),
                         args.warmup)
    row["compare"] = compare(row["bf16"], row["fp8"], args.steps)
    lines = report_lines(row)
    stem.with_suffix(".json").write_text(json.dumps(row, indent=1))
    stem.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if row["compare"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
