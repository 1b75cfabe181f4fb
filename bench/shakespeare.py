"""Training tokens/s of the nanoGPT Shakespeare-char configuration: eager/compiled x fp32/bf16.

The configuration is the one `scripts/shakespeare_char_cpu.sh` trains (4 layers, 4 heads,
width 128, context 64, micro-batch 12, the char tokenizer's 324-token vocabulary). Every
setting runs full training steps (forward, backward, clip, AdamW, the logged loss and grad
norm) on mock batches of that shape. The baseline is the plain-PyTorch reference model of
bench/model_overhead.py (nn.Linear, F.cross_entropy, torch.optim.AdamW) in fp32 eager mode,
measured in the same run.

The machine is shared and noisy, so settings are interleaved: each round times `--steps`
steps of every setting (the order rotates every round) and a setting's time is the median of
all its per-step times. Compilation and warm-up happen once per setting, before the rounds,
and are reported separately.

    python bench/shakespeare.py [--steps 20] [--repeats 5] [--threads N] [--settings ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.model_overhead import RefModel  # noqa: E402
from megatron_lite.config import Config, ModelConfig, OptimConfig, TrainConfig  # noqa: E402
from megatron_lite.data.loader import MicroBatchLoader  # noqa: E402
from megatron_lite.data.mock import MockDataset  # noqa: E402
from megatron_lite.optim.optimizer import Optimizer  # noqa: E402
from megatron_lite.parallel.state import single_process_state  # noqa: E402
from megatron_lite.training import StepRunner, build_model, train_step  # noqa: E402

VOCAB = 324
"""The char tokenizer's vocabulary: 4 special ids + 256 byte-fallback pieces + 64 characters."""

BASELINE = "reference fp32 eager"
SETTINGS = {
    # name: (ours?, bf16, compile)
    BASELINE: (False, False, False),
    "reference fp32 compiled": (False, False, True),
    "ours fp32 eager": (True, False, False),
    "ours bf16 eager": (True, True, False),
    "ours fp32 compiled": (True, False, True),
    "ours bf16 compiled": (True, True, True),
}
DEFAULT_SETTINGS = [BASELINE, "ours fp32 eager", "ours bf16 eager", "ours fp32 compiled",
                    "ours bf16 compiled"]


def shakespeare_config(*, bf16: bool = False, compile: bool = False) -> Config:
    """The nanoGPT CPU Shakespeare-char run in our terms (see scripts/shakespeare_char_cpu.sh)."""
    return Config(
        model=ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=64,
                          vocab_size=VOCAB),
        optim=OptimConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=100, weight_decay=0.1,
                          adam_beta2=0.99),
        train=TrainConfig(micro_batch_size=12, seed=1337, bf16=bf16, compile=compile))


def ours_step(bf16: bool, compile: bool) -> Callable[[], None]:
    cfg = shakespeare_config(bf16=bf16, compile=compile)
    ps = single_process_state()
    chunks = build_model(cfg, ps)
    opt = Optimizer(cfg, chunks, ps)
    mbs = cfg.train.micro_batch_size
    loader = MicroBatchLoader(MockDataset(VOCAB, cfg.model.seq_length, 0),
                              micro_batch_size=mbs, global_batch_size=mbs, dp_rank=0, dp_size=1)
    runner = StepRunner(cfg, ps, chunks)
    return lambda: train_step(runner, opt, loader, ps, cfg.optim.lr)


def reference_step(compile: bool) -> Callable[[], None]:
    """The plain model's step: same work as ours (clip, AdamW, loss and norm read back)."""
    cfg = shakespeare_config()
    torch.manual_seed(0)
    model = RefModel(cfg.model)
    if compile:
        model.compile()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.99))
    data = MockDataset(VOCAB, cfg.model.seq_length, 0)
    mbs = cfg.train.micro_batch_size
    counter = iter(range(2**62))

    def step() -> None:
        i = next(counter)
        batch = torch.from_numpy(np.stack([data[i * mbs + j] for j in range(mbs)]))
        opt.zero_grad(set_to_none=True)
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item(), norm.item()

    return step


def make_step(name: str) -> Callable[[], None]:
    ours, bf16, compile = SETTINGS[name]
    return ours_step(bf16, compile) if ours else reference_step(compile)


def measure(names: list[str], steps: int, repeats: int, warmup: int) -> list[dict]:
    fns, setup_s = {}, {}
    for name in names:
        start = time.perf_counter()
        fns[name] = make_step(name)
        for _ in range(warmup):
            fns[name]()
        setup_s[name] = time.perf_counter() - start
        print(f"  {name}: built and warmed up in {setup_s[name]:.1f} s", flush=True)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(steps):
                start = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - start)
    tokens = 12 * 64
    rows = [{"setting": n, "median_ms": 1e3 * statistics.median(times[n]),
             "tok_s": tokens / statistics.median(times[n]), "setup_s": setup_s[n],
             "steps_timed": len(times[n])} for n in names]
    base = next((r["tok_s"] for r in rows if r["setting"] == BASELINE), None)
    for row in rows:
        row["vs_reference"] = row["tok_s"] / base if base else None
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per setting per round")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps (compile) first")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=DEFAULT_SETTINGS)
    parser.add_argument("--output", default=str(ROOT / "bench/results/shakespeare.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"Shakespeare-char config, {args.threads} threads, {args.repeats} rounds x "
          f"{args.steps} steps per setting", flush=True)
    rows = measure(args.settings, args.steps, args.repeats, args.warmup)
    print(f"{'setting':<26} {'median ms/step':>14} {'tok/s':>8} {'x reference':>11} "
          f"{'setup s':>8}   (target: best >= 2.0x {BASELINE})")
    for r in rows:
        ratio = f"{r['vs_reference']:.2f}" if r["vs_reference"] else "-"
        print(f"{r['setting']:<26} {r['median_ms']:>14.2f} {r['tok_s']:>8,.0f} {ratio:>11} "
              f"{r['setup_s']:>8.1f}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "torch": torch.__version__,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
