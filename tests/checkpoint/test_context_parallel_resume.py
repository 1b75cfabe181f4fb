"""Checkpoints across CP sizes: CP replicas hold the same parameters, so a checkpoint saved at
CP=2 (optimizer sharded over DP x CP) resumes at CP=1 and the other way round, continuing with
the same samples: the resumed losses equal an uninterrupted run's. Float64 on every side, so
they match to EXACT (only the ring attention's summation order differs)."""

from __future__ import annotations

import json

from megatron_lite.arguments import parse_config
from megatron_lite.parallel.state import single_process_state
from tests.checkpoint.common import FLAGS, HALF, HALF_SAMPLES, ITERS, run_train
from tests.distributed import run_ranks
from tests.numerics import EXACT, assert_close

CP2 = ["--context-parallel-size", "2"]
ZERO1 = ["--use-distributed-optimizer"]


def _cp2_runs(pstate, first: str, second: str) -> tuple[list[float], list[float]]:
    """Both CP=2 runs in one spawn: save at HALF into `first`; resume from `second`."""
    head = run_train(pstate, [*CP2, *ZERO1, "--save", first, "--exit-interval", str(HALF)])
    back = run_train(pstate, [*CP2, *ZERO1, "--load", second])
    return head, back


def test_cp2_to_cp1_and_back(tmp_path) -> None:
    whole = run_train(single_process_state(), ZERO1)  # ITERS iterations, no checkpoint
    first, second = tmp_path / "from_cp2", tmp_path / "from_cp1"
    run_train(single_process_state(), [*ZERO1, "--save", str(second), "--exit-interval",
                                       str(HALF)])
    head, back = run_ranks(_cp2_runs, 2, tmp_path, cfg=parse_config([*FLAGS, *CP2, *ZERO1]),
                           first=str(first), second=str(second), timeout=300)[0]
    tail = run_train(single_process_state(), [*ZERO1, "--load", str(first)])
    assert len(head) == HALF and len(tail) == len(back) == ITERS - HALF
    assert_close([*head, *tail], whole, EXACT, "CP=2 then CP=1 losses")
    assert_close(back, whole[HALF:], EXACT, "CP=1 then CP=2 losses")
    meta = json.loads((first / f"iter_{HALF:07d}" / "metadata.json").read_text())
    assert meta["consumed_samples"] == HALF_SAMPLES  # the data position: any CP size
    assert meta["layout"]["cp"] == 2 and meta["layout"]["dp"] == 2  # DP x CP replicas
    assert sorted(f for f in meta["files"] if f.startswith("optim")) == [
        "optim_tp0_pp0_dp0.safetensors", "optim_tp0_pp0_dp1.safetensors"]
