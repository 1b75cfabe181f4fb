"""The one-screen end of scripts/gpu_check.sh: each part's status and time against its plan,
then the headline numbers read back from the part's own files in the results directory.

    python bench/gpu_summary.py OUT_DIR

A number whose file is missing reads "n/a (PART did not write FILE)", so a failed part shows
where its number would be. Everything else stays in OUT_DIR (each part's log, .txt, .json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _json(out: Path, pattern: str) -> dict | None:
    """The first file matching `pattern` (gpu_train_1b.json on a GPU, _tiny in the smoke)."""
    paths = sorted(out.glob(pattern))
    return json.loads(paths[0].read_text()) if paths else None


def parts_lines(out: Path) -> list[str]:
    """parts.tsv (name, status, seconds, planned seconds) as a table, then the verdict."""
    rows = [line.split("\t") for line in (out / "parts.tsv").read_text().splitlines() if line]
    lines = ["parts (status, seconds taken / planned):"]
    lines += [f"  {name:<18} {status:<52} {took:>4} / {plan:>3}" for name, status, took, plan
              in rows]
    bad = [name for name, status, _, _ in rows if status != "ok"]
    lines.append(f"  {len(rows) - len(bad)}/{len(rows)} parts ok" + (
        f"; NOT OK: {', '.join(bad)}" if bad else ""))
    return lines


def _gemm_line(fp8: dict | None) -> str:
    if not fp8 or not fp8.get("gemms"):
        return "GEMM TFLOP/s: n/a (fp8_1b wrote no gpu_fp8_*.json)"
    best = {k: max(g[f"{k}_tflops"] for g in fp8["gemms"]) for k in ("bf16", "fp8")}
    return (f"GEMM TFLOP/s (best of the {fp8['model']} layer's 4 projections): bf16 "
            f"{best['bf16']:.4g}, FP8 {best['fp8']:.4g} ({best['fp8'] / best['bf16']:.2f}x)")


def _train_lines(train: dict | None) -> list[str]:
    if not train or not train.get("ours"):
        return ["training MFU: n/a (train_1b wrote no gpu_train_*.json with our side)"]
    ours, plain, mem = train["ours"], train.get("plain"), train.get("memory") or {}
    line = (f"{train['model']} training: MFU {100 * ours['mfu']:.1f}%, "
            f"{ours['tokens_per_sec']:,.0f} tok/s, {ours['tflops_per_device']:.4g} TFLOP/s")
    if plain and train.get("ratio"):
        line += f"; {train['ratio']:.3f}x plain PyTorch"
    ratio, total = mem.get("planner_over_measured"), mem.get("total_bytes")
    planner = f"planner {total / 2**30:.2f} GiB" if total else "no planner figure"
    return [line, f"memory vs planner: {planner}, " + (
        f"planner/measured peak {ratio:.3f}" if ratio else "no measured peak (CPU)")]


def _kernel_line(kernels: dict | None) -> str:
    if not kernels or not kernels.get("rows"):
        return "kernels vs torch: n/a (kernel_bench did not write kernels.json)"
    return "kernels vs torch (x torch.compile): " + ", ".join(
        f"{r['kernel']} {r['speedup_compile']:.2f}" for r in kernels["rows"])


def number_lines(out: Path) -> list[str]:
    """The headline numbers, each from the file its part writes."""
    lines = [_gemm_line(_json(out, "gpu_fp8_*.json")),
             *_train_lines(_json(out, "gpu_train_*.json")), _kernel_line(_json(out,
                                                                               "kernels.json"))]
    calibration = out / "calibration.json"
    lines.append(f"calibration: {calibration} written" if calibration.exists()
                 else "calibration: NOT written (calibrate failed)")
    for name in ("multirank", "multirank_nccl/multirank"):
        path = out / f"{name}.txt"
        if path.exists():  # its verdict, and how its ranks talked (staged or direct)
            report = [line.strip() for line in path.read_text().splitlines()]
            lines.append(f"{name.split('/')[0]}: {report[-1]}; {report[1]}")
    return lines


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    print("\n".join([*parts_lines(out), *number_lines(out), f"all results: {out}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
