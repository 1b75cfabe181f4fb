"""What each accelerator can do, in one table: MFU, the planner's presets and preflight read it.

Every number is the vendor's datasheet figure for one device as torch sees it (one GCD of an
MI250X), **dense** (no 2:4 sparsity), in TFLOP/s; bandwidths in GB/s. Nothing else in the
package spells a peak. A CPU has no datasheet: `measure_cpu_peak_tflops` times the dtype the
model's GEMMs run in, and `cpu_bf16_slowdown` says when this CPU's bf16 matmul is emulated.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a peak is measured: the planner reads the table
    import torch  # without it


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator's datasheet."""

    name: str
    match: tuple[str, ...]
    """Fragments of `torch.cuda.get_device_name` that select this row (the first row with a
    matching fragment wins, so variants come before their family)."""
    bf16: float
    """Dense bf16 tensor-core peak (fp16's is the same on every part listed but the V100)."""
    fp16: float
    fp8: float | None
    """Dense e4m3/e5m2 peak; None where the part has no FP8 tensor cores."""
    tf32: float | None
    """Dense TF32 (matrix fp32 on AMD) peak; None where there is none."""
    fp32: float
    """Plain fp32 (TF32 off) peak."""
    hbm_gbps: float
    memory_gib: float
    interconnect: str
    interconnect_gbps: float
    """Per-device bandwidth of that link, one direction."""

    def peak(self, dtype: torch.dtype | str, *, fp8: bool = False) -> float:
        """The dense peak a GEMM in `dtype` is measured against (TF32 off for fp32)."""
        if fp8:
            if self.fp8 is None:
                raise ValueError(f"{self.name} has no FP8 tensor cores")
            return self.fp8
        name = str(dtype).removeprefix("torch.")
        return {"bfloat16": self.bf16, "float16": self.fp16, "float32": self.fp32}[name]


DEVICES: tuple[DeviceSpec, ...] = (
    # NVIDIA datasheets: A100 (2021), H100 (2023), H200 (2024), L40S (2023), A10, V100,
    # DGX/HGX B200 and GB200 NVL72 (2024, per GPU: the 8- or 72-GPU totals divided).
    DeviceSpec("H100 PCIe", ("H100 PCIe",), 756.0, 756.0, 1513.0, 378.0, 51.0, 2000.0, 80.0,
               "PCIe 5", 64.0),
    DeviceSpec("H100 NVL", ("H100 NVL",), 835.0, 835.0, 1671.0, 418.0, 60.0, 3900.0, 94.0,
               "NVLink bridge", 300.0),
    DeviceSpec("H200 NVL", ("H200 NVL",), 835.0, 835.0, 1671.0, 418.0, 60.0, 4800.0, 141.0,
               "NVLink bridge", 450.0),
    DeviceSpec("H200", ("H200",), 989.0, 989.0, 1979.0, 495.0, 67.0, 4800.0, 141.0,
               "NVLink 4", 450.0),
    DeviceSpec("H100 SXM", ("H100",), 989.0, 989.0, 1979.0, 495.0, 67.0, 3350.0, 80.0,
               "NVLink 4", 450.0),
    DeviceSpec("GB200", ("GB200",), 2500.0, 2500.0, 5000.0, 1250.0, 80.0, 8000.0, 186.0,
               "NVLink 5", 900.0),
    DeviceSpec("B200", ("B200",), 2250.0, 2250.0, 4500.0, 1125.0, 75.0, 8000.0, 180.0,
               "NVLink 5", 900.0),
    DeviceSpec("A100", ("A100",), 312.0, 312.0, None, 156.0, 19.5, 2039.0, 80.0,
               "NVLink 3", 300.0),
    DeviceSpec("L40S", ("L40S",), 362.05, 362.05, 733.0, 183.0, 91.6, 864.0, 48.0, "PCIe 4", 32.0),
    DeviceSpec("A10", ("A10",), 125.0, 125.0, None, 62.5, 31.2, 600.0, 24.0, "PCIe 4", 32.0),
    # Volta has fp16 tensor cores only: bf16 runs on its fp32 units
    DeviceSpec("V100", ("V100",), 15.7, 125.0, None, None, 15.7, 900.0, 32.0, "NVLink 2", 150.0),
    # AMD datasheets: MI300X (2023; Infinity Fabric 7 x 64 GB/s per direction), MI250X (2021:
    # two GCDs per package, and torch sees each as a device: half the package's figures)
    DeviceSpec("MI300X", ("MI300X",), 1307.4, 1307.4, 2614.9, 653.7, 163.4, 5300.0, 192.0,
               "Infinity Fabric", 448.0),
    DeviceSpec("MI250X GCD", ("MI250X",), 191.5, 191.5, None, 47.9, 47.9, 1600.0, 64.0,
               "Infinity Fabric", 200.0),
)
"""The table; tests/test_devices.py checks its internal ratios (FP8 = 2 x bf16 = 4 x TF32)."""


def lookup(name: str) -> DeviceSpec | None:
    """The row for a device name as torch reports it, or None for a part not listed."""
    for spec in DEVICES:
        if any(fragment in name for fragment in spec.match):
            return spec
    return None


def by_name(name: str) -> DeviceSpec:
    """The row named exactly `name` (the planner's presets)."""
    return next(spec for spec in DEVICES if spec.name == name)


CPU_PEAK_WINDOW_S = 0.3
"""Wall time of the CPU peak measurement (the issue's bound is 0.5 s)."""
CPU_PEAK_MAX_DIM = 1024
"""Largest square matmul timed: past it a 2-core CPU's rate no longer rises."""
CPU_PEAK_TARGET_S = 0.01
"""Time one timed matmul should take: the probe scales n down to it, so an emulated bf16
(~1 GFLOP/s) is still measured within the window instead of in ~6 s at n = 1024."""


def _time_matmul(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    a @ b
    return time.perf_counter() - start


def measure_cpu_peak_tflops(dtype: torch.dtype | None = None,
                            seconds: float = CPU_PEAK_WINDOW_S) -> float:
    """Achievable `dtype` matmul TFLOP/s of this CPU: the fastest single square matmul in the
    window, at the largest n (<= CPU_PEAK_MAX_DIM) that one matmul of which takes about
    CPU_PEAK_TARGET_S. The fastest counts, not the mean: a process sharing its cores is
    descheduled for part of the window, which would lower the peak and lift MFU."""
    import torch

    dtype = dtype or torch.float32
    probe = 128
    a = torch.randn(probe, probe).to(dtype)
    _time_matmul(a, a)  # warm-up: oneDNN picks its kernel
    rate = 2 * probe**3 / max(_time_matmul(a, a), 1e-9)
    n = probe
    while n < CPU_PEAK_MAX_DIM and 2 * (2 * n) ** 3 / rate <= CPU_PEAK_TARGET_S:
        n *= 2
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    best, start = _time_matmul(a, b), time.perf_counter()
    while time.perf_counter() - start < seconds:
        best = min(best, _time_matmul(a, b))
    return 2 * n**3 / max(best, 1e-9) / 1e12


EMULATED_BF16_SLOWDOWN = 1.5
"""bf16 matmul this many times slower than fp32 means this CPU has no native bf16 (AVX-512
BF16 / AMX): a native one runs at or above fp32's rate; an emulated one is 10-1000x slower."""


def cpu_bf16_slowdown(seconds: float = CPU_PEAK_WINDOW_S / 2) -> float:
    """fp32 matmul rate over bf16's on this CPU (> EMULATED_BF16_SLOWDOWN: emulated)."""
    import torch

    return (measure_cpu_peak_tflops(torch.float32, seconds)
            / measure_cpu_peak_tflops(torch.bfloat16, seconds))


def cpu_fastest_dtype() -> torch.dtype:
    """bf16 where this CPU multiplies it natively, else fp32 (the demo and CPU scripts)."""
    import torch

    return torch.float32 if cpu_bf16_slowdown() > EMULATED_BF16_SLOWDOWN else torch.bfloat16


def device_peak(device: torch.device, dtype: torch.dtype, given: float | None = None,
                *, fp8: bool = False) -> tuple[float, str]:
    """(peak TFLOP/s of a `dtype` GEMM on `device`, where it came from): MFU's denominator."""
    import torch

    label = "fp8" if fp8 else str(dtype).removeprefix("torch.")
    if given:
        return given, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = lookup(name)
        if spec is not None:
            return spec.peak(dtype, fp8=fp8), f"{label} dense, table ({name})"
        return math.nan, (f"unknown GPU {name!r}: no peak in megatron_lite/devices.py, MFU "
                          "not computed; pass --peak-tflops")
    return (measure_cpu_peak_tflops(dtype),
            f"{label} dense, measured {label} matmul on this CPU")


def main() -> None:
    """`python -m megatron_lite.devices --cpu-dtype-flag`: `--bf16` where this CPU multiplies
    bf16 natively, nothing otherwise (scripts/demo.sh and the CPU launch scripts)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megatron_lite.devices",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-dtype-flag", action="store_true",
                        help="print --bf16 when bf16 is this CPU's fastest matmul dtype")
    args = parser.parse_args()
    if args.cpu_dtype_flag:
        print("--bf16" if str(cpu_fastest_dtype()) == "torch.bfloat16" else "")
        return
    for spec in DEVICES:
        print(f"{spec.name:<11} bf16 {spec.bf16:>7g}  fp8 {spec.fp8 or '-':>6}  fp32 "
              f"{spec.fp32:>5g}  HBM {spec.hbm_gbps:>5g} GB/s  {spec.memory_gib:g} GiB")


if __name__ == "__main__":
    main()
