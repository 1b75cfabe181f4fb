"""Checkpoints of expert-parallel runs (float64, 2 ranks): a resume at EP2 equals the
uninterrupted EP2 run bit for bit; an EP2 checkpoint continues at EP1 (ZeRO-1), an EP1
(ZeRO-1) checkpoint at EP2 (ZeRO-1) and an EP2 ZeRO-3 one (weights in the optimizer files)
at EP1 with the uninterrupted run's losses, optimizer state resharded; each EP rank's
experts are in their own files."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_lite.checkpoint import files as ckpt_files
from megatron_lite.config import Config, MoEConfig, ParallelConfig
from megatron_lite.parallel.state import ParallelState, single_process_state
from tests.distributed import relayout, run_ranks
from tests.layers.test_moe_training import FLAGS, _run
from tests.numerics import EXACT, assert_close

EP2 = ["--expert-model-parallel-size", "2"]
ZERO1 = ["--use-distributed-optimizer"]
ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]


def _runs(world: ParallelState, tmp: str) -> dict:
    """Every leg on the same 2 ranks; rank 0's losses per leg and the EP2 save's files."""
    root = Path(tmp)
    ep2 = relayout(world, Config(moe=MoEConfig(num_experts=4, expert_model_parallel_size=2)))

    def run(pstate: ParallelState, name: str, flags: list[str]) -> list[float]:
        return _run(pstate, [*FLAGS, *flags], root / f"{name}-{world.rank}.jsonl").get("loss")

    saved_ep2, saved_ep1, saved_zero3 = (str(root / name) for name in ("ep2", "ep1", "zero3"))
    out = {"straight": run(ep2, "straight", EP2)}
    run(ep2, "first", [*EP2, "--save", saved_ep2, "--save-interval", "2", "--exit-interval",
                       "2"])
    out["resumed"] = run(ep2, "resumed", [*EP2, "--load", saved_ep2])
    out["files"] = sorted(p.name for p in (root / "ep2" / "iter_0000002").iterdir())
    run(ep2, "first-zero3", [*EP2, *ZERO3, "--save", saved_zero3, "--save-interval", "2",
                             "--exit-interval", "2"])
    ep1 = relayout(ep2, Config())  # EP2 -> EP1, and EP1 saves at iteration 3
    out["zero3_to_ep1"] = run(ep1, "zero3-to-ep1", ["--load", saved_zero3])
    out["ep2_to_ep1"] = run(ep1, "ep2-to-ep1", [*ZERO1, "--load", saved_ep2, "--save",
                                                saved_ep1, "--save-interval", "3"])
    ep2 = relayout(ep1, Config(moe=MoEConfig(num_experts=4, expert_model_parallel_size=2)))
    out["ep1_to_ep2"] = run(ep2, "ep1-to-ep2", [*EP2, *ZERO1, "--load", saved_ep1,
                                                "--ckpt-step", "3"])
    return out


@pytest.mark.quick
def test_expert_parallel_checkpoints_resume_and_reshard(tmp_path: Path) -> None:
    got = run_ranks(_runs, 2, tmp_path, tmp=str(tmp_path))[0]
    straight = got["straight"]
    assert len(straight) == 4 and got["resumed"] == straight[2:]  # bit for bit
    for ep in range(2):
        assert ckpt_files.expert_model_file(0, 0, ep) in got["files"]
        assert ckpt_files.expert_optim_file(0, 0, ep, 0) in got["files"]
    for leg, expect in (("ep2_to_ep1", straight[2:]), ("ep1_to_ep2", straight[3:]),
                        ("zero3_to_ep1", straight[2:])):
        assert len(got[leg]) == len(expect), leg
        for i, (a, b) in enumerate(zip(got[leg], expect)):
            assert_close(a, b, EXACT, f"{leg} loss {i + 1}")


ETP1 = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--expert-tensor-parallel-size", "1"]


def _expert_tp_runs(world: ParallelState, tmp: str) -> dict:
    """TP2 + SP with whole experts over EP2 (the TP ranks): a resume there, and its save
    continued at TP2 with the experts split over TP (expert TP 2) and by one process."""
    root = Path(tmp)

    def layout(ep: int, etp: int | None, tp: int = 2) -> ParallelState:
        return relayout(world, Config(parallel=ParallelConfig(tensor_model_parallel_size=tp),
                                      moe=MoEConfig(num_experts=4, expert_model_parallel_size=ep,
                                                    expert_tensor_parallel_size=etp)))

    def run(pstate: ParallelState, name: str, flags: list[str]) -> list[float]:
        return _run(pstate, [*FLAGS, *flags], root / f"{name}-{world.rank}.jsonl").get("loss")

    saved = str(root / "etp1")
    folded = layout(2, 1)
    out = {"straight": run(folded, "straight", [*ETP1, *EP2, *ZERO1])}
    run(folded, "first", [*ETP1, *EP2, *ZERO1, "--save", saved, "--save-interval", "2",
                          "--exit-interval", "2"])
    out["resumed"] = run(folded, "resumed", [*ETP1, *EP2, *ZERO1, "--load", saved])
    out["files"] = sorted(p.name for p in (root / "etp1" / "iter_0000002").iterdir())
    out["to_etp2"] = run(layout(1, None), "to-etp2", ["--tensor-model-parallel-size", "2",
                                                      "--sequence-parallel", "--load", saved])
    return out


def _one_process_leg(tmp: str) -> list[float]:
    return _run(single_process_state(), [*FLAGS, "--load", str(Path(tmp) / "etp1")],
                Path(tmp) / "to-one.jsonl").get("loss")


@pytest.mark.quick
def test_expert_tp1_checkpoints_resume_and_reshard(tmp_path: Path) -> None:
    """Saved with whole experts spread over the TP ranks (each (EP, expert-TP) position's
    experts in their own files, named by expert-TP rank 0): resumed there bit for bit, and
    continued at TP2 with the experts cut over TP and by one process with the uninterrupted
    run's losses (float64), weights and Adam moments resharded."""
    got = run_ranks(_expert_tp_runs, 2, tmp_path, tmp=str(tmp_path))[0]
    straight = got["straight"]
    assert len(straight) == 4 and got["resumed"] == straight[2:]
    for ep in range(2):
        assert ckpt_files.expert_model_file(0, 0, ep) in got["files"]
        assert ckpt_files.expert_optim_file(0, 0, ep, 0) in got["files"]
    assert ckpt_files.expert_model_file(1, 0, 0) not in got["files"]  # no expert-TP rank 1
    for leg, losses in (("to_etp2", got["to_etp2"]), ("to_one", _one_process_leg(str(tmp_path)))):
        assert len(losses) == 2, leg
        for i, (a, b) in enumerate(zip(losses, straight[2:])):
            assert_close(a, b, EXACT, f"{leg} loss {i + 1}")
