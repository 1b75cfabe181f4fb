"""Expert parallelism equals one process in float64: EP2 (allgather and alltoall dispatch,
and alltoall under full recomputation and with --moe-shared-expert-overlap),
and over 10 steps EP4, EP2 x TP2 + SP (the shared expert overlapped), EP2 x CP2, EP2 x PP2
(interleaved), EP2 with ZeRO-1 and ZeRO-3 over expert-DP 2, with the weights' norm, per
iteration of loss, gradient norm, router losses and load imbalance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_lite.checkpoint.files import resolve_checkpoint_dir
from megatron_lite.config import Config, ModelConfig, MoEConfig, ParallelConfig
from megatron_lite.layers.context import LayerContext
from megatron_lite.layers.moe import MoE
from megatron_lite.parallel.state import (
    ParallelState,
    group_lists,
    rank_grid,
    single_process_state,
)
from tests.checkpoint.common import full_state
from tests.distributed import relayout, run_ranks
from tests.layers.test_moe_training import FLAGS, TERMS, _run
from tests.numerics import EXACT, assert_close

EP2 = ["--expert-model-parallel-size", "2"]
LONG = ["--micro-batch-size", "1", "--train-iters", "10", "--log-params-norm"]
"""The 4-rank runs: 10 steps, and the weights' norm (every element once) logged each step."""
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]
"""Each layer's forward, all-to-alls and router included, rerun in backward: the router
losses must reach the gradients once and the statistics be counted once."""
ETP1 = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--expert-tensor-parallel-size", "1"]
"""TP2 + SP with whole experts: each TP rank's own tokens reach them (no TP gather)."""
# 4 ranks: (name, tp, cp, pp, extra flags); EP2 folds over the DP x CP = 4 / (tp pp) replicas
OVERLAP = ["--moe-shared-expert-overlap"]
"""The shared expert (its TP all-gather included under SP) runs during the token all-to-all."""
LAYOUTS4 = {"ep2-tp2-sp-alltoall-overlap": (2, 1, 1, ["--tensor-model-parallel-size", "2",
                                                      "--sequence-parallel", *ALLTOALL,
                                                      *OVERLAP]),
            "ep2-cp2-alltoall": (1, 2, 1, ["--context-parallel-size", "2", *ALLTOALL]),
            "ep2-pp2-interleaved": (1, 1, 2, ["--pipeline-model-parallel-size", "2",
                                              "--num-layers-per-virtual-pipeline-stage", "1"]),
            "ep2-zero1": (1, 1, 1, ["--use-distributed-optimizer"]),
            "ep2-zero3-alltoall": (1, 1, 1, ["--data-parallel-sharding-strategy",
                                             "optim_grads_params", *ALLTOALL]),
            "ep4-alltoall": (1, 1, 1, ["--expert-model-parallel-size", "4", *ALLTOALL]),
            # whole experts under TP2 + SP: EP over the TP ranks with ZeRO-1 over expert-DP
            # (the DP replicas), EP over all four ranks, and EP1 with ZeRO-3 over expert-DP
            # = TP x DP
            "ep2-tp2-sp-etp1-alltoall-zero1": (2, 1, 1, [*ETP1, *ALLTOALL,
                                                         "--use-distributed-optimizer"]),
            "ep4-tp2-sp-etp1-alltoall": (2, 1, 1, [*ETP1, *ALLTOALL,
                                                   "--expert-model-parallel-size", "4"]),
            "ep1-tp2-sp-etp1-zero3": (2, 1, 1, [*ETP1, "--expert-model-parallel-size", "1",
                                                "--data-parallel-sharding-strategy",
                                                "optim_grads_params"])}
SAVED = ("ep4-alltoall", "ep2-tp2-sp-etp1-alltoall-zero1")
"""The layouts whose weights and Adam moments after 10 steps are compared element by element."""


def _layouts(world: ParallelState, tmp: str) -> dict[str, dict[str, list[float]]]:
    runs = {}
    for name, (tp, cp, pp, flags) in LAYOUTS4.items():
        ep = int(name[2])
        cfg = Config(parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                             context_parallel_size=cp,
                                             pipeline_model_parallel_size=pp),
                     moe=MoEConfig(num_experts=4, expert_model_parallel_size=ep,
                                   expert_tensor_parallel_size=1 if "etp1" in name else None))
        pstate = relayout(world, cfg)
        save = ["--save", f"{tmp}/{name}-ckpt"] if name in SAVED else []
        runs[name] = _run(pstate, [*FLAGS, *EP2, *LONG, *flags, *save],
                          Path(tmp) / f"{name}-{world.rank}.jsonl", (*TERMS, "params_norm"))
    return runs


def _two_ranks(world: ParallelState, tmp: str) -> dict[str, dict[str, list[float]]]:
    cfg = Config(moe=MoEConfig(num_experts=4, expert_model_parallel_size=2))
    pstate = relayout(world, cfg)
    return {name: _run(pstate, [*FLAGS, *EP2, *flags], Path(tmp) / f"{name}-{world.rank}.jsonl")
            for name, flags in (("ep2-allgather", []), ("ep2-alltoall", ALLTOALL),
                                ("ep2-alltoall-full-recompute", [*ALLTOALL, *FULL_RECOMPUTE]),
                                ("ep2-alltoall-overlap", [*ALLTOALL, *OVERLAP]))}


def _check(got: dict[str, dict[str, list[float]]], ref: dict[str, list[float]]) -> None:
    for layout, run in got.items():
        for term in ref:
            for i, (a, b) in enumerate(zip(run[term], ref[term], strict=True)):
                assert_close(a, b, EXACT, f"{layout} {term} at {i + 1}")


@pytest.mark.quick
def test_ep2_equals_one_process(tmp_path: Path) -> None:
    ref = _run(single_process_state(), FLAGS, tmp_path / "ref.jsonl")
    _check(run_ranks(_two_ranks, 2, tmp_path, tmp=str(tmp_path))[0], ref)


@pytest.mark.slow
def test_ep4_and_ep2_compositions_equal_one_process_for_10_steps(tmp_path: Path) -> None:
    # the same micro-batches as the 4-rank runs: the aux loss is per micro-batch (a product
    # of two means over its tokens), so it depends on how the batch is cut
    ref = _run(single_process_state(), [*FLAGS, *LONG, "--save", str(tmp_path / "ref-ckpt")],
               tmp_path / "ref.jsonl", (*TERMS, "params_norm"))
    _check(run_ranks(_layouts, 4, tmp_path, tmp=str(tmp_path))[0], ref)
    # every weight and Adam moment after the 10 steps, element by element: EP4, and EP2 x
    # expert-TP 1 under TP2, against one process (the checkpoint gathers each (EP,
    # expert-TP) position's experts into the global tensors)
    want = full_state(resolve_checkpoint_dir(tmp_path / "ref-ckpt", None))
    for layout in SAVED:
        got = full_state(resolve_checkpoint_dir(tmp_path / f"{layout}-ckpt", None))
        assert sorted(got) == sorted(want) and any(n.endswith("mlp.gate_up") for n in got)
        for name in want:
            for kind in want[name]:
                assert_close(got[name][kind], want[name][kind], EXACT,
                             f"{layout}: {name} {kind}")


def _expert_tp(world: ParallelState, tmp: str) -> dict[str, dict[str, list[float]]]:
    runs = {}
    for name, ep, flags in (("tp2-etp1", 1, []),  # experts replicated over TP: expert-DP 2
                            ("tp2-etp1-ep2-alltoall", 2, [*EP2, *ALLTOALL]),  # EP = TP ranks
                            ("tp2-etp1-ep2-allgather", 2, EP2)):
        cfg = Config(parallel=ParallelConfig(tensor_model_parallel_size=2),
                     moe=MoEConfig(num_experts=4, expert_model_parallel_size=ep,
                                   expert_tensor_parallel_size=1))
        pstate = relayout(world, cfg)
        assert (pstate.etp_size, pstate.experts_apart, pstate.edp_size) == (1, True, 2 // ep)
        assert pstate.ep_rank == (pstate.tp_rank if ep == 2 else 0)  # EP over the TP ranks
        runs[name] = _run(pstate, [*FLAGS, *ETP1, *flags],
                          Path(tmp) / f"{name}-{world.rank}.jsonl")
    return runs


@pytest.mark.quick
def test_expert_tp1_under_tp2_equals_one_process(tmp_path: Path) -> None:
    """--expert-tensor-parallel-size 1 under TP2 + SP (parallel folding): whole experts,
    replicated over the TP ranks (their gradients summed over expert-DP, which now spans
    TP) or split over an EP group made of the TP ranks, equal one process in float64."""
    ref = _run(single_process_state(), FLAGS, tmp_path / "ref.jsonl")
    _check(run_ranks(_expert_tp, 2, tmp_path, tmp=str(tmp_path))[0], ref)


def test_expert_tp_folds_the_stage_ranks_expert_tp_innermost() -> None:
    """TP4 x DP2 read as edp x ep x etp: expert TP 2 takes consecutive TP ranks, EP 2 the
    two expert-TP blocks of one TP group, expert-DP the DP replicas; each rank's experts are
    cut over expert TP only (whole ones at expert TP 1)."""
    lists = group_lists(rank_grid(8, tp=4, pp=1), ep=2, etp=2)
    assert lists["etp_group"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lists["ep_group"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists["edp_group"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert "etp_group" not in group_lists(rank_grid(8, tp=4, pp=1), ep=2)  # = the TP group
    for etp in (1, 2):
        pstate = ParallelState(rank=1, world_size=2, local_rank=1, tp_size=2, tp_rank=1,
                               pp_size=1, pp_rank=0, dp_size=1, dp_rank=0, etp_size=etp,
                               etp_rank=1 % etp, device=torch.device("cpu"), backend=None)
        moe = MoEConfig(num_experts=4, moe_ffn_hidden_size=16, expert_tensor_parallel_size=etp)
        layer = MoE(ModelConfig(num_layers=1, hidden_size=8, ffn_hidden_size=16,
                                num_attention_heads=2), moe,
                    LayerContext.from_state(pstate, seed=1, moe=moe), 0)
        assert layer.gate_up.shape == (4 * 2 * 16 // etp, 8)
        assert layer.down.shape == (4 * 8, 16 // etp)
