"""MoE in the rank dry run and the planner: every rank of an EP layout builds, steps and
matches its collectives on the meta device; the planner's states are the meta build's bytes;
its parameter counts are the modules'; the Mixtral-like launch script dry-runs."""

from __future__ import annotations

import functools
import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import pretrain
from megatron_lite.arguments import parse_config
from megatron_lite.config import ModelConfig, MoEConfig
from megatron_lite.dry_run import run_rank
from megatron_lite.layers.context import LayerContext
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.parallel.audit import CommOp, match
from megatron_lite.parallel.state import single_process_state
from megatron_lite.planner import (
    Cluster,
    Layout,
    Recompute,
    RunOptions,
    evaluate,
    moe_dispatch_s,
    moe_stage_params,
    stage_params,
)

ROOT = Path(__file__).resolve().parents[1]
TINY_MOE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--seq-length", "32", "--vocab-size", "250",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--num-experts", "4",
            "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
            "--expert-model-parallel-size", "2", "--bf16", "--use-distributed-optimizer"]


@functools.cache
def _ranks(dispatcher: str) -> dict:
    cfg = parse_config([*TINY_MOE, "--moe-token-dispatcher-type", dispatcher, "--dry-run"])
    return {r: run_rank(cfg, 4, r, time_host=False) for r in range(4)}


def _states_are_the_planners(results, activations: float) -> None:
    """Every rank's parameter, gradient and optimizer bytes within 1% of the planner's, its
    activation peak within `activations`."""
    for res in results:
        for measured, planned in ((res.params_bytes, res.planner_params_bytes),
                                  (res.grads_bytes, res.planner_grads_bytes),
                                  (res.optimizer_bytes, res.planner_optimizer_bytes)):
            assert abs(measured / planned - 1) < 0.01
        assert abs(res.activation_bytes / res.planner_activation_bytes - 1) < activations


@pytest.mark.quick
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_ep2_dry_run_matches_and_its_states_are_the_planners(dispatcher: str) -> None:
    """EP2 on DP4: EP groups {0, 1}, {2, 3}, expert-DP {0, 2}, {1, 3}; the dispatch runs over
    the EP group and the expert gradients over expert-DP."""
    results = _ranks(dispatcher)
    assert match({r: res.ops for r, res in results.items()}) is None
    kinds = {(op.op, op.group) for op in results[0].ops}
    dispatch = "all_to_all" if dispatcher == "alltoall" else "all_gather"
    assert (dispatch, (0, 1)) in kinds
    assert any(group == (0, 2) for _, group in kinds)  # the experts' own sync group
    _states_are_the_planners(results.values(), 0.10)


@pytest.mark.parametrize(("tp", "ep", "shared"), [(1, 2, None), (2, 4, 32)])
def test_planner_moe_parameters_are_a_meta_builds(tp: int, ep: int, shared: int | None) -> None:
    """Each (TP, EP) rank's parameters: the dense ones TP-split, E/ep experts, router whole."""
    model = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4,
                        num_query_groups=2, ffn_hidden_size=48, seq_length=8, vocab_size=101,
                        make_vocab_size_divisible_by=4)
    moe = MoEConfig(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16,
                    moe_shared_expert_intermediate_size=shared, moe_layer_freq="[1,0,1]",
                    expert_model_parallel_size=ep)
    pstate = replace(single_process_state(torch.device("meta")), tp_size=tp, etp_size=tp,
                     ep_size=ep, ep_rank=ep - 1)
    ctx = LayerContext.from_state(pstate, seed=0, moe=moe)
    chunk = LlamaChunk(model, ctx, range(3), pre_process=True, post_process=True)
    built = sum(p.numel() for p in chunk.parameters())
    dense_change, routed = moe_stage_params(model, moe, tp, ep, [0, 1, 2])
    assert stage_params(model, tp, 1, 0, 3) + dense_change + routed == built
    experts = sum(p.numel() for n, p in chunk.named_parameters()
                  if n.endswith(("mlp.gate_up", "mlp.down")))
    assert routed == experts == 2 * (8 // ep) * 3 * 32 * 16 // tp


def test_mixtral_script_dry_runs_beside_the_planner(tmp_path, capsys) -> None:
    """scripts/pretrain_mixtral_8x7b.sh's own command line (bash execs a stub that records it),
    run here with 8 of its 32 layers and 2 micro-batches: ranks 0 (first stage) and 63 (last)
    of its 64."""
    argv_file, stub, out = tmp_path / "argv", tmp_path / "python", tmp_path / "dry.jsonl"
    stub.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {argv_file}\n')
    stub.chmod(0o755)
    env = {**os.environ, "DRY_RUN": "0 63", "PYTHON": str(stub), "GBS": "64",
           "EXTRA_ARGS": f"--log-jsonl {out}", "RUN_DIR": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "pretrain_mixtral_8x7b.sh")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    program, *argv = argv_file.read_text().splitlines()
    assert program == "pretrain.py"
    argv[argv.index("--num-layers") + 1] = "8"  # 2 stages x 2 chunks of 2 layers
    argv[argv.index("--num-layers-per-virtual-pipeline-stage") + 1] = "2"
    assert "--expert-model-parallel-size" in argv and "--world-size" in argv
    capsys.readouterr()
    assert pretrain.main(argv) == 0
    stdout = capsys.readouterr().out
    assert "world size 64 = pp 2 x dp 32 x tp 1" in stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["rank"] for r in records] == [0, 63]
    for r in records:
        for kind in ("params", "grads", "optimizer"):
            assert abs(r[f"{kind}_bytes"] / r[f"planner_{kind}_bytes"] - 1) < 0.01, (kind, r)
        assert abs(r["activation_bytes"] / r["planner_activation_bytes"] - 1) < 0.10, r


def test_dispatch_time_is_the_all_to_all_bytes_over_nvlink_or_the_network() -> None:
    """alltoall: 4 exchanges (dispatch, combine; forward, backward) of tokens x top-k x h x 2
    bytes per MoE layer, (ep-1)/ep of them leaving the rank; NVLink while TP x EP fits in a
    node, the network beyond."""
    model = ModelConfig(num_layers=4, hidden_size=1024, num_attention_heads=8,
                        ffn_hidden_size=2048, seq_length=2048, vocab_size=1000)
    moe = MoEConfig(num_experts=16, moe_router_topk=4, moe_token_dispatcher_type="alltoall")
    c = Cluster(gpus=64)
    for tp, ep, gbps in ((2, 4, c.intra_node_gbps), (2, 8, c.inter_node_gbps)):
        lay = Layout(tp, 1, 64 // tp, 1, 2, "optim", Recompute(), True, ep=ep)
        one = 2 * 2048 * 4 * 1024 * 2 * (ep - 1) / ep / (gbps * 1e9) + 2 * c.latency_us * 1e-6
        assert moe_dispatch_s(model, moe, lay, c, 3) == pytest.approx(3 * 4 * one)
    assert moe_dispatch_s(model, moe, replace(lay, ep=1), c, 3) == 0.0


def test_expert_states_are_timed_over_expert_dp() -> None:
    """ZeRO-1 with EP: the optimizer step reads each owned element's 34 bytes, the dense
    parameters' 1/(DP x CP) and the experts' 1/(DP x CP / EP) (their own sync group)."""
    model = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=4,
                        ffn_hidden_size=512, seq_length=128, vocab_size=1000)
    moe = MoEConfig(num_experts=8, moe_router_topk=2)
    c = Cluster(gpus=16)
    lay = Layout(1, 1, 16, 1, 1, "optim", Recompute(), False, ep=4)
    plan = evaluate(model, lay, c, 16, 1e9, RunOptions(moe=moe))
    dense_change, routed = moe_stage_params(model, moe, 1, 4, [0, 1])
    dense = plan.memory.params - routed
    assert routed and plan.memory.params == stage_params(model, 1, 1, 0, 2) + dense_change + routed
    assert plan.optimizer_s == pytest.approx(34 * (dense / 16 + routed / 4) / (c.hbm_gbps * 1e9))


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_zero3_moe_peak_is_the_planners(ep: int) -> None:
    """ZeRO-3 gathers a MoE layer's dense part and its E/ep experts as one unit (two buffers)
    and cuts the experts' gradients into their own buckets: the dry run's activation peak
    (gathered units and gradient buckets included) stays within the planner's. Measured at
    4 layers, 4 ranks: 1.24 / 1.07 / 0.92 for EP 1 / 2 / 4 (1.50 / 0.93 / 0.92 while the
    planner's units were the dense layer's; without ZeRO-3 EP1's MoE alone is 1.16)."""
    cfg = parse_config(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads",
                        "4", "--num-query-groups", "2", "--seq-length", "32", "--vocab-size",
                        "250", "--micro-batch-size", "1", "--num-experts", "4",
                        "--moe-ffn-hidden-size", "64", "--moe-router-topk", "2",
                        "--expert-model-parallel-size", str(ep),
                        "--data-parallel-sharding-strategy", "optim_grads_params",
                        "--global-batch-size", "4", "--bf16", "--dry-run"])
    r = run_rank(cfg, 4, 0, time_host=False)
    assert 0.85 <= r.activation_bytes / r.planner_activation_bytes <= 1.3


def test_shared_expert_overlap_dry_runs_with_its_collectives_matched() -> None:
    """EP2 x TP2 + SP with --moe-shared-expert-overlap: the token all-to-all is posted, the
    shared expert's own TP all-gather runs while it is in flight, then it is waited for;
    every rank posts them in that order, so the four ranks' collectives match."""
    cfg = parse_config([*TINY_MOE, "--moe-token-dispatcher-type", "alltoall",
                        "--moe-shared-expert-intermediate-size", "64",
                        "--moe-shared-expert-gate", "--moe-shared-expert-overlap",
                        "--tensor-model-parallel-size", "2", "--sequence-parallel",
                        "--global-batch-size", "2", "--dry-run"])
    results = {r: run_rank(cfg, 4, r, time_host=False) for r in range(4)}
    assert match({r: res.ops for r, res in results.items()}) is None
    ops = [(op.op, op.group) for op in results[0].ops]
    first = ops.index(("all_to_all", (0, 2)))  # the counts, then the rows (EP group {0, 2})
    # the shared expert's SP gather (TP group {0, 1}) before the combine's all-to-all; without
    # the overlap the combine comes straight after the rows
    assert ops[first + 1:first + 4] == [("all_to_all", (0, 2)), ("all_gather", (0, 1)),
                                        ("reduce_scatter", (0, 1))]


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_tp1_folds_ep_over_the_tp_ranks_in_the_dry_run(ep: int) -> None:
    """TP2 + SP x DP2 with --expert-tensor-parallel-size 1: the token all-to-all runs over
    the TP group (EP2) or all four ranks (EP4), every rank's collectives match, and the
    planner's states (whole experts, sharded over expert-DP) are the meta build's within 1%
    (measured 0.1-0.2%; activations 1.09)."""
    cfg = parse_config([*TINY_MOE, "--moe-token-dispatcher-type", "alltoall",
                        "--tensor-model-parallel-size", "2", "--sequence-parallel",
                        "--global-batch-size", "2", "--expert-tensor-parallel-size", "1",
                        "--expert-model-parallel-size", str(ep), "--dry-run"])
    results = {r: run_rank(cfg, 4, r, time_host=False) for r in range(4)}
    assert match({r: res.ops for r, res in results.items()}) is None
    groups = {op.group for op in results[0].ops if op.op == "all_to_all"}
    assert groups == ({(0, 1)} if ep == 2 else {(0, 1, 2, 3)})
    _states_are_the_planners(results.values(), 0.15)


@pytest.mark.quick
def test_uneven_all_to_alls_match_pairwise_by_their_splits() -> None:
    """Under real routing each rank exchanges different row counts: the audit matches rank
    i's rows sent to j with j's rows received from i, and names a pair that disagrees."""
    def op(recv: tuple[int, int], send: tuple[int, int]) -> CommOp:
        return CommOp("all_to_all", (0, 1), "bfloat16", ((sum(recv), 4), (sum(send), 4)), 0,
                      site="moe.py:1 (_all_to_all)", splits=(recv, send))

    assert match({0: [op((3, 2), (3, 4))], 1: [op((4, 6), (2, 6))]}) is None
    problem = match({0: [op((3, 2), (3, 4))], 1: [op((3, 6), (2, 6))]})
    assert "rank 0 sends 4 rows to rank 1, which receives 3" in problem
