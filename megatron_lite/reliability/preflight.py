"""Node checks before the rendezvous (--preflight quick): find a bad GPU before it costs a job.

A GPU with uncorrected ECC errors or Xid faults, a throttled or broken one (a slow or wrong
GEMM), or a broken NVLink would otherwise show up as a hang, NaNs or a straggler hours later.
Each check takes well under a second:

- GEMM: an fp32 (TF32 off) and a bf16 matmul on the rank's device, each compared against a
  float64 reference of the same product and timed against the peak **of its own dtype**: the
  datasheet's (megatron_lite/devices.py) on a GPU, this CPU's measured matmul of that dtype on
  a CPU;
- node-local all-reduce (`python -m megatron_lite.reliability.preflight`, one process per node,
  all its GPUs): an NCCL all-reduce over the node's GPUs, checked against the exact sum;
- `nvidia-smi` counters, where it exists: uncorrected volatile ECC errors and pending retired
  pages; Xid lines in the kernel log where it is readable.

A failure prints `preflight: FAILED on host H: ...` (the launch script's after-launch step adds
H to <run>/exclude_hosts and resubmits without it) and exits with PREFLIGHT_EXIT_CODE.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time

import torch

from megatron_lite.devices import lookup, measure_cpu_peak_tflops

PREFLIGHT_EXIT_CODE = 4
MIN_FRACTION_OF_PEAK = 0.3
"""A GPU GEMM below this fraction of its dtype's datasheet peak fails. cuBLAS on a healthy
part runs large square GEMMs well above half of each dtype's peak (bf16 and fp32 alike); a
clock-throttled or degraded GPU runs far below. gpu_check.sh's preflight part prints the
fraction a lent GPU reaches."""
MIN_FRACTION_OF_CPU_PEAK = 0.25
"""A CPU GEMM below this fraction of the same dtype's matmul rate measured just before fails.
The check's 256^3 product runs at 0.8-1.0 of the peak's (up to 1024^3) on the 2-core EPYC
here, fp32 and bf16 alike; a 4x margin absorbs a busy neighbour, not a 10x slow kernel."""
GEMM_RTOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
"""Allowed relative error vs float64: fp32 accumulates ~1e-6 (TF32 off); bf16 inputs carry
2^-9 relative rounding each (~4e-3 on a product's norm), and a broken unit is off by O(1)."""
CHECKED_DTYPES = (torch.float32, torch.bfloat16)
GPU_GEMM_DIM, CPU_GEMM_DIM = 4096, 256


def _timed_rate(a: torch.Tensor, b: torch.Tensor, seconds: float) -> float:
    """TFLOP/s of the fastest single a @ b in the window (the same statistic as the CPU peak:
    a descheduled repetition says nothing about the device)."""
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        a @ b
        if a.device.type == "cuda":
            torch.cuda.synchronize(a.device)
        best = min(best, time.perf_counter() - t)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / best / 1e12


def expected_peak(device: torch.device, dtype: torch.dtype,
                  bf16_given: float | None = None) -> float | None:
    """The rate a `dtype` GEMM is judged against: `bf16_given` (--expected-tflops) for bf16,
    else the datasheet's on a GPU (None for a part not in the table: rate not checked), the
    measured matmul of `dtype` on a CPU."""
    if dtype == torch.bfloat16 and bf16_given:
        return bf16_given
    if device.type == "cuda":
        spec = lookup(torch.cuda.get_device_name(device))
        return spec.peak(dtype) if spec else None
    return measure_cpu_peak_tflops(dtype)


def judge_rate(rate: float, expected: float | None, device: torch.device,
               dtype: torch.dtype) -> str | None:
    """The failure of a GEMM timed at `rate` against its dtype's `expected` peak, or None."""
    fraction = MIN_FRACTION_OF_PEAK if device.type == "cuda" else MIN_FRACTION_OF_CPU_PEAK
    if expected and rate < fraction * expected:
        name = str(dtype).removeprefix("torch.")
        return (f"{name} GEMM on {device} ran at {rate:.3g} TFLOP/s, under {fraction:.0%} of "
                f"the expected {expected:.4g} ({name} peak)")
    return None


def gemm_check(device: torch.device, dtype: torch.dtype = torch.float32,
               expected_tflops: float | None = None, n: int | None = None,
               seconds: float = 0.2) -> tuple[float, str | None]:
    """(measured TFLOP/s, failure or None) of an n x n `dtype` matmul on `device`: its result
    against float64, its rate against `expected_tflops` (the peak of the same dtype)."""
    n = n or (GPU_GEMM_DIM if device.type == "cuda" else CPU_GEMM_DIM)
    gen = torch.Generator().manual_seed(1234)
    a_host = torch.randn(n, n, generator=gen, dtype=torch.float64)
    b_host = torch.randn(n, n, generator=gen, dtype=torch.float64)
    a, b = a_host.to(device, dtype), b_host.to(device, dtype)
    reference = a.double().cpu() @ b.double().cpu()  # the rounded inputs' exact product
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        result = (a @ b).double().cpu()
        rate = _timed_rate(a, b, seconds)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    error = float((result - reference).norm() / reference.norm())
    rtol = GEMM_RTOL[dtype]
    if not error <= rtol:
        return rate, (f"{dtype} GEMM on {device} is wrong: relative error {error:.3g} vs "
                      f"float64 (allowed {rtol:g})")
    return rate, judge_rate(rate, expected_tflops, device, dtype)


def allreduce_check() -> str | None:
    """NCCL all-reduce over every visible GPU of this process (needs two or more)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        return None
    from torch.cuda import nccl

    tensors = [torch.full((1 << 20,), float(i + 1), device=f"cuda:{i}") for i in range(count)]
    nccl.all_reduce(tensors)
    expected = count * (count + 1) / 2
    bad = [i for i, t in enumerate(tensors) if not bool((t == expected).all())]
    return (f"node-local NCCL all-reduce over {count} GPUs wrong on GPU(s) {bad}"
            if bad else None)


def nvidia_smi_check() -> str | None:
    """Uncorrected ECC errors / pending page retirement, and Xid lines in the kernel log."""
    problems = []
    if shutil.which("nvidia-smi"):
        query = "index,ecc.errors.uncorrected.volatile.total,retired_pages.pending"
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
        for line in out.splitlines():
            index, ecc, pending = (f.strip() for f in line.split(",")[:3])
            if ecc.isdigit() and int(ecc) > 0:
                problems.append(f"GPU {index}: {ecc} uncorrected ECC errors")
            if pending.lower() == "yes":
                problems.append(f"GPU {index}: retired pages pending (reset the GPU)")
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        log = ""  # not readable here: the scheduler's health check has to cover Xid
    xids = [line for line in log.splitlines() if "NVRM: Xid" in line]
    if xids:
        problems.append(f"{len(xids)} Xid line(s) in the kernel log, last: {xids[-1].strip()}")
    return "; ".join(problems) or None


def run_checks(device: torch.device, bf16_tflops: float | None, *, counters: bool,
               allreduce: bool, label: str) -> bool:
    """Run the checks, print one line; True when all passed. `counters` and `allreduce`:
    the node-wide ones, once per node; `bf16_tflops`: a bf16 peak to use instead of the
    table's (--expected-tflops)."""
    rates, failures = [], []
    for dtype in CHECKED_DTYPES:
        rate, failure = gemm_check(device, dtype, expected_peak(device, dtype, bf16_tflops))
        rates.append(f"{str(dtype).removeprefix('torch.')} {rate:.3g}")
        failures.append(failure)
    failures += [nvidia_smi_check() if counters else None,
                 allreduce_check() if allreduce else None]
    failures = [f for f in failures if f]
    host = socket.gethostname()
    if failures:
        print(f"preflight: FAILED on host {host}: {label}: {'; '.join(failures)}. The host is "
              "excluded from the run's next job", file=sys.stderr, flush=True)
        return False
    print(f"preflight: ok on host {host}: {label}: GEMM TFLOP/s {', '.join(rates)}, results "
          "match float64", flush=True)
    return True


def check_rank(local_rank: int) -> None:
    """pretrain.py --preflight quick, before the rendezvous: this rank's GEMMs on its own
    device, the counters on local rank 0 (the all-reduce over a node's GPUs is the per-node
    command's: a rank touching every GPU would hold a context on each); exits on failure."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if not run_checks(device, None, counters=local_rank == 0, allreduce=False,
                      label=f"local rank {local_rank}, {device}"):
        sys.exit(PREFLIGHT_EXIT_CODE)


def main(argv: list[str] | None = None) -> int:
    """One process per node (e.g. `srun --ntasks-per-node=1`): every visible GPU, or the CPU."""
    parser = argparse.ArgumentParser(prog="python -m megatron_lite.reliability.preflight",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--preflight", choices=["off", "quick"], default="quick")
    parser.add_argument("--expected-tflops", type=float, default=None,
                        help="the GPUs' dense bf16 peak (default: megatron_lite/devices.py "
                        "by the GPU's name; a GPU not listed is not rate-checked)")
    args = parser.parse_args(argv)
    if args.preflight == "off":
        return 0
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]
    ok = [run_checks(d, args.expected_tflops, counters=i == 0, allreduce=i == 0, label=str(d))
          for i, d in enumerate(devices)]
    return 0 if all(ok) else PREFLIGHT_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
