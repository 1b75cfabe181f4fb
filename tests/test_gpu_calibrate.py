"""bench/gpu_calibrate.py (scripts/gpu_check.sh's calibrate part) on the CPU, small: the GEMMs it
times are one rank's shapes of the model at each TP, its rates and bus bandwidths follow from
its timings (ring factors as the planner charges them), and its file is what
`scripts/plan.py --calibration` reads. The collective sweep (spawned ranks) is not run here:
a spawned gloo pair can hang on this shared machine; `--device cpu --ranks 2` runs it by hand."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_lite import plan_time
from megatron_lite.planner import PRESETS, model_shape

ROOT = Path(__file__).resolve().parents[1]


def test_calibration_on_cpu_feeds_the_planner(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    bench = importlib.import_module("gpu_calibrate")
    assert bench.main(["--out", str(tmp_path), "--device", "cpu", "--preset", "125M",
                       "--seq-length", "64", "--tp", "1", "4", "--copy-mib", "4",
                       "--collective-mib", "1", "--seconds", "0.005", "--ranks", "1"]) == 0
    data = json.loads((tmp_path / "calibration.json").read_text())
    shape = model_shape(PRESETS["125M"][1], 4)
    q = shape.heads * shape.head_dim // 4
    timed = {(g["m"], g["n"], g["k"]) for g in data["gemms"]}
    assert {(64, q + 2 * shape.query_groups * shape.head_dim // 4, 768), (64, 768, q),
            (64, shape.vocab // 4, 768)} <= timed
    for g in data["gemms"]:
        assert g["tflops"] == pytest.approx(2 * g["m"] * g["n"] * g["k"] / g["seconds"] / 1e12)
    assert data["collectives"] == []  # one rank: skipped, and said so
    assert "collectives: one GPU here" in (tmp_path / "calibration.txt").read_text()
    for op, factor in bench.FACTORS.items():  # the bus bandwidth it reports is the planner's
        nbytes, seconds, ranks = 2**28, 0.01, 8
        busbw = factor(ranks) * nbytes / seconds / 1e9
        assert plan_time.collective_s(nbytes, ranks, busbw, 0.0, op) == pytest.approx(seconds)
    hw = plan_time.load_calibration(tmp_path / "calibration.json", plan_time.PRESETS["cpu"])
    assert hw.peak_tflops == data["peak_tflops"] and hw.hbm_gbps == data["hbm_gbps"]
    core = data["attention"]  # 768 / 12 heads of 64, one 64-token sequence: 7·t·s·d·H FLOPs
    assert (core["seq"], core["heads"], core["head_dim"]) == (64, 12, 64)
    assert core["tflops"] == pytest.approx(7 * 64 * 64 * 64 * 12 / core["seconds"] / 1e12)
    assert hw.attention_tflops == data["attention_tflops"] == core["tflops"]
    assert (hw.gemm_efficiency, hw.gemm_half_dim) == pytest.approx(
        (data["fit"]["gemm_efficiency"], data["fit"]["gemm_half_dim"]))
    assert "calibration (cpu" in (tmp_path / "calibration.txt").read_text()
