"""FLOP counting, MFU, the per-step log line, the JSONL record and wandb.

FLOPs per token follow the PaLM / nanoGPT / torchtitan convention used for the headline MFU:
6 x (matmul weights, including the output layer; the embedding lookup is not a matmul) plus
12 * layers * hidden * seq for attention scores and values counted as if not causal. The causal
variant (Megatron since 2025: attention term halved) is printed beside it. Activation
recomputation is never counted: MFU measures useful work only.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import IO, Any

import torch

from megatron_lite.config import Config, ModelConfig

# Dense bf16 peak TFLOP/s by device-name fragment (first match wins).
PEAK_TFLOPS = (("H200", 989.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0),
               ("A10G", 125.0), ("V100", 125.0))
JSONL_TRAIN_KEYS = ("iteration", "consumed_samples", "loss", "lr", "grad_norm", "iter_time_ms",
                    "tokens_per_sec", "tflops_per_device", "mfu")


def matmul_params(m: ModelConfig) -> int:
    """Weights that take part in a matmul per token (the N of 6N)."""
    d = m.head_dim
    attn = m.hidden_size * (m.num_attention_heads + 2 * m.num_query_groups) * d
    attn += m.num_attention_heads * d * m.hidden_size
    mlp = 3 * m.hidden_size * m.ffn_hidden_size
    return m.num_layers * (attn + mlp) + m.padded_vocab_size(1) * m.hidden_size


def flops_per_token(m: ModelConfig, seq_length: int | None = None, causal: bool = False
                    ) -> float:
    """Training FLOPs per token (forward + backward = 3x forward)."""
    s = seq_length or m.seq_length
    attention = (6 if causal else 12) * m.num_layers * m.hidden_size * s
    return 6.0 * matmul_params(m) + attention


def measure_cpu_peak_tflops(n: int = 1024, seconds: float = 0.3) -> float:
    """Achievable bf16 matmul TFLOP/s of this CPU, the MFU denominator when no GPU is present."""
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    a @ b  # warm-up (oneDNN kernel selection)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


def detect_peak_tflops(device: torch.device, given: float | None) -> tuple[float, str]:
    """(peak TFLOP/s, where it came from)."""
    if given:
        return given, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, peak in PEAK_TFLOPS:
            if fragment in name:
                return peak, f"table ({name})"
        return 989.0, f"unknown GPU {name!r}: assuming 989; pass --peak-tflops"
    return measure_cpu_peak_tflops(), "measured bf16 matmul on this CPU"


def memory_gib(device: torch.device) -> float:
    """Peak allocated GiB on CUDA, or the process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        return float("nan")


class MetricsLogger:
    """Prints the step line and writes JSONL / wandb on the one logging rank."""

    def __init__(self, cfg: Config, *, enabled: bool, world_size: int, peak_tflops: float,
                 device: torch.device) -> None:
        self.cfg, self.enabled, self.world_size = cfg, enabled, world_size
        self.peak_tflops, self.device = peak_tflops, device
        self.flops_per_token = flops_per_token(cfg.model)
        self.jsonl: IO[str] | None = None
        self.wandb: Any = None
        if enabled and cfg.logging.log_jsonl:
            Path(cfg.logging.log_jsonl).parent.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(cfg.logging.log_jsonl, "a", buffering=1)  # noqa: SIM115
        if enabled and cfg.logging.wandb_project and cfg.logging.wandb_mode != "disabled":
            self.wandb = _init_wandb(cfg)

    def _write(self, record: dict, step: int) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "iteration"}, step=step)

    def log_train(self, *, iteration: int, consumed_samples: int, loss: float, lr: float,
                  grad_norm: float, iter_time_s: float, tokens: int, skipped: int) -> dict:
        tokens_per_sec = tokens / iter_time_s
        tflops = tokens_per_sec * self.flops_per_token / self.world_size / 1e12
        record = {"iteration": iteration, "consumed_samples": consumed_samples, "loss": loss,
                  "lr": lr, "grad_norm": grad_norm, "iter_time_ms": iter_time_s * 1e3,
                  "tokens_per_sec": tokens_per_sec, "tflops_per_device": tflops,
                  "mfu": tflops / self.peak_tflops}
        if self.enabled:
            print(f"iter {iteration:>6}/{self.cfg.train.train_iters} | loss {loss:.4f} | "
                  f"lr {lr:.3e} | grad norm {grad_norm:.3f} | {iter_time_s * 1e3:.1f} ms | "
                  f"{tokens_per_sec:,.0f} tok/s | {tflops:.3f} TFLOP/s/dev | "
                  f"MFU {100 * record['mfu']:.2f}% | skipped {skipped} | "
                  f"mem {memory_gib(self.device):.2f} GiB", flush=True)
            self._write(record, iteration)
        return record

    def log_eval(self, iteration: int, eval_loss: float) -> None:
        if not self.enabled:
            return
        ppl = math.exp(min(eval_loss, 50.0))
        print(f"eval at iter {iteration} | eval loss {eval_loss:.4f} | eval ppl {ppl:.3f}",
              flush=True)
        self._write({"iteration": iteration, "eval_loss": eval_loss, "eval_ppl": ppl},
                    iteration)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()


def _init_wandb(cfg: Config) -> Any:
    import wandb  # lazy: wandb's import is slow and only the logging rank needs it

    mode = cfg.logging.wandb_mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    run = wandb.init(project=cfg.logging.wandb_project, name=cfg.logging.wandb_exp_name,
                     dir=cfg.logging.wandb_save_dir, mode=mode, config=cfg.to_dict())
    if mode == "offline":
        print(f"wandb: no WANDB_API_KEY, logging offline to {run.dir}; upload later with "
              f"`wandb sync {Path(run.dir).parent}`", flush=True)
    return run
