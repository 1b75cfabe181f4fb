"""Benchmark the Triton kernels against eager PyTorch and torch.compile of the same reference.

    python bench/kernels.py [--dtype bf16] [--tokens 8192]

Shapes are Llama-3-8B's (hidden 4096, 32 query / 8 KV heads of 128, ffn 14336, vocab 128256),
forward + backward each, timed with triton.testing.do_bench (median). Achieved GB/s counts the
bytes a kernel must move at minimum (inputs read once, outputs written once) and is set against
the device's copy bandwidth measured in the same run (a device-to-device clone). Writes
bench/results/kernels.json. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
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


def _copy_bandwidth(do_bench) -> float:
    """GB/s of a 1 GiB device-to-device clone (read + write counted)."""
    x = torch.empty(2**28, device="cuda", dtype=torch.float32)
    ms = do_bench(lambda: x.clone())
    return 2 * x.numel() * 4 / ms / 1e6


def _cases(tokens: int, dtype: torch.dtype):
    """(name, bytes moved fwd+bwd, make_fn(impl) -> callable) per kernel; impl in triton/eager."""
    dev, h, e = "cuda", 4096, torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=g).requires_grad_()

    x, r, w = rand(tokens, h), rand(tokens, h), rand(h)
    dy = torch.randn(tokens, h, device=dev, dtype=dtype)

    def rms(impl):
        def ref(a, b, c):
            s = a + b
            return rms_norm_reference(s, c, 1e-5), s
        f = {"triton": lambda a, b, c: rms_norm_residual(a, b, c, 1e-5, use_triton=True),
             "eager": ref, "compile": torch.compile(ref)}[impl]
        return lambda: torch.autograd.backward(f(x, r, w), [dy, dy])

    s, b = tokens // 2, 2
    q, k = rand(s, b, 32, 128), rand(s, b, 8, 128)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    cos, sin = rope_tables(s, 128, 500000.0, dev)

    def rope(impl):
        f = {"triton": lambda a, c: apply_rotary(a, c, cos, sin, use_triton=True),
             "eager": lambda a, c: apply_rotary_reference(a, c, cos, sin),
             "compile": torch.compile(lambda a, c: apply_rotary_reference(a, c, cos, sin))}[impl]
        return lambda: torch.autograd.backward(f(q, k), [dq, dk])

    gate, up = rand(tokens, 14336), rand(tokens, 14336)
    dys = torch.randn(tokens, 14336, device=dev, dtype=dtype)

    def glu(impl):
        f = {"triton": lambda a, c: swiglu(a, c, use_triton=True), "eager": swiglu_reference,
             "compile": torch.compile(swiglu_reference)}[impl]
        return lambda: f(gate, up).backward(dys)

    vocab, ce_tokens = 128256, min(tokens, 4096)
    logits = rand(ce_tokens, vocab)
    target = torch.randint(0, vocab, (ce_tokens,), device=dev, generator=g)

    def eager_ce(z, t):
        return torch.nn.functional.cross_entropy(z.float(), t, reduction="none")

    def ce(impl):
        if impl == "triton":
            return lambda: vocab_parallel_cross_entropy(
                logits * 1.0, target, 0, vocab, use_triton=True, inplace_backward=True
            ).sum().backward()
        f = eager_ce if impl == "eager" else torch.compile(eager_ce)
        return lambda: f(logits * 1.0, target).sum().backward()

    n, nq, nk, f_ = tokens * h, q.numel(), k.numel(), tokens * 14336
    return [
        # fwd: read x, r, w; write y, s. bwd: read dy, ds, s; write dx (= d residual).
        ("rmsnorm+residual", e * (5 * n + 4 * n), rms),
        # fwd: read q, k; write both. bwd: the same again (tables are negligible).
        ("rope", e * 4 * (nq + nk), rope),
        # fwd: read gate, up; write y. bwd: read dy, gate, up; write d_gate, d_up.
        ("swiglu", e * 8 * f_, glu),
        # read logits twice (stats, grad), write grad, scale grad in backward (read + write).
        ("cross_entropy", e * 5 * ce_tokens * vocab, ce),
    ]


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
    for name, nbytes, make in _cases(args.tokens, dtype):
        ms, peak = {}, {}
        for impl in ("triton", "eager", "compile"):
            fn = make(impl)
            fn()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms[impl] = do_bench(fn, grad_to_none=None)
            peak[impl] = (torch.cuda.max_memory_allocated() - base) / 2**30
        gbs = nbytes / ms["triton"] / 1e6
        row = dict(kernel=name, **{f"{k}_ms": v for k, v in ms.items()},
                   **{f"{k}_peak_gib": v for k, v in peak.items()},
                   speedup_eager=ms["eager"] / ms["triton"],
                   speedup_compile=ms["compile"] / ms["triton"], gbs=gbs,
                   frac_copy=gbs / copy_gbs)
        rows.append(row)
        print(f"{name:<18}{ms['triton']:>10.3f}{ms['eager']:>10.3f}{ms['compile']:>11.3f}"
              f"{row['speedup_eager']:>9.2f}{row['speedup_compile']:>10.2f}{gbs:>8.0f}"
              f"{100 * row['frac_copy']:>7.0f}%{peak['triton']:>9.2f}")
    out = ROOT / "bench" / "results" / "kernels.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=device, dtype=args.dtype, tokens=args.tokens,
                                   copy_gbs=copy_gbs, rows=rows), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
