"""Benchmark the Triton kernels against eager PyTorch and torch.compile of the same reference.

    python bench/kernels.py [--dtype bf16] [--tokens 8192]

Shapes are Llama-3-8B's (hidden 4096, 32 query / 8 KV heads of 128, ffn 14336, vocab 128256),
forward + backward each, timed with triton.testing.do_bench (median). Achieved GB/s counts the
bytes a kernel must move at minimum (inputs read once, outputs written once) and is set against
the device's copy bandwidth measured in the same run (a device-to-device clone). "peak GiB" is
the memory a step allocates beyond its inputs. Writes bench/results/kernels.json. Without CUDA
it says so and exits 0; tests/kernels/test_bench_smoke.py runs the same steps on CPU at tiny
sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_lite.kernels import (  # noqa: E402
    apply_rotary,
    rms_norm_residual,
    rope_tables,
    swiglu,
    vocab_parallel_cross_entropy,
)
from megatron_lite.kernels.rmsnorm import rms_norm_reference  # noqa: E402
from megatron_lite.kernels.rope import apply_rotary_reference  # noqa: E402
from megatron_lite.kernels.swiglu import swiglu_reference  # noqa: E402

LLAMA3_8B = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "ffn": 14336,
             "vocab": 128256}


class _Sink(torch.autograd.Function):
    """Identity whose backward drops the gradient, so a timed step is the op's own forward and
    backward, without accumulating its input gradients into `.grad` (an extra pass that no
    training step pays: there the gradients flow on into the previous layer)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.detach()  # same storage; not an autograd view (one may be overwritten)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> None:
        return None


_sink = _Sink.apply


def _copy_bandwidth(do_bench) -> float:
    """GB/s of a 1 GiB device-to-device clone (read + write counted)."""
    x = torch.empty(2**28, device="cuda", dtype=torch.float32)
    ms = do_bench(lambda: x.clone(), return_mode="median")
    return 2 * x.numel() * 4 / ms / 1e6


Rand = Callable[..., torch.Tensor]
"""rand(*shape, grad=True): a seeded random input, a leaf that takes gradients unless grad=False."""
Case = tuple[str, int, Callable[[str], Callable[[], None]]]
"""(name, bytes moved fwd+bwd, make(impl) -> step)."""


def cases(tokens: int, dtype: torch.dtype, device: str = "cuda", dims: dict = LLAMA3_8B
          ) -> tuple[list[Case], int]:
    """One case per kernel (impl of make: triton/eager/compile), and the cross-entropy's logit
    count (its token count is capped, so the caller can report the size it timed).

    Bytes are the least any implementation must move: every input read once, every output
    written once (tables, weights and per-row statistics are negligible and not counted).
    The inputs come from one seeded generator, drawn in case order.
    """
    e = torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int, grad: bool = True) -> torch.Tensor:
        t = torch.randn(*shape, device=device, dtype=dtype, generator=g)
        return t.requires_grad_() if grad else t

    ce_tokens = min(tokens, 4096)
    return [_rms_case(tokens, dims, rand, e), _rope_case(tokens, dims, rand, e, device),
            _swiglu_case(tokens, dims, rand, e),
            _cross_entropy_case(ce_tokens, dims, rand, e, g)], ce_tokens * dims["vocab"]


def _rms_case(tokens: int, dims: dict, rand: Rand, e: int) -> Case:
    """RMSNorm fused with the residual add, as each layer's two norms run."""
    h = dims["hidden"]
    x, r, w, dy = rand(tokens, h), rand(tokens, h), rand(h), rand(tokens, h, grad=False)

    def ref(a, b, c):
        s = a + b
        return rms_norm_reference(s, c, 1e-5), s

    def make(impl: str) -> Callable[[], None]:
        f = {"triton": lambda a, b, c: rms_norm_residual(a, b, c, 1e-5, use_triton=True),
             "eager": ref, "compile": torch.compile(ref) if impl == "compile" else None}[impl]
        return lambda: torch.autograd.backward(f(_sink(x), _sink(r), _sink(w)), [dy, dy])

    # fwd: read x, r; write y, s. bwd: read dy, ds, s; write dx (= d residual).
    return "rmsnorm+residual", e * 8 * tokens * h, make


def _rope_case(tokens: int, dims: dict, rand: Rand, e: int, device: str) -> Case:
    """Rotary embedding of q and k ([s, b, heads, head_dim], b = 2 when tokens allow)."""
    s, b, hd = max(1, tokens // 2), 2 if tokens > 1 else 1, dims["head_dim"]
    q, k = rand(s, b, dims["heads"], hd), rand(s, b, dims["kv_heads"], hd)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    cos, sin = rope_tables(s, hd, 500000.0, device)

    def ref(a, c):
        return apply_rotary_reference(a, c, cos, sin)

    def make(impl: str) -> Callable[[], None]:
        f = {"triton": lambda a, c: apply_rotary(a, c, cos, sin, use_triton=True),
             "eager": ref, "compile": torch.compile(ref) if impl == "compile" else None}[impl]
        return lambda: torch.autograd.backward(f(_sink(q), _sink(k)), [dq, dk])

    # fwd: read q, k; write both. bwd: the same again.
    return "rope", e * 4 * (q.numel() + k.numel()), make


def _swiglu_case(tokens: int, dims: dict, rand: Rand, e: int) -> Case:
    """SwiGLU of the MLP's gate and up projections."""
    ffn = dims["ffn"]
    gate, up, dys = rand(tokens, ffn), rand(tokens, ffn), rand(tokens, ffn, grad=False)

    def make(impl: str) -> Callable[[], None]:
        f = {"triton": lambda a, c: swiglu(a, c, use_triton=True), "eager": swiglu_reference,
             "compile": torch.compile(swiglu_reference) if impl == "compile" else None}[impl]
        return lambda: f(_sink(gate), _sink(up)).backward(dys)

    # fwd: read gate, up; write y. bwd: read dy, gate, up; write d_gate, d_up.
    return "swiglu", e * 8 * tokens * ffn, make


def _cross_entropy_case(ce_tokens: int, dims: dict, rand: Rand, e: int,
                        g: torch.Generator) -> Case:
    """Cross-entropy over the whole vocabulary (one TP rank), against float32 eager."""
    vocab = dims["vocab"]
    logits = rand(ce_tokens, vocab)
    target = torch.randint(0, vocab, (ce_tokens,), device=logits.device, generator=g)

    def eager_ce(z, t):
        return torch.nn.functional.cross_entropy(z.float(), t, reduction="none")

    def make(impl: str) -> Callable[[], None]:
        if impl == "triton":  # the gradient overwrites the logits: later steps reuse the buffer
            return lambda: vocab_parallel_cross_entropy(
                _sink(logits), target, 0, vocab, use_triton=True, inplace_backward=True
            ).sum().backward()
        f = eager_ce if impl == "eager" else torch.compile(eager_ce)
        return lambda: f(_sink(logits), target).sum().backward()

    # read the logits, write their gradient (ours moves 5 passes: stats, softmax - onehot,
    # then the dL/dloss scale in backward)
    return "cross_entropy", e * 2 * ce_tokens * vocab, make


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU (the Triton kernels are timed on device); "
              "none found, nothing measured.")
        return 0
    from triton.testing import do_bench

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    copy_gbs = _copy_bandwidth(do_bench)
    device = torch.cuda.get_device_name()
    print(f"{device}, {args.dtype}, {args.tokens} tokens; copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'kernel (fwd+bwd)':<18}{'triton ms':>10}{'eager ms':>10}{'compile ms':>11}"
          f"{'x eager':>9}{'x compile':>10}{'GB/s':>8}{'% copy':>8}{'peak GiB':>9}")
    rows = []
    specs, ce_elements = cases(args.tokens, dtype)
    for name, nbytes, make in specs:
        ms, peak = {}, {}
        for impl in ("triton", "eager", "compile"):
            step = make(impl)
            step()  # compiles (Triton, Inductor) outside the timing
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak[impl] = torch.cuda.max_memory_allocated() - base
            ms[impl] = do_bench(step, return_mode="median")
        gbs = nbytes / ms["triton"] / 1e6
        row = dict(kernel=name, **{f"{k}_ms": v for k, v in ms.items()},
                   **{f"{k}_peak_gib": v / 2**30 for k, v in peak.items()},
                   speedup_eager=ms["eager"] / ms["triton"],
                   speedup_compile=ms["compile"] / ms["triton"], gbs=gbs,
                   frac_copy=gbs / copy_gbs)
        if name == "cross_entropy":  # the memory target: no extra vocab-sized fp32
            row["peak_in_fp32_logit_tensors"] = peak["triton"] / (4 * ce_elements)
        rows.append(row)
        print(f"{name:<18}{ms['triton']:>10.3f}{ms['eager']:>10.3f}{ms['compile']:>11.3f}"
              f"{row['speedup_eager']:>9.2f}{row['speedup_compile']:>10.2f}{gbs:>8.0f}"
              f"{100 * row['frac_copy']:>7.0f}%{peak['triton'] / 2**30:>9.2f}")
    out = ROOT / "bench" / "results" / "kernels.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=device, dtype=args.dtype, tokens=args.tokens,
                                   copy_gbs=copy_gbs, rows=rows), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
