"""The step-time model against published runs: Megatron-LM's ten GPT runs on DGX A100 (Narayanan
et al. 2021, Table 1), the 177B strong scaling on H100 (Megatron-LM README), plus its pieces
(ring factors, the GEMM curve and its fit, the calibration file) and scripts/plan.py's --json
and --explain.

Residuals of the A100 replay (predicted - published HFU, points), with plan_time.A100_FIT:
1.7B +0.1, 3.6B -0.4, 7.5B -2.7, 18B +0.2, 39B +2.2, 76B +2.9, 145B +2.8, 310B +1.6,
530B +0.1, 1T +0.3 (rms 1.8). The H100 table that H100_FIT's e_max is fitted on (MFU):
1.7B +5.9, 7.1B +2.2, 16B +0.9, 32B +3.9, 70B +3.6, 119B -5.5, 177B +1.0, 314B -2.9,
462B -9.8 (rms 4.8; 119B and 462B have 23 and 7 layers per stage, which our planner cannot
interleave, so their bubble is the plain 1F1B one).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from megatron_lite import plan_time
from megatron_lite.config import ModelConfig
from megatron_lite.errors import UserError
from megatron_lite.planner import (
    PRESETS,
    Cluster,
    Layout,
    ModelShape,
    Recompute,
    RunOptions,
    evaluate,
)

# name, hidden, layers, heads, TP, PP, GPUs, batch, published % of peak (HFU, their formula)
NARAYANAN = [("1.7B", 2304, 24, 24, 1, 1, 32, 512, 44), ("3.6B", 3072, 30, 32, 2, 1, 64, 512, 44),
             ("7.5B", 4096, 36, 32, 4, 1, 128, 512, 46), ("18B", 6144, 40, 48, 8, 1, 256, 1024, 43),
             ("39B", 8192, 48, 64, 8, 2, 512, 1536, 44),
             ("76B", 10240, 60, 80, 8, 4, 1024, 1792, 45),
             ("145B", 12288, 80, 96, 8, 8, 1536, 2304, 47),
             ("310B", 16384, 96, 128, 8, 16, 1920, 2160, 50),
             ("530B", 20480, 105, 128, 8, 35, 2520, 2520, 52),
             ("1T", 25600, 128, 160, 8, 64, 3072, 3072, 52)]
MEGATRON_2021 = RunOptions("gpt", "unfused", grad_reduce_bytes=2, p2p_scatter_gather=True)
"""As those runs ran: GPT blocks, fused softmax + dropout attention, fp16 gradients all-reduced
after the backward (local DDP: `Cluster(dp_overlap=False)`), scatter-gather between stages."""
MCORE_2024 = RunOptions("gpt", "flash")


def _gpt(hidden: int, layers: int, heads: int, seq: int, vocab: int) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                       ffn_hidden_size=4 * hidden, seq_length=seq, vocab_size=vocab,
                       max_position_embeddings=seq)


def _fastest(model: ModelConfig, c: Cluster, tp: int, pp: int, batch: int, opts: RunOptions,
             recomputes: tuple[Recompute, ...], sharding: str, sp: bool):
    """The fastest fitting plan at this TP x PP over micro-batch, v and `recomputes` (what a
    user tuning the run would pick)."""
    dp, best = c.gpus // (tp * pp), None
    for mb in (1, 2, 4, 8):
        m = batch // (dp * mb)
        if batch % (dp * mb) or m < pp:
            continue
        per_stage = model.num_layers // pp
        for v in (v for v in range(1, 9) if per_stage % v == 0):
            if v > 1 and (pp == 1 or m % pp):
                continue
            for rc in recomputes:
                plan = evaluate(model, Layout(tp, pp, dp, v, mb, sharding, rc, sp), c, batch,
                                1e9, opts)
                if plan.fits and (best is None or plan.tokens_per_s > best.tokens_per_s):
                    best = plan
    assert best is not None
    return best


def _their_hfu(plan, hidden: int, layers: int, batch: int, gpus: int) -> float:
    """Narayanan et al.'s hardware FLOPs, 96·B·s·l·h²·(1 + s/6h + V/16lh), over 312 TF."""
    s, v = 2048, 51200
    flops = (96 * batch * s * layers * hidden**2
             * (1 + s / (6 * hidden) + v / (16 * layers * hidden)))
    return flops / plan.step_s / gpus / 312e12


@pytest.mark.quick
def test_replays_megatron_gpt_runs_on_a100_within_3_points() -> None:
    a100 = plan_time.PRESETS["a100-80gb"]
    got = {}
    for name, h, layers, heads, tp, pp, gpus, batch, published in NARAYANAN:
        c = Cluster.from_hardware(gpus, a100, dp_overlap=False)
        plan = _fastest(_gpt(h, layers, heads, 2048, 51200), c, tp, pp, batch, MEGATRON_2021,
                        (Recompute("full", "uniform", 1),), "no_shard", sp=False)
        got[name] = 100 * _their_hfu(plan, h, layers, batch, gpus)
        assert abs(got[name] - published) <= 3, (name, got[name], published)
        assert plan.hfu <= a100.gemm_efficiency  # nothing runs faster than the GEMMs
    assert got["1T"] - got["1.7B"] >= 5  # published: 44% -> 52%
    assert got["530B"] > got["145B"] > got["39B"] > got["18B"]


def test_177b_strong_scaling_on_h100_loses_3_to_7_points() -> None:
    """Megatron-LM README: GPT 177B, TP8 x PP6, batch 1,152 from 96 to 4,608 H100s, MFU 47% ->
    42% as DP communication and the bubble (fewer micro-batches per replica) show."""
    model = _gpt(12288, 96, 96, 4096, 131072)
    h100 = plan_time.PRESETS["h100-sxm"]
    mfu = {}
    for gpus in (96, 4608):
        c = Cluster.from_hardware(gpus, h100, tp_overlap=True)
        plan = _fastest(model, c, 8, 6, 1152, MCORE_2024,
                        (Recompute(), Recompute("selective"), Recompute("full")), "optim", True)
        mfu[gpus] = 100 * plan.mfu
        parts = (plan.compute_s + plan.memory_s + plan.overhead_s + plan.tp_comm_s + plan.p2p_s
                 + plan.bubble_s + plan.dp_exposed_s + plan.optimizer_s)
        assert parts == pytest.approx(plan.step_s, rel=1e-12)
    assert 3 <= mfu[96] - mfu[4608] <= 7, mfu
    assert abs(mfu[96] - 47) <= 3 and abs(mfu[4608] - 42) <= 3, mfu


def test_mfu_conventions_and_the_efficiency_bound() -> None:
    """MFU (attention causal, the log's `mfu_causal`) and the non-causal MFU (the log's `mfu`)
    are in the ratio of their FLOP counts; HFU adds the recomputed forward; what the GPU
    executes never beats e_max, so the causal MFU and HFU stay below it even at 128K tokens,
    where the non-causal MFU need not."""
    c = Cluster(gpus=64)
    model = dataclasses.replace(PRESETS["8B"][1], seq_length=131072,
                                max_position_embeddings=131072)
    plans = {}
    for rc in (Recompute(), Recompute("selective"), Recompute("full")):
        plan = evaluate(model, Layout(8, 1, 1, 1, 1, "optim", rc, True, None, 8), c, 8, 1e9)
        plans[rc.granularity] = plan
        layers, q, s = model.num_layers, 4096, model.seq_length
        causal_flops = plan.flops_per_token
        noncausal_flops = causal_flops + 6 * layers * q * s
        assert plan.mfu_noncausal / plan.mfu == pytest.approx(noncausal_flops / causal_flops)
        assert plan.mfu <= plan.hfu <= c.gemm_efficiency
        rerun = {"none": 0, "selective": 6 * q * s / 3 * layers}.get(rc.label())
        if rerun is not None:
            assert plan.hfu == pytest.approx(plan.mfu * (1 + rerun / causal_flops))
        else:  # full: every layer's forward again (the output layer is not rerun)
            head = 6 * ModelShape.from_config(model, 8).vocab * model.hidden_size
            assert plan.hfu == pytest.approx(
                plan.mfu * (1 + (causal_flops - head) / 3 / causal_flops))
    fastest = plans["none"]  # 128K: FLOPs counted that never execute
    assert fastest.mfu_noncausal > c.gemm_efficiency > fastest.hfu


def test_ring_factors_and_gemm_curve() -> None:
    hw = plan_time.PRESETS["h100-sxm"]
    assert plan_time.collective_s(8e9, 8, 100.0, 0.0, "all_reduce") == pytest.approx(
        2 * 7 / 8 * 8e9 / 100e9)
    for kind in ("all_gather", "reduce_scatter"):
        assert plan_time.collective_s(8e9, 4, 100.0, 10.0, kind) == pytest.approx(
            3 / 4 * 8e9 / 100e9 + 10e-6)
    assert plan_time.collective_s(1e9, 1, 100.0, 10.0, "all_reduce") == 0.0
    half = hw.gemm_half_dim
    assert plan_time.gemm_efficiency(8192, 8192, half, hw) == pytest.approx(
        hw.gemm_efficiency / 2)
    big = plan_time.gemm_s(8192, 8192, 8192, hw)
    assert big == pytest.approx(2 * 8192**3 / (hw.peak_tflops * 1e12 * hw.gemm_efficiency
                                               * 8192 / (8192 + half)))
    thin = plan_time.gemm_s(8192, 8192, 16, hw)  # memory-bound: the roofline's bytes
    assert thin == pytest.approx(2 * (2 * 8192 * 16 + 8192**2) / (hw.hbm_gbps * 1e9))


def test_calibration_file_fits_the_curve(tmp_path) -> None:
    """A file with GEMMs timed on the exact curve e_max·d/(d + d_half) gives back the curve,
    and its bandwidths replace the preset's; a broken file is one clear error."""
    e_max, half, peak = 0.7, 120.0, 900.0
    gemms = [{"m": 8192, "n": 8192, "k": d, "tflops": peak * e_max * d / (d + half)}
             for d in (32, 64, 128, 256, 1024, 4096)]
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"peak_tflops": peak, "gemms": gemms, "hbm_gbps": 3000.0,
                                "op_us": 5.0, "collectives": [
                                    {"op": "all_reduce", "ranks": 2, "bytes": 2**20,
                                     "busbw_gbps": 100.0},
                                    {"op": "all_reduce", "ranks": 2, "bytes": 2**28,
                                     "busbw_gbps": 300.0}]}))
    hw = plan_time.load_calibration(path, plan_time.PRESETS["h100-sxm"])
    assert hw.gemm_efficiency == pytest.approx(e_max, rel=0.02)
    assert hw.gemm_half_dim == pytest.approx(half, rel=0.05)
    assert (hw.peak_tflops, hw.hbm_gbps, hw.op_us, hw.intra_node_gbps) == (peak, 3000.0, 5.0,
                                                                           300.0)
    path.write_text("{}")
    with pytest.raises(UserError, match=r"--calibration .*cal\.json.*gpu_check"):
        plan_time.load_calibration(path, hw)


def test_plan_cli_json_and_explain(capsys) -> None:
    import scripts.plan as plan_cli

    common = ["--preset", "125M", "--gpus", "16", "--pp", "1", "--tp", "2"]
    assert plan_cli.main([*common, "--top", "3", "--json", "--hardware", "a100-80gb"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3 and rows[0]["step_s"] <= rows[1]["step_s"]
    for row in rows:
        for key in ("tp", "cp", "pp", "dp", "schedule", "vpp", "micro_batch_size", "sharding",
                    "recompute", "step_s", "mfu", "hfu", "tokens_per_s_per_gpu"):
            assert key in row, key
        assert 0 < row["mfu"] <= row["hfu"] < 1 and row["tp"] * row["pp"] * row["dp"] == 16
        assert math.isclose(sum(row["breakdown_s"].values()), row["step_s"], rel_tol=1e-9)
        assert row["tokens_per_s_per_gpu"] * 16 * row["step_s"] == pytest.approx(256 * 2048)
    assert plan_cli.main([*common, "--top", "1", "--explain", "--peak-tflops", "100"]) == 0
    out = capsys.readouterr().out
    section = out.split("step time of #1")[1]
    assert "GEMM compute" in section and "exposed DP communication" in section
    assert "100 TFLOP/s" in out
    assert plan_cli.main([*common, "--hbm-gbps", "0"]) == 2
    assert "error: --hbm-gbps 0" in capsys.readouterr().err
