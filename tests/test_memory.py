"""The planner's state-memory prediction against the bytes a real run holds, per layout.

Parameters, gradient buffer and optimizer state are measured from the actual tensors (the
optimizer's own accounting) on every rank and compared with `planner.estimate_memory` for
that rank's stage, within 2%; the activation estimate is compared with the saved-for-backward
bytes measured by `memory.measure_saved_bytes` (the issue allows 25%; it is exact here).
"""

from __future__ import annotations

import pytest
import torch

from megatron_lite.arguments import parse_config
from megatron_lite.dry_run import run_rank
from megatron_lite.memory import dry_run_report, measure_saved_bytes
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.planner import estimate_memory, sharding_formula, stage_params
from megatron_lite.training import build_model
from tests.distributed import run_ranks

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32",
         "--vocab-size", "1000", "--make-vocab-size-divisible-by", "64",
         "--micro-batch-size", "2", "--mock-data"]
LAYOUTS = {
    "single-fp32": ([], 1, 1, 1),
    "dp2-zero1-bf16": (["--use-distributed-optimizer", "--bf16"], 2, 1, 1),
    "dp2-zero2-bf16": (["--data-parallel-sharding-strategy", "optim_grads", "--bf16"], 2, 1, 1),
    "tp2-sp-pp2-untied": (["--tensor-model-parallel-size", "2", "--sequence-parallel",
                           "--pipeline-model-parallel-size", "2",
                           "--untie-embeddings-and-output-weights"], 4, 2, 2),
    "tp2-sp-fp8-bf16": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16",
                         "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"], 2, 2, 1),
}


def _measure(pstate: ParallelState, flags: list[str]) -> dict:
    cfg = parse_config(flags)
    chunks = build_model(cfg, pstate)
    optimizer = Optimizer(cfg, chunks, pstate)
    report = optimizer.memory()
    params = {id(p): p for c in chunks for p in c.parameters()}
    est = estimate_memory(cfg, pstate.world_size, stage=pstate.pp_rank, fused_kernels=False,
                          device_type="cpu")
    return {"param": sum(p.numel() * p.element_size() for p in params.values()),
            "grad": report.grad_buffer_bytes, "optimizer": report.state_bytes,
            "saved": measure_saved_bytes(chunks, cfg, pstate),
            "est": (est.param_bytes, est.grad_bytes, est.optimizer_bytes,
                    est.activation_bytes_per_microbatch)}


def _measure_each(pstate: ParallelState, flag_sets: list[list[str]]) -> list[dict]:
    """`_measure` for several layouts of the same process grid, one spawn for them all."""
    return [_measure(pstate, flags) for flags in flag_sets]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, list[dict]]:
    """Per layout, per rank: `_measure`. Layouts of the same (world, tp, pp) share one set of
    spawned ranks (the two DP=2 ones); one process alone needs no spawn."""
    tmp = tmp_path_factory.mktemp("memory")
    grids: dict[tuple[int, int, int], list[str]] = {}
    for name, (_, world, tp, pp) in LAYOUTS.items():
        grids.setdefault((world, tp, pp), []).append(name)
    out: dict[str, list[dict]] = {}
    for (world, tp, pp), names in grids.items():
        flag_sets = [MODEL + LAYOUTS[name][0] for name in names]
        if world == 1:
            per_rank = [_measure_each(single_process_state(), flag_sets)]
        else:
            per_rank = run_ranks(_measure_each, world, tmp, tp=tp, pp=pp, flag_sets=flag_sets)
        for i, name in enumerate(names):
            out[name] = [rank_results[i] for rank_results in per_rank]
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_planner_matches_measured_state_and_activation_bytes(measured, layout: str) -> None:
    for rank, m in enumerate(measured[layout]):
        est_param, est_grad, est_opt, est_act = m["est"]
        for what, measured_bytes, predicted in (("parameters", m["param"], est_param),
                                                ("gradients", m["grad"], est_grad),
                                                ("optimizer", m["optimizer"], est_opt)):
            assert predicted == pytest.approx(measured_bytes, rel=0.02), (layout, rank, what)
        ratio = est_act / m["saved"]
        print(f"{layout} rank {rank}: activation estimate / measured = {ratio:.3f}")
        assert 0.75 <= ratio <= 1.25, (layout, rank, ratio)


@pytest.mark.quick
def test_dry_run_needs_no_process_group() -> None:
    cfg = parse_config([*MODEL, "--tensor-model-parallel-size", "8",
                        "--pipeline-model-parallel-size", "4", "--num-layers", "8",
                        "--num-attention-heads", "8", "--num-query-groups", "8",
                        "--global-batch-size", "64"])
    text = dry_run_report(cfg, 64)
    assert "world size 64 = pp 4 x dp 2 x tp 8" in text
    assert "stage 3: chunk 0: layers 6-7" in text
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_dry_run_bytes_per_strategy_match_the_formula(strategy: str, capsys) -> None:
    """Rank 0 of a DP=8 bf16 run on the meta device: the bytes its real tensors hold equal the
    planner's within 2%, and their sum per parameter is the strategy's formula (e.g. ZeRO-2
    2 + 16/d = 4 B/param at d = 8) within 2%; the dry run prints the formula per stage."""
    cfg = parse_config([*MODEL, "--bf16", "--data-parallel-sharding-strategy", strategy,
                        "--global-batch-size", "16", "--hidden-size", "256",
                        "--ffn-hidden-size", "512"])
    r = run_rank(cfg, 8, 0, time_host=False)
    measured = (r.params_bytes, r.grads_bytes, r.optimizer_bytes)
    planned = (r.planner_params_bytes, r.planner_grads_bytes, r.planner_optimizer_bytes)
    assert measured == pytest.approx(planned, rel=0.02)
    n = stage_params(cfg.model, 1, 1, 0, 4)
    assert sum(measured) / n == pytest.approx(sharding_formula(strategy, 8)[1], rel=0.02)
    form = sharding_formula(strategy, 8)[0]
    assert f"sharding {strategy} over d=8: {form}" in dry_run_report(cfg, 8)


FP8 = ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "64",
       "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "([0]+[1]*3)"]


def _saved(flags: list[str]) -> tuple[int, float]:
    """(measured saved-for-backward bytes of one micro-batch, the planner's estimate)."""
    cfg = parse_config([*MODEL, *flags])
    chunks = build_model(cfg, single_process_state())
    est = estimate_memory(cfg, 1, stage=0, fused_kernels=False, device_type="cpu")
    return measure_saved_bytes(chunks, cfg, single_process_state()), \
        est.activation_bytes_per_microbatch


def test_fp8_saved_bytes_match_the_formula() -> None:
    """bf16, 4 layers, 512 tokens per micro-batch: with --fp8-format each linear saves its
    input in e4m3 (1 byte, not 2) plus an e4m3 weight copy and two fp32 scales, so per layer
    sum over qkv, proj, gate/up, down of (1 - 2) x 512 x fan_in + fan_in x fan_out + 8 (the
    CPU's fp32 attention core keeps its own copy of the projection input, so that 2-byte input
    goes too). Measured equals the planner exactly, with and without FP8; FP8 is 507,776 bytes
    lower. The MoE variant (3 MoE layers, shared expert): measured and planned FP8 deltas
    equal too (the plain MoE estimate is 4% under the measurement: router terms neglected)."""
    long = ["--seq-length", "256"]
    plain, fp8 = _saved([*long, "--bf16"]), _saved([*long, *FP8])
    assert plain[0] == plain[1] and fp8[0] == fp8[1]
    linears = ((64, 128), (64, 64), (64, 256), (128, 64))  # (fan_in, fan_out) per layer
    per_layer = sum(-512 * fan_in + fan_in * fan_out + 8 for fan_in, fan_out in linears)
    assert fp8[0] - plain[0] == 4 * per_layer == -507_776
    moe_plain, moe_fp8 = _saved(["--bf16", *MOE]), _saved([*FP8, *MOE])
    assert moe_fp8[0] - moe_plain[0] == moe_fp8[1] - moe_plain[1]


def test_fp8_amax_histories_are_counted() -> None:
    """--fp8-recipe delayed keeps, on every rank, the whole model's fp32 amax tables: 4 layers
    x 6 linear slots x 3 operands x (history 16 + the step's running amax) x 4 bytes = 4,896
    bytes. The tables the run builds hold exactly that, the planner's estimate counts it (in
    its total, not in the states), and the memory report prints both; tensorwise keeps none."""
    from megatron_lite.layers import fp8
    from megatron_lite.memory import memory_report

    flags = [*MODEL, "--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "16"]
    cfg, pstate = parse_config(flags), single_process_state()
    chunks = build_model(cfg, pstate)
    tables = fp8.history(cfg, pstate, chunks)
    est = estimate_memory(cfg, 1, stage=0, fused_kernels=False, device_type="cpu")
    assert tables.nbytes == est.fp8_state_bytes == 4 * 6 * 3 * 17 * 4 == 4_896
    plain = estimate_memory(parse_config([*flags, "--fp8-recipe", "tensorwise"]), 1, stage=0,
                            fused_kernels=False, device_type="cpu")
    assert plain.fp8_state_bytes == 0
    assert est.total_bytes - plain.total_bytes == 4_896
    text = memory_report(cfg, pstate, chunks, 0, 0, fp8_state_bytes=tables.nbytes)
    assert "fp8 amax histories (--fp8-amax-history-len 16) 4.78 KiB | 4.78 KiB" in text
