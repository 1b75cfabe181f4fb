"""Node checks before the rendezvous (--preflight quick): find a bad GPU before it costs a job.

A GPU with uncorrected ECC errors or Xid faults, a throttled or broken one (a slow or wrong
GEMM), or a broken NVLink would otherwise show up as a hang, NaNs or a straggler hours later.
Each check takes well under a second:

- GEMM: an fp32 matmul on the rank's device, compared against a float64 reference of the same
  product and timed against the expected rate (a fraction of the device's bf16 peak on a GPU;
  on the CPU only the result is checked, and the rate is printed);
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

PREFLIGHT_EXIT_CODE = 4
MIN_FRACTION_OF_PEAK = 0.3
"""A GPU's quick GEMM below this fraction of its bf16 peak fails (a healthy one reaches about
half or more at these sizes; a throttled or degraded one far less)."""
GEMM_RTOL = 1e-3
"""Allowed relative error of the fp32 GEMM vs float64 (TF32 off; fp32 accumulates ~1e-6)."""


def gemm_check(device: torch.device, expected_tflops: float | None = None,
               n: int | None = None, seconds: float = 0.2) -> tuple[float, str | None]:
    """(measured TFLOP/s, failure or None) of an n x n fp32 matmul on `device`."""
    n = n or (4096 if device.type == "cuda" else 256)
    gen = torch.Generator().manual_seed(1234)
    a_host = torch.randn(n, n, generator=gen, dtype=torch.float64)
    b_host = torch.randn(n, n, generator=gen, dtype=torch.float64)
    reference = a_host @ b_host
    a, b = a_host.to(device, torch.float32), b_host.to(device, torch.float32)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        result = (a @ b).double().cpu()
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            reps += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        rate = 2 * n**3 * reps / (time.perf_counter() - start) / 1e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    error = float((result - reference).norm() / reference.norm())
    if not error <= GEMM_RTOL:
        return rate, (f"GEMM on {device} is wrong: relative error {error:.3g} vs float64 "
                      f"(allowed {GEMM_RTOL:g})")
    if expected_tflops and rate < MIN_FRACTION_OF_PEAK * expected_tflops:
        return rate, (f"GEMM on {device} ran at {rate:.1f} TFLOP/s, under "
                      f"{MIN_FRACTION_OF_PEAK:.0%} of the expected {expected_tflops:g}")
    return rate, None


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


def run_checks(device: torch.device, expected_tflops: float | None, *, counters: bool,
               allreduce: bool, label: str) -> bool:
    """Run the checks, print one line; True when all passed. `counters` and `allreduce`:
    the node-wide ones, once per node."""
    rate, gemm = gemm_check(device, expected_tflops)
    failures = [f for f in (gemm, nvidia_smi_check() if counters else None,
                            allreduce_check() if allreduce else None) if f]
    host = socket.gethostname()
    if failures:
        print(f"preflight: FAILED on host {host}: {label}: {'; '.join(failures)}. The host is "
              "excluded from the run's next job", file=sys.stderr, flush=True)
        return False
    print(f"preflight: ok on host {host}: {label}: GEMM {rate:.3g} TFLOP/s, result matches "
          "float64", flush=True)
    return True


def check_rank(local_rank: int, expected_tflops: float | None) -> None:
    """pretrain.py --preflight quick, before the rendezvous: this rank's GEMM on its own
    device, the counters on local rank 0 (the all-reduce over a node's GPUs is the per-node
    command's: a rank touching every GPU would hold a context on each); exits on failure."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if not run_checks(device, expected_tflops if cuda else None, counters=local_rank == 0,
                      allreduce=False, label=f"local rank {local_rank}, {device}"):
        sys.exit(PREFLIGHT_EXIT_CODE)


def main(argv: list[str] | None = None) -> int:
    """One process per node (e.g. `srun --ntasks-per-node=1`): every visible GPU, or the CPU."""
    parser = argparse.ArgumentParser(prog="python -m megatron_lite.reliability.preflight",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--preflight", choices=["off", "quick"], default="quick")
    parser.add_argument("--expected-tflops", type=float, default=None,
                        help="the GPUs' bf16 peak (default: not checked)")
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
