"""Expert parallelism equals one process in float64: EP2 (allgather and alltoall dispatch,
and alltoall under full recomputation and with --moe-shared-expert-overlap),
and over 10 steps EP4, EP2 x TP2 + SP (the shared expert overlapped), EP2 x CP2, EP2 x PP2
(interleaved), EP2 with ZeRO-1 and ZeRO-3 over expert-DP 2, with the weights' norm, per
iteration of loss, gradient norm, router losses and load imbalance."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_lite.checkpoint.files import resolve_checkpoint_dir
from megatron_lite.config import Config, MoEConfig, ParallelConfig
from megatron_lite.parallel.state import ParallelState, single_process_state
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
            "ep4-alltoall": (1, 1, 1, ["--expert-model-parallel-size", "4", *ALLTOALL])}


def _layouts(world: ParallelState, tmp: str) -> dict[str, dict[str, list[float]]]:
    runs = {}
    for name, (tp, cp, pp, flags) in LAYOUTS4.items():
        ep = 4 if name.startswith("ep4") else 2
        cfg = Config(parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                             context_parallel_size=cp,
                                             pipeline_model_parallel_size=pp),
                     moe=MoEConfig(num_experts=4, expert_model_parallel_size=ep))
        pstate = relayout(world, cfg)
        save = ["--save", f"{tmp}/{name}-ckpt"] if name.startswith("ep4") else []
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
    # every weight and Adam moment after the 10 steps, element by element: EP4 against one
    # process (the checkpoint gathers each EP rank's experts into the global tensors)
    got, want = (full_state(resolve_checkpoint_dir(tmp_path / d, None))
                 for d in ("ep4-alltoall-ckpt", "ref-ckpt"))
    assert sorted(got) == sorted(want) and any("experts" in n or n.endswith("mlp.gate_up")
                                               for n in got)
    for name in want:
        for kind in want[name]:
            assert_close(got[name][kind], want[name][kind], EXACT, f"{name} {kind}")
