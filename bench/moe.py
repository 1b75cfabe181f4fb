"""The MoE layer against a dense SwiGLU MLP of the same active parameters, and where its time
goes: dispatch (permute + unpermute) against the experts' grouped GEMMs.

One process, TP = EP = 1 (so the all-to-all is the identity and dispatch is the local permute
and unpermute only). Forward + backward of each case, round-robin so machine noise hits all
alike; median times as ratios against the dense MLP measured in the same run:
  dense          SwiGLU MLP of width k x f (the baseline: the MoE's active parameters)
  moe            layers/moe.py's MoE layer (router + E experts of width f, top-k), whole
  router         its router alone (gate GEMM, softmax top-k)
  dispatch       permute (gather each token's rows in expert order) + unpermute (weight by the
                 router's probabilities, index_add back into the tokens), no expert between
  experts        the two grouped GEMMs (`grouped_matmul`) and the SwiGLU over the sorted rows
The routing of the timed parts is the MoE layer's own on the same tokens.

    python bench/moe.py [--tokens 2048] [--hidden 512] [--ffn 704] [--experts 8] [--topk 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.config import ModelConfig, MoEConfig
from megatron_lite.kernels.swiglu import swiglu
from megatron_lite.layers.moe import MoE, grouped_matmul, grouped_mm_fits, routed_pairs
from megatron_lite.parallel.state import single_process_state


def _fwd_bwd(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        fn().square().sum().backward()
    return step


def _cases(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """Each case as a forward + backward closure over shared inputs."""
    h, f, k, e, n = args.hidden, args.ffn, args.topk, args.experts, args.tokens
    model = ModelConfig(num_layers=1, hidden_size=h, num_attention_heads=4, ffn_hidden_size=k * f,
                        seq_length=n, vocab_size=256)
    moe_cfg = MoEConfig(num_experts=e, moe_router_topk=k, moe_ffn_hidden_size=f)
    pstate = single_process_state(torch.device("cpu"))
    layer = MoE(model, moe_cfg, pstate, 0, sequence_parallel=False, seed=0, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, h, generator=gen).requires_grad_()
    dense_up = (0.02 * torch.randn(2 * k * f, h, generator=gen)).requires_grad_()
    dense_down = (0.02 * torch.randn(h, k * f, generator=gen)).requires_grad_()

    def dense() -> torch.Tensor:
        gate, up = F.linear(x, dense_up).chunk(2, dim=-1)
        return F.linear(swiglu(gate, up), dense_down)

    with torch.no_grad():
        probs, routing_map = layer.router(x.detach().reshape(n, h), n)
    expert_ids, token_ids = routed_pairs(routing_map)
    counts = routing_map.sum(0)
    weights = probs[token_ids, expert_ids].unsqueeze(-1)
    tokens = x.detach().reshape(n, h).requires_grad_()
    rows = tokens.detach()[token_ids].requires_grad_()
    gate_up, down = layer.expert_weights()

    def dispatch() -> torch.Tensor:
        return torch.zeros_like(tokens).index_add(0, token_ids, tokens[token_ids] * weights)

    def experts() -> torch.Tensor:
        hidden = grouped_matmul(rows, gate_up, counts)
        g, u = hidden.chunk(2, dim=-1)
        return grouped_matmul(swiglu(g, u), down, counts)

    return {"dense": _fwd_bwd(dense), "moe": _fwd_bwd(lambda: layer(x)),
            "router": _fwd_bwd(lambda: layer.router(tokens, n)[0]),
            "dispatch": _fwd_bwd(dispatch), "experts": _fwd_bwd(experts)}


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of each case, round-robin after a warm-up."""
    cases = _cases(args)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(args.repeats + 1):
        for name, step in cases.items():
            start = time.perf_counter()
            step()
            if rep:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=704, help="one expert's SwiGLU width")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", default="bench/results/moe.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    medians = measure(args)
    base = medians["dense"]
    probe = torch.empty(1, args.hidden), torch.empty(1, args.hidden, args.ffn)
    path = "torch._grouped_mm" if grouped_mm_fits(*probe) else "padded_bmm"
    print(f"MoE {args.experts} experts top-{args.topk} (f {args.ffn}) vs dense SwiGLU f "
          f"{args.topk * args.ffn}, {args.tokens} tokens, h {args.hidden}, fp32, CPU "
          f"({torch.get_num_threads()} threads, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '-')}), experts via {path}; forward + backward, "
          f"median of {args.repeats}; ratios to dense")
    print(f"{'case':<10} {'ms':>9} {'x dense':>8}")
    rows = []
    for name, seconds in medians.items():
        rows.append({"case": name, "seconds": seconds, "ratio": seconds / base})
        print(f"{name:<10} {seconds * 1e3:>9.2f} {seconds / base:>8.3f}")
    print(f"dispatch / experts = {medians['dispatch'] / medians['experts']:.3f}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "expert_path": path, "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
