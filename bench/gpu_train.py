"""Single-GPU training speed of megatron_lite against the same Llama in plain PyTorch, and the
planner's memory estimate against what our run really allocates.

    python bench/gpu_train.py --model 1b [--steps 12 --warmup 4 --micro-batch 2] [--out DIR]
    python bench/gpu_train.py --model tiny --device cpu --compile-backend eager   # CPU smoke

Both sides train the same shape on the same mock samples with the same batch, LR schedule,
AdamW settings and gradient clipping, each in its own process (so neither inherits the other's
allocator state or compile caches), ours first:
- ours: `pretrain.py`'s `main` with `--bf16 --triton-kernels on --compile`, run in-process here
  so `torch.cuda.max_memory_allocated()` can be read afterwards; its speed comes from its JSONL log.
- plain PyTorch: `nn.Embedding`, `nn.Linear` (separate q/k/v, gate/up/down), `nn.RMSNorm`,
  rotate-half RoPE, `F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`, SwiGLU,
  tied output layer, `F.cross_entropy`, fused `torch.optim.AdamW`, `clip_grad_norm_`. Precision:
  fp32 weights, gradients and Adam state with bf16 autocast (PyTorch's standard mixed precision;
  ours keeps bf16 weights with fp32 master weights and fp32 gradients). `torch.compile` per
  transformer block and on the head + loss (torchtitan's granularity: identical blocks share
  one compiled graph); the embedding lookup stays eager.
The first `--warmup` steps (compile included) are not measured; every later step is timed from
its start to the loss read back on the host, which waits for the whole step. tokens/s, TFLOP/s
and MFU are medians over the measured steps, with the FLOPs per token of megatron_lite.metrics
and the same peak for both. Writes OUT/gpu_train_MODEL.json and .txt (the summary lines).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_lite.arguments import parse_config  # noqa: E402
from megatron_lite.config import Config, ModelConfig  # noqa: E402
from megatron_lite.data.mock import MockDataset  # noqa: E402
from megatron_lite.metrics import detect_peak_tflops  # noqa: E402
from megatron_lite.optim.lr import step_lrs  # noqa: E402
from megatron_lite.planner import (  # noqa: E402
    ModelShape,
    estimate_memory,
    training_flops_per_token,
)

GIB = 2**30
MODELS: dict[str, list[str]] = {
    # Llama-3.2-1B: 16 layers, width 2048, 32 query / 8 KV heads of 64, SwiGLU 8192, tied
    # 128256 vocabulary. Micro-batch 2 fits an 80 GB GPU on either side with room to spare.
    "1b": ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "32",
           "--num-query-groups", "8", "--ffn-hidden-size", "8192", "--vocab-size", "128256",
           "--seq-length", "4096", "--rotary-base", "500000", "--micro-batch-size", "2"],
    # Llama-3.2-3B: 28 layers, width 3072, 24 query / 8 KV heads of 128. Micro-batch 1: our
    # weights, gradients and Adam state alone take 54 GiB (18 bytes per parameter).
    "3b": ["--num-layers", "28", "--hidden-size", "3072", "--num-attention-heads", "24",
           "--num-query-groups", "8", "--ffn-hidden-size", "8192", "--vocab-size", "128256",
           "--seq-length", "4096", "--rotary-base", "500000", "--micro-batch-size", "1"],
    # CPU smoke size (tests/test_gpu_check_smoke.py).
    "tiny": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--num-query-groups", "2", "--ffn-hidden-size", "128", "--vocab-size", "256",
             "--seq-length", "64", "--micro-batch-size", "2"],
}


# ---------------------------------------------------------------------------------------------
# The plain PyTorch baseline


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on [b, heads, s, d] in fp32 (cos, sin: [s, d/2]), back in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class PlainBlock(nn.Module):
    """A pre-norm Llama block written the obvious way, batch-first."""

    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        h, d, f = m.hidden_size, m.head_dim, m.ffn_hidden_size
        self.heads, self.groups, self.head_dim = m.num_attention_heads, m.num_query_groups, d
        self.attention_norm = nn.RMSNorm(h, eps=m.norm_epsilon)
        self.wq = nn.Linear(h, self.heads * d, bias=False)
        self.wk = nn.Linear(h, self.groups * d, bias=False)
        self.wv = nn.Linear(h, self.groups * d, bias=False)
        self.wo = nn.Linear(self.heads * d, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=m.norm_epsilon)
        self.w_gate = nn.Linear(h, f, bias=False)
        self.w_up = nn.Linear(h, f, bias=False)
        self.w_down = nn.Linear(f, h, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        y = self.attention_norm(x)
        q = self.wq(y).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(y).view(b, s, self.groups, self.head_dim).transpose(1, 2)
        v = self.wv(y).view(b, s, self.groups, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v,
                                             is_causal=True, enable_gqa=True)
        x = x + self.wo(out.transpose(1, 2).reshape(b, s, -1))
        y = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(y)) * self.w_up(y))


class PlainHead(nn.Module):
    """Final norm, the output layer (tied to the embedding) and the mean token loss."""

    def __init__(self, m: ModelConfig, weight: nn.Parameter) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(m.hidden_size, eps=m.norm_epsilon)
        self.weight = weight

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        logits = F.linear(self.norm(x), self.weight)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class PlainLlama(nn.Module):
    """The baseline model; the vocabulary is ours padded (same output-layer FLOPs)."""

    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(m.padded_vocab_size(1), m.hidden_size)
        self.layers = nn.ModuleList(PlainBlock(m) for _ in range(m.num_layers))
        self.head = PlainHead(m, self.embedding.weight)
        inv_freq = m.rotary_base ** (-torch.arange(0, m.head_dim, 2).double() / m.head_dim)
        angles = torch.outer(torch.arange(m.seq_length).double(), inv_freq)
        self.register_buffer("rope_cos", angles.cos().float(), persistent=False)
        self.register_buffer("rope_sin", angles.sin().float(), persistent=False)
        # Our init: N(0, std), output projections std / sqrt(2 layers), norms at one.
        out_std = m.init_method_std / (2 * m.num_layers) ** 0.5
        for name, p in self.named_parameters():
            if p.ndim == 2:
                std = out_std if name.endswith(("wo.weight", "w_down.weight")) else \
                    m.init_method_std
                nn.init.normal_(p, 0.0, std)

    def compile_blocks(self, backend: str) -> None:
        for layer in self.layers:
            layer.compile(backend=backend, fullgraph=True)
        self.head.compile(backend=backend, fullgraph=True)

    def forward(self, tokens: Tensor, labels: Tensor) -> Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.head(x, labels)


def mock_batches(cfg: Config, device: torch.device) -> list[tuple[Tensor, Tensor]]:
    """(tokens, labels) of every step: the samples our loader gives (step k: k*b .. k*b+b-1)."""
    m, t = cfg.model, cfg.train
    data = MockDataset(m.vocab_size, m.seq_length, t.seed, "train")
    b = t.micro_batch_size
    out = []
    for step in range(t.train_iters):
        samples = torch.from_numpy(np.stack([data[step * b + i] for i in range(b)]))
        out.append((samples[:, :-1].to(device), samples[:, 1:].to(device)))
    return out


def train_plain(cfg: Config, device: torch.device, backend: str) -> dict:
    """Train the baseline for --train-iters steps; per-step seconds and losses."""
    o, t = cfg.optim, cfg.train
    if t.global_batch_size not in (None, t.micro_batch_size):
        raise ValueError("the baseline runs one micro-batch per step (no accumulation)")
    torch.manual_seed(t.seed)
    with torch.device(device):
        model = PlainLlama(cfg.model)
    if backend != "none":
        model.compile_blocks(backend)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                            weight_decay=o.weight_decay, fused=True)
    batches = mock_batches(cfg, device)
    times, losses = [], []
    for step, (tokens, labels) in enumerate(batches):
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = step_lrs(step * t.micro_batch_size, t.micro_batch_size, o, t)[0]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.bf16):
            loss = model(tokens, labels)
        loss.backward()
        if o.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, o.clip_grad, foreach=True)
        opt.step()
        losses.append(loss.item())  # waits for the whole step, optimizer included
        times.append(time.perf_counter() - start)
    from torch._dynamo.utils import counters
    return {"step_times_s": times, "losses": losses,
            "compiled_graphs": counters["stats"]["unique_graphs"]}


# ---------------------------------------------------------------------------------------------
# The two child processes


def _guarded(run: Callable[[], int]) -> tuple[int, str | None]:
    """(exit code, error): a failure such as an OOM still leaves numbers worth reporting."""
    try:
        return run(), None
    except Exception as err:
        traceback.print_exc()
        return 1, f"{type(err).__name__}: {str(err)[:500]}"


def child_plain(flags: list[str], result: Path, backend: str, peak: float | None) -> int:
    cfg = parse_config(flags)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    peak_tflops, peak_source = detect_peak_tflops(device, cfg.train, peak)
    record: dict = {}
    start = time.perf_counter()

    def run() -> int:
        record.update(train_plain(cfg, device, backend))
        return 0

    rc, error = _guarded(run)
    record.update(rc=rc, error=error, wall_s=time.perf_counter() - start,
                  peak_tflops=peak_tflops, peak_source=peak_source, compile_backend=backend,
                  **_device_info(device))
    result.write_text(json.dumps(record, indent=1))
    return rc


def child_ours(flags: list[str], result: Path) -> int:
    import pretrain

    cfg = parse_config(flags)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    est = estimate_memory(cfg, world_size=1, stage=0,
                          fused_kernels=cfg.model.triton_kernels == "on", device_type=device_type)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    rc, error = _guarded(lambda: pretrain.main(flags))
    record = {"rc": rc, "error": error, "wall_s": time.perf_counter() - start,
              "planner": {"total_bytes": est.total_bytes, "state_bytes": est.state_bytes,
                          "activation_bytes": est.activation_bytes},
              **_device_info(torch.device(device_type))}
    result.write_text(json.dumps(record, indent=1))
    return rc


def _device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"device": "cpu", "max_memory_allocated": None, "max_memory_reserved": None}
    return {"device": torch.cuda.get_device_name(),
            "max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved()}


# ---------------------------------------------------------------------------------------------
# The parent: run both, compare, report


def run_flags(args: argparse.Namespace) -> list[str]:
    """pretrain.py flags both sides share (the shape, batch, steps, precision, optimizer)."""
    flags = [*MODELS[args.model], "--mock-data", "--bf16", "--train-iters", str(args.steps),
             "--lr", "3e-4", "--lr-warmup-iters", str(args.warmup), "--eval-iters", "0",
             "--log-interval", "1", "--seed", "1"]
    if args.micro_batch:
        flags += ["--micro-batch-size", str(args.micro_batch)]
    micro = parse_config(flags).train.micro_batch_size
    return [*flags, "--global-batch-size", str(micro)]


def _spawn(role: str, result: Path, flags: list[str], device: str, extra: list[str]) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run stays on the CPU even where a GPU exists
    cmd = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--result",
           str(result), *extra, "--", *flags]
    print(f"== gpu_train {role}: {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _speed(tokens_per_sec: list[float], flops: float, peak: float) -> dict:
    tps = statistics.median(tokens_per_sec)
    return {"tokens_per_sec": tps, "tflops_per_device": tps * flops / 1e12,
            "mfu": tps * flops / 1e12 / peak}


def summarize(args: argparse.Namespace, flags: list[str], ours_records: list[dict],
              ours: dict | None, plain: dict | None) -> dict:
    """The comparison as one JSON-able dict (None where a side failed)."""
    cfg = parse_config(flags)
    m, tokens = cfg.model, cfg.train.micro_batch_size * cfg.model.seq_length
    flops = training_flops_per_token(ModelShape.from_config(m), m.seq_length)
    measured = [r for r in ours_records if r["iteration"] > args.warmup]
    row: dict = {"model": args.model, "shape": {k: getattr(m, k) for k in (
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
        "ffn_hidden_size", "vocab_size", "seq_length")},
        "micro_batch": cfg.train.micro_batch_size, "tokens_per_step": tokens,
        "steps": args.steps, "warmup": args.warmup, "flops_per_token": flops,
        "device": (plain or ours or {}).get("device"), "ours": None, "plain": None,
        "ratio": None, "memory": None, "ours_error": None,
        "plain_error": plain["error"] if plain is not None else None}
    ok_ours = ours is not None and ours["rc"] == 0 and len(measured) == args.steps - args.warmup
    if ok_ours:
        peak = measured[0]["tflops_per_device"] / measured[0]["mfu"]
        implied = measured[0]["tflops_per_device"] * 1e12 / measured[0]["tokens_per_sec"]
        row["ours"] = {
            "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in measured),
            "tflops_per_device": statistics.median(r["tflops_per_device"] for r in measured),
            "mfu": statistics.median(r["mfu"] for r in measured),
            "median_step_ms": statistics.median(r["iter_time_ms"] for r in measured),
            "first_step_s": ours_records[0]["iter_time_ms"] / 1e3, "wall_s": ours["wall_s"],
            "peak_tflops": peak, "same_flop_formula": abs(implied / flops - 1) < 1e-6,
            "losses": [r["loss"] for r in ours_records], "compiled": args.compile_backend ==
            "inductor", "max_memory_allocated": ours["max_memory_allocated"]}
    else:
        row["ours_error"] = "no result: the process died" if ours is None else (
            ours["error"] or f"exit {ours['rc']}, {len(ours_records)}/{args.steps} steps logged")
    if plain is not None and plain["rc"] == 0:
        times = plain["step_times_s"][args.warmup:]
        row["plain"] = {**_speed([tokens / s for s in times], flops, plain["peak_tflops"]),
                        "median_step_ms": statistics.median(times) * 1e3,
                        "first_step_s": plain["step_times_s"][0], "wall_s": plain["wall_s"],
                        "peak_tflops": plain["peak_tflops"], "losses": plain["losses"],
                        "compile_backend": plain["compile_backend"],
                        "compiled_graphs": plain["compiled_graphs"],
                        "max_memory_allocated": plain["max_memory_allocated"]}
    if row["ours"] and row["plain"]:
        row["ratio"] = row["ours"]["tokens_per_sec"] / row["plain"]["tokens_per_sec"]
    if ours is not None:
        row["memory"] = _memory(ours)
    return row


def _memory(ours: dict) -> dict:
    """Planner bytes next to the measured peak (None on CPU, which has no allocator peak)."""
    plan = ours["planner"]
    measured = ours["max_memory_allocated"]
    out = {**plan, "max_memory_allocated": measured,
           "max_memory_reserved": ours["max_memory_reserved"], "planner_over_measured": None,
           "measured_minus_planner_state": None, "planner_activation_over_that": None}
    if measured:
        rest = measured - plan["state_bytes"]
        out.update(planner_over_measured=plan["total_bytes"] / measured,
                   measured_minus_planner_state=rest,
                   planner_activation_over_that=plan["activation_bytes"] / rest if rest > 0
                   else None)
    return out


def _gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f} GiB"


def _side(name: str, side: dict | None, error: str | None = None) -> str:
    if side is None:
        return f"{name} FAILED ({error})" if error else f"{name} did not finish (see the log)"
    return (f"{name} {side['tokens_per_sec']:,.0f} tok/s ({side['tflops_per_device']:.4g} "
            f"TFLOP/s, MFU {100 * side['mfu']:.1f}%)")


def report_lines(row: dict) -> list[str]:
    """The summary lines (also written to OUT/gpu_train_MODEL.txt)."""
    s, ours, plain = row["shape"], row["ours"], row["plain"]
    lines = [f"{row['model']} on {row['device']}: {s['num_layers']} layers, h {s['hidden_size']},"
             f" {s['num_attention_heads']}/{s['num_query_groups']} heads, ffn "
             f"{s['ffn_hidden_size']}, vocab {s['vocab_size']}, seq {s['seq_length']}, "
             f"micro-batch {row['micro_batch']} = {row['tokens_per_step']} tokens/step, bf16; "
             f"medians of steps {row['warmup'] + 1}-{row['steps']}; "
             f"{row['flops_per_token'] / 1e9:.3f} GFLOP/token (6N + 12lhs)"]
    ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.3f}"
    sides = (_side("ours", ours, row["ours_error"]),
             _side("plain PyTorch", plain, row["plain_error"]))
    lines.append(f"  {sides[0]}, {sides[1]}, ratio {ratio}")
    lines.append(f"  {'':<13} {'tok/s':>10} {'TFLOP/s':>9} {'MFU':>6} {'step ms':>8} "
                 f"{'1st step s':>10} {'process s':>9} {'max alloc GiB':>13}  loss first -> last")
    for name, side in (("ours", ours), ("plain PyTorch", plain)):
        if side is not None:
            mem = side["max_memory_allocated"]
            alloc = "n/a" if mem is None else f"{mem / GIB:.2f}"
            lines.append(f"  {name:<13} {side['tokens_per_sec']:>10,.0f} "
                         f"{side['tflops_per_device']:>9.4g} {100 * side['mfu']:>5.1f}% "
                         f"{side['median_step_ms']:>8.1f} {side['first_step_s']:>10.1f} "
                         f"{side['wall_s']:>9.0f} {alloc:>13}  {side['losses'][0]:.4f} -> "
                         f"{side['losses'][-1]:.4f}")
    if ours is not None and not ours["same_flop_formula"]:
        lines.append("  WARNING: our JSONL's FLOPs per token differ from megatron_lite.metrics'")
    if plain is not None:
        lines.append(f"  plain: fp32 weights with bf16 autocast, fused AdamW; torch.compile "
                     f"({plain['compile_backend']}) per block and on the head: "
                     f"{plain['compiled_graphs']} graph(s) for {s['num_layers']} blocks + head")
    mem = row["memory"]
    if mem is not None:
        line = (f"  memory: planner total {_gib(mem['total_bytes'])} (state "
                f"{_gib(mem['state_bytes'])} + activations {_gib(mem['activation_bytes'])}) vs "
                f"max_memory_allocated {_gib(mem['max_memory_allocated'])} (reserved "
                f"{_gib(mem['max_memory_reserved'])})")
        if mem["planner_over_measured"] is not None:
            line += f": planner/measured {mem['planner_over_measured']:.3f}"
        if mem["planner_activation_over_that"] is not None:
            line += (f"; measured - planner state = {_gib(mem['measured_minus_planner_state'])}"
                     f", planner activations / that {mem['planner_activation_over_that']:.3f}")
        lines.append(line)
    return lines


EXIT_SKIPPED = 3
"""Exit status of a benchmark that measured nothing (scripts/gpu_check.sh fails the part)."""


def runnable(parser: argparse.ArgumentParser, args: argparse.Namespace, script: str) -> bool:
    """False, saying so on a `SKIPPED:` line, on a CUDA run without a GPU (the caller exits
    EXIT_SKIPPED: nothing measured is never a pass); a --warmup not below --steps is a usage
    error (bench/gpu_fp8.py shares this)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"SKIPPED: {script} needs a CUDA GPU (or --device cpu --model tiny); nothing run")
        return False
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 0 and below --steps")
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="1b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=12, help="training steps per side")
    parser.add_argument("--warmup", type=int, default=4, help="first steps not measured")
    parser.add_argument("--micro-batch", type=int, default=None, help="override the model's")
    parser.add_argument("--compile-backend", choices=("inductor", "eager", "none"),
                        default="inductor", help="plain side's torch.compile backend; ours "
                        "runs --compile only with inductor (the CPU smoke test uses eager)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--role", choices=("ours", "plain"), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--peak-tflops", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "ours":
        return child_ours(flags, args.result)
    if args.role == "plain":
        return child_plain(flags, args.result, args.compile_backend, args.peak_tflops)
    if not runnable(parser, args, "bench/gpu_train.py"):
        return EXIT_SKIPPED
    args.out.mkdir(parents=True, exist_ok=True)
    flags = run_flags(args)
    stem = args.out / f"gpu_train_{args.model}"
    jsonl = stem.with_suffix(".ours.jsonl")
    for stale in (jsonl, stem.with_suffix(".ours.json"), stem.with_suffix(".plain.json")):
        stale.unlink(missing_ok=True)  # the logger appends; a crashed child writes nothing
    ours_flags = [*flags, "--triton-kernels", "on" if args.device == "cuda" else "off",
                  "--log-jsonl", str(jsonl)]
    if args.compile_backend == "inductor":
        ours_flags.append("--compile")
    rc_ours = _spawn("ours", stem.with_suffix(".ours.json"), ours_flags, args.device, [])
    ours_records = [r for r in map(json.loads, jsonl.read_text().splitlines())
                    if "loss" in r] if jsonl.exists() else []
    write_report(stem, summarize(args, flags, ours_records,
                                 _read_json(stem.with_suffix(".ours.json")), None), quiet=True)
    peak = ours_records[0]["tflops_per_device"] / ours_records[0]["mfu"] if ours_records \
        else None  # both sides divide by the same peak
    extra = ["--compile-backend", args.compile_backend]
    if peak:
        extra += ["--peak-tflops", repr(peak)]
    rc_plain = _spawn("plain", stem.with_suffix(".plain.json"), flags, args.device, extra)
    row = summarize(args, flags, ours_records, _read_json(stem.with_suffix(".ours.json")),
                    _read_json(stem.with_suffix(".plain.json")))
    write_report(stem, row)
    return 0 if rc_ours == rc_plain == 0 and row["ours"] and row["plain"] else 1


def write_report(stem: Path, row: dict, quiet: bool = False) -> None:
    """STEM.json and STEM.txt; written once ours is done too, so a run cut off during the
    baseline still leaves our numbers."""
    stem.with_suffix(".json").write_text(json.dumps(row, indent=1))
    lines = report_lines(row)
    stem.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    if not quiet:
        print("\n".join(lines) + f"\nwrote {stem.with_suffix('.json')} and .txt", flush=True)


if __name__ == "__main__":
    sys.exit(main())
