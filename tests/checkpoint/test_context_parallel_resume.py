"""Checkpoints across CP sizes: CP replicas hold the same parameters, so a checkpoint saved at
CP=2 (optimizer sharded over DP x CP) resumes at CP=1 and the other way round, continuing with
the same samples: the resumed losses equal an uninterrupted run's."""

from __future__ import annotations

import json

from megatron_lite.arguments import parse_config
from megatron_lite.parallel.state import single_process_state
from tests.checkpoint.common import FLAGS, run_train
from tests.distributed import run_ranks

CP2 = ["--context-parallel-size", "2"]
ZERO1 = ["--use-distributed-optimizer"]


def _cp2(tmp_path, flags: list[str]) -> list[float]:
    cfg = parse_config([*FLAGS, *CP2, *flags])
    return run_ranks(run_train, 2, tmp_path, cfg=cfg, flags=[*CP2, *flags], timeout=300)[0]


def test_cp2_to_cp1_and_back(tmp_path) -> None:
    whole = run_train(single_process_state(), ZERO1)  # 6 iterations, no checkpoint
    first = tmp_path / "from_cp2"
    head = _cp2(tmp_path, [*ZERO1, "--save", str(first), "--exit-interval", "3"])
    tail = run_train(single_process_state(), [*ZERO1, "--load", str(first)])
    second = tmp_path / "from_cp1"
    run_train(single_process_state(), [*ZERO1, "--save", str(second), "--exit-interval", "3"])
    back = _cp2(tmp_path, [*ZERO1, "--load", str(second)])
    assert len(head) == 3 and len(tail) == len(back) == 3
    for got, want in zip([*head, *tail], whole, strict=True):
        assert abs(got - want) <= 1e-5, (head, tail, whole)
    for got, want in zip(back, whole[3:], strict=True):
        assert abs(got - want) <= 1e-5, (back, whole)
    meta = json.loads((first / "iter_0000003" / "metadata.json").read_text())
    assert meta["consumed_samples"] == 12  # the data position: the same at any CP size
    assert meta["layout"]["cp"] == 2 and meta["layout"]["dp"] == 2  # DP x CP replicas
    assert sorted(f for f in meta["files"] if f.startswith("optim")) == [
        "optim_tp0_pp0_dp0.safetensors", "optim_tp0_pp0_dp1.safetensors"]
