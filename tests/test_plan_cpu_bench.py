"""bench/plan_cpu.py's measured rates: the FLOPs it weights its timings by are the planner's, so
the planner's GEMM time at that GEMM peak and attention rate is the sum of what the bench
timed (each layer's GEMMs and attention core once per layer, the head's GEMMs once), and its
attention rate is the core's FLOPs (the causal half, 2 matmuls forward and 5 backward) over
the core's time."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest

from megatron_lite import plan_time

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.quick
def test_model_rate_makes_the_planner_replay_the_timed_sum(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    bench = importlib.import_module("plan_cpu")
    call_s = 1e-3
    monkeypatch.setattr(bench, "_median_s", lambda fn, seconds, cold=False: call_s)
    flags = bench.MODELS["shakespeare_char"]
    rate, core_rate = bench.model_gemm_rate(flags)
    layers, tokens, seq, heads, head_dim = 4, 12 * 64, 64, 4, 32
    # per layer: 4 GEMMs x (forward, input gradient, weight gradient) + 1 attention core;
    # the head: 1 GEMM x 3
    timed_s = call_s * (layers * (4 * 3 + 1) + 3)
    # huge bandwidth, free ops: the planner's GEMM time is FLOPs over the peak alone
    hw = dataclasses.replace(plan_time.PRESETS["cpu"], peak_tflops=rate,
                             attention_tflops=core_rate, hbm_gbps=1e12, op_us=0.0)
    assert bench.predict(flags, hw)["gemm_s"] == pytest.approx(timed_s, rel=1e-9)
    core_flops = 7 * tokens * seq * head_dim * heads  # 2·t·(s/2)·d·H per matmul, 2 + 5
    assert core_rate == pytest.approx(core_flops / call_s / 1e12, rel=1e-12)
