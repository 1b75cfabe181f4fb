"""Training throughput of megatron_lite at TP=1 against a plain PyTorch Llama in the same run.

The reference is the same architecture written the obvious way from nn.Linear / nn.Embedding
(fused QKV, SwiGLU, RMSNorm, SDPA, tied embeddings, F.cross_entropy, torch.optim.AdamW).
Both run the same number of full training steps (forward, backward, clip, AdamW) on the same
batch shapes; runs are interleaved (ours, reference, ours, ...) so machine noise hits both,
and the ratio of median per-step times is reported (this VM has 1-2 s host stalls that a
mean would absorb). Target: ratio >= 0.97 (<= 3% overhead).

    python bench/model_overhead.py [--steps 30] [--repeats 5] [--config small|medium]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.config import Config, ModelConfig, OptimConfig, TrainConfig
from megatron_lite.data.loader import MicroBatchLoader
from megatron_lite.data.mock import MockDataset
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel.state import single_process_state
from megatron_lite.training import StepRunner, build_model, train_step

CONFIGS = {
    # nanoGPT's Shakespeare-char size (ANCHORS.md), and a wider one where matmuls dominate.
    "small": dict(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512,
                  seq_length=64, vocab_size=65, micro_batch_size=12),
    "medium": dict(num_layers=4, hidden_size=384, num_attention_heads=6, ffn_hidden_size=1024,
                   seq_length=256, vocab_size=4096, micro_batch_size=4),
}


class RefLayer(nn.Module):
    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        d = m.head_dim
        self.heads, self.d = m.num_attention_heads, d
        self.norm1, self.norm2 = nn.RMSNorm(m.hidden_size), nn.RMSNorm(m.hidden_size)
        self.qkv = nn.Linear(m.hidden_size, 3 * m.hidden_size, bias=False)
        self.proj = nn.Linear(m.hidden_size, m.hidden_size, bias=False)
        self.w_gate = nn.Linear(m.hidden_size, m.ffn_hidden_size, bias=False)
        self.w_up = nn.Linear(m.hidden_size, m.ffn_hidden_size, bias=False)
        self.w_down = nn.Linear(m.ffn_hidden_size, m.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, self.d).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))
        y = self.norm2(x)
        return x + self.w_down(F.silu(self.w_gate(y)) * self.w_up(y))


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RefModel(nn.Module):
    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(m.vocab_size, m.hidden_size)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.layers = nn.ModuleList(RefLayer(m) for _ in range(m.num_layers))
        self.norm = nn.RMSNorm(m.hidden_size)
        inv = 1.0 / m.rotary_base ** (torch.arange(0, m.head_dim, 2).float() / m.head_dim)
        freqs = torch.outer(torch.arange(m.seq_length).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, tokens: Tensor, labels: Tensor) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        logits = F.linear(self.norm(x), self.embed.weight)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _config(name: str) -> Config:
    spec = dict(CONFIGS[name])
    mbs = spec.pop("micro_batch_size")
    return Config(model=ModelConfig(**spec, make_vocab_size_divisible_by=1),
                  optim=OptimConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0),
                  train=TrainConfig(micro_batch_size=mbs, seed=0))


def _time_ours(cfg: Config, steps: int) -> list[float]:
    ps = single_process_state()
    chunks = build_model(cfg, ps)
    opt = Optimizer(cfg, chunks, ps)
    loader = MicroBatchLoader(MockDataset(cfg.model.vocab_size, cfg.model.seq_length, 0),
                              micro_batch_size=cfg.train.micro_batch_size,
                              global_batch_size=cfg.train.micro_batch_size, dp_rank=0, dp_size=1)
    runner = StepRunner(cfg, ps, chunks)
    train_step(runner, opt, loader, ps, 1e-3)  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train_step(runner, opt, loader, ps, 1e-3)
        times.append(time.perf_counter() - start)
    return times


def _time_reference(cfg: Config, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = RefModel(cfg.model)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}], lr=1e-3)
    data = MockDataset(cfg.model.vocab_size, cfg.model.seq_length, 0)
    mbs = cfg.train.micro_batch_size

    def step(i: int) -> None:
        batch = torch.from_numpy(np.stack([data[i * mbs + j] for j in range(mbs)]))
        opt.zero_grad(set_to_none=True)
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()

    step(0)
    times = []
    for i in range(steps):
        start = time.perf_counter()
        step(i + 1)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--config", choices=sorted(CONFIGS), nargs="*",
                        default=sorted(CONFIGS, reverse=True))
    parser.add_argument("--output", default="bench/results/model_overhead.json")
    args = parser.parse_args()
    rows = []
    for name in args.config:
        cfg = _config(name)
        ours, ref = [], []
        for _ in range(args.repeats):  # interleaved; per-step medians ignore host stalls
            ours += _time_ours(cfg, args.steps)
            ref += _time_reference(cfg, args.steps)
        tokens = cfg.train.micro_batch_size * cfg.model.seq_length
        row = {"config": name, "tokens_per_step": tokens,
               "ours_tok_s": tokens / statistics.median(ours),
               "reference_tok_s": tokens / statistics.median(ref)}
        row["ratio"] = row["ours_tok_s"] / row["reference_tok_s"]
        rows.append(row)
    print(f"{'config':<8} {'tokens/step':>11} {'ours tok/s':>11} {'plain tok/s':>11} "
          f"{'ratio':>6}  (target >= 0.97)")
    for r in rows:
        print(f"{r['config']:<8} {r['tokens_per_step']:>11} {r['ours_tok_s']:>11,.0f} "
              f"{r['reference_tok_s']:>11,.0f} {r['ratio']:>6.3f}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
