"""Compiles every Triton kernel for NVIDIA GPUs on a machine without one, at the launch
configurations our launchers choose for Llama-3 8B and 70B (TP=8) shapes, and reports for each:
registers per thread and spill bytes (from ptxas), shared memory, and how many global loads and
stores are 128-bit vector accesses.

    python -m tests.kernels.aot_compile [--arch 80 90] [--json OUT]

The interpreter tests prove the math; this proves the same source builds for the GPU (the
interpreter accepts code that the compiler rejects) and does not spill at real widths. The
launchers run on CPU tensors with every kernel launch recorded instead of run, so the
configurations are the launchers' own, and the arguments are specialized as Triton's JIT would
specialize them on a GPU; each distinct launch is then compiled once per architecture. Run
without TRITON_INTERPRET, which swaps triton.language for the interpreter's version.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SHAPES = {  # hidden, ffn, q heads, kv heads, head dim, vocab (per TP rank)
    "llama3-8b": (4096, 14336, 32, 8, 128, 128256),
    "llama3-70b-tp8": (8192, 28672 // 8, 64 // 8, 1, 128, 128256 // 8),
}
OPS = ("cross_entropy", "rmsnorm", "rope", "swiglu")
TOKENS = 64  # rows per launch: enough that row tiling reaches its real-size choice


@dataclass(frozen=True)
class Launch:
    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    attrs: tuple[tuple[int, str], ...]  # (argument index, Triton's specialization key)
    num_warps: int


class _Recorder:
    """Stands in for a `_triton_<op>` module: `kernel[grid](*args, **kw)` is recorded, not run."""

    def __init__(self, module, launches: set[Launch]) -> None:
        self._module, self._launches = module, launches

    def __getattr__(self, name: str):
        fn = getattr(self._module, name)
        launches = self._launches

        class _Grid:
            def __getitem__(self, grid):
                def launch(*args, num_warps: int = 4, **kw) -> None:
                    launches.add(_describe(fn, args, kw, num_warps))
                return launch

        return _Grid()


def _kernel_module(op: str):
    return importlib.import_module(f"megatron_lite.kernels._triton_{op}")


def _describe(fn, args: tuple, kw: dict, num_warps: int) -> Launch:
    """The launch as Triton's JIT would specialize it on a GPU: 16-byte-aligned pointers and
    integers divisible by 16 carry `tt.divisibility` (which lets the compiler vectorize loads),
    integers equal to 1 become constants."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    signature, constexprs, attrs = [], [], []
    positional = iter(args)
    for i, p in enumerate(fn.params):
        value = kw[p.name] if p.name in kw else next(positional)
        if p.is_constexpr:
            signature.append((p.name, "constexpr"))
            constexprs.append((p.name, value))
            continue
        kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
        if kind == "constexpr":
            constexprs.append((p.name, key))
        elif key:
            attrs.append((i, key))
        signature.append((p.name, kind))
    return Launch(fn.__name__, tuple(signature), tuple(constexprs), tuple(attrs), num_warps)


def record_launches() -> list[Launch]:
    """Runs forward and backward of every op through its launcher, recording the launches."""
    from megatron_lite import kernels as ops

    launches: set[Launch] = set()

    def fake_loader(name: str, device: torch.device):
        return _Recorder(_kernel_module(name), launches)

    for op in OPS:  # (the package's `swiglu` attribute is the function: go by module name)
        importlib.import_module(f"megatron_lite.kernels.{op}").load_triton_module = fake_loader
    for hidden, ffn, n_q, n_kv, head_dim, vocab in SHAPES.values():
        def leaf(*shape, dtype=torch.bfloat16):
            return torch.zeros(*shape, dtype=dtype, requires_grad=True)

        x, res, w = leaf(TOKENS, hidden), leaf(TOKENS, hidden), leaf(hidden)
        ops.rms_norm(x, w, 1e-5, use_triton=True).sum().backward()
        y, total = ops.rms_norm_residual(x, res, w, 1e-5, use_triton=True)
        (y.sum() + total.sum()).backward()
        q, k = leaf(TOKENS, 1, n_q, head_dim), leaf(TOKENS, 1, n_kv, head_dim)
        cos, sin = ops.rope_tables(TOKENS, head_dim, 500000.0, "cpu", torch.float32)
        qo, ko = ops.apply_rotary(q, k, cos, sin, use_triton=True)
        (qo.sum() + ko.sum()).backward()
        ops.swiglu(leaf(TOKENS, ffn), leaf(TOKENS, ffn), use_triton=True).sum().backward()
        target = torch.zeros(TOKENS, dtype=torch.int64)
        for dtype in (torch.bfloat16, torch.float32):
            logits = leaf(TOKENS, vocab, dtype=dtype) * 1  # not a leaf: in-place allowed
            ops.vocab_parallel_cross_entropy(logits, target, 0, vocab, use_triton=True,
                                             inplace_backward=True).sum().backward()
    return sorted(launches, key=repr)


def _ptxas_report(ptx: str, arch: int) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        out = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", str(src), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                             check=True).stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, out)
        return int(found.group(1)) if found else 0

    return {"registers": number(r"Used (\d+) registers"),
            "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads")}


def _global_accesses(ptx: str) -> dict:
    """Global loads and stores in the PTX: 128-bit vector ones (what reaches full bandwidth) and
    the rest (per-row scalars such as rstd are expected; per-element ones are not)."""
    counts = {}
    for op in ("ld", "st"):
        found = re.findall(rf"\b{op}\.global(?:\.[a-z]+)*\.(v[248]\.)?[bfsu](\d+)\b", ptx)
        counts[f"{op}_v128"] = sum(1 for v, bits in found if v and int(v[1]) * int(bits) == 128)
        counts[f"{op}_other"] = len(found) - counts[f"{op}_v128"]
    return counts


def compile_all(launches: list[Launch], archs: list[int]) -> list[dict]:
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    rows = []
    for launch in launches:
        fn = next(getattr(m, launch.kernel) for m in map(_kernel_module, OPS)
                  if hasattr(m, launch.kernel))
        for arch in archs:
            source = ASTSource(fn=fn, signature=dict(launch.signature),
                               constexprs=dict(launch.constexprs),
                               attrs={(i,): BaseBackend.parse_attr(key)
                                      for i, key in launch.attrs})
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": launch.num_warps})
            rows.append({"kernel": launch.kernel, "arch": arch, "num_warps": launch.num_warps,
                         "constexprs": dict(launch.constexprs),
                         "types": sorted({t for _, t in launch.signature if t[0] == "*"}),
                         "shared_bytes": compiled.metadata.shared,
                         **_global_accesses(compiled.asm["ptx"]),
                         **_ptxas_report(compiled.asm["ptx"], arch)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces triton.language")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    rows = compile_all(record_launches(), args.arch)
    print(f"{'kernel':<22} {'sm':>3} {'warps':>5} {'regs':>4} {'spill B':>7} {'smem B':>6} "
          f"{'ld/st 128b':>10} {'other':>6}  pointers / constants")
    for r in rows:
        print(f"{r['kernel']:<22} {r['arch']:>3} {r['num_warps']:>5} {r['registers']:>4} "
              f"{r['spill_stores'] + r['spill_loads']:>7} {r['shared_bytes']:>6} "
              f"{r['ld_v128']:>4}/{r['st_v128']:<5} {r['ld_other']:>2}/{r['st_other']:<3}  "
              f"{','.join(r['types'])} {r['constexprs']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
