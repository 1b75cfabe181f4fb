"""The device table and the checks that read it: each GEMM against its own dtype's peak.

A healthy H100 failed preflight before this table: its fp32 GEMM (~50 TFLOP/s) was held to
30% of the bf16 peak (297 TFLOP/s)."""

from __future__ import annotations

import pytest
import torch

from megatron_lite import devices
from megatron_lite.devices import DEVICES, lookup
from megatron_lite.reliability import preflight

HEALTHY_FRACTION = 0.6
"""A simulated healthy GEMM: 60% of its dtype's datasheet peak (large cuBLAS GEMMs on a
healthy part run above half of peak in bf16 and fp32 alike)."""


@pytest.mark.parametrize("name,row", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200", "H200"), ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA B200", "B200"), ("NVIDIA GB200", "GB200"), ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A10G", "A10"), ("Tesla V100-SXM2-32GB", "V100"), ("NVIDIA L40S", "L40S"),
    ("AMD Instinct MI300X", "MI300X"), ("AMD Instinct MI250X/MI250", "MI250X GCD")])
def test_gpu_names_find_their_rows(name: str, row: str) -> None:
    spec = lookup(name)
    assert spec is not None and spec.name == row


def test_the_table_is_consistent_with_itself() -> None:
    """Datasheet ratios that hold on every part that has the unit: FP8 doubles bf16's dense
    rate, TF32 halves it (NVIDIA), and fp32 without tensor cores is the slowest."""
    for spec in DEVICES:
        if spec.fp8 is not None:
            assert spec.fp8 == pytest.approx(2 * spec.bf16, rel=0.02), spec.name  # L40S: 733, 362
        if spec.tf32 is not None and not spec.name.startswith("MI"):
            assert spec.tf32 == pytest.approx(spec.bf16 / 2, rel=0.02), spec.name
        assert spec.fp32 <= min(spec.bf16, spec.fp16) and spec.memory_gib > 0, spec.name
    assert lookup("NVIDIA RTX 9999") is None


@pytest.mark.parametrize("spec", DEVICES, ids=lambda s: s.name)
def test_preflight_passes_every_table_gpu_at_a_healthy_rate(monkeypatch, spec) -> None:
    """Each dtype's GEMM, at a healthy rate for that dtype, passes against the peak preflight
    picks for it; ten times slower fails, naming the dtype."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: spec.name)
    gpu = torch.device("cuda", 0)
    for dtype in preflight.CHECKED_DTYPES:
        healthy = HEALTHY_FRACTION * spec.peak(dtype)
        expected = preflight.expected_peak(gpu, dtype)
        assert preflight.judge_rate(healthy, expected, gpu, dtype) is None, (spec.name, dtype)
        slow = preflight.judge_rate(healthy / 10, expected, gpu, dtype)
        assert slow and f"{str(dtype).removeprefix('torch.')} GEMM on cuda:0 ran at" in slow


def test_preflight_leaves_an_unlisted_gpu_unchecked(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA X9000")
    assert preflight.expected_peak(torch.device("cuda", 0), torch.bfloat16) is None
    assert preflight.expected_peak(torch.device("cuda", 0), torch.bfloat16, 700.0) == 700.0


def test_preflight_passes_this_cpu_and_fails_a_planted_10x_slow_gemm(monkeypatch, capsys) -> None:
    cpu = torch.device("cpu")
    assert preflight.run_checks(cpu, None, counters=False, allreduce=False, label="cpu")
    assert "GEMM TFLOP/s float32 " in capsys.readouterr().out
    measure, matmul = preflight.expected_peak, torch.Tensor.__matmul__

    def slow_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        for _ in range(9):
            matmul(a, b)
        return matmul(a, b)

    def measured_then_slowed(device, dtype, given=None):
        peak = measure(device, dtype, given)  # the CPU's real rate...
        monkeypatch.setattr(torch.Tensor, "__matmul__", slow_matmul)  # ...then a slow GEMM
        return peak

    monkeypatch.setattr(preflight, "expected_peak", measured_then_slowed)
    assert not preflight.run_checks(cpu, None, counters=False, allreduce=False, label="cpu")
    assert "float32 GEMM on cpu ran at" in capsys.readouterr().err


def test_the_cpu_peak_is_measured_within_half_a_second() -> None:
    import time

    for dtype in (torch.float32, torch.bfloat16):
        start = time.perf_counter()
        assert devices.measure_cpu_peak_tflops(dtype) > 0
        assert time.perf_counter() - start < 0.5


def test_the_demo_picks_bf16_only_where_this_cpu_multiplies_it_natively(monkeypatch) -> None:
    rates = {torch.float32: 0.2, torch.bfloat16: 0.8}  # AVX-512 BF16: 4x fp32
    monkeypatch.setattr(devices, "measure_cpu_peak_tflops", lambda dtype, seconds: rates[dtype])
    assert devices.cpu_fastest_dtype() == torch.bfloat16
    rates[torch.bfloat16] = 0.00075  # AVX2 only: emulated
    assert devices.cpu_fastest_dtype() == torch.float32


def test_the_tiny_cpu_script_refuses_an_unknown_dtype(tmp_path) -> None:
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "pretrain_llama_tiny_cpu.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "DTYPE": "fp16", "HOME": str(tmp_path),
                               "RUN_DIR": str(tmp_path / "run")}, timeout=60)
    assert proc.returncode == 2 and "DTYPE=fp16: use auto, fp32 or bf16" in proc.stderr
