"""The CP acceptance command: torchrun, 4 CPU processes, CP=2 x TP=2 with SP, 20 iterations,
its --log-jsonl losses and grad norms equal to one plain process's (both `--fp64`, EXACT:
measured worst relative error ~1e-15; ring attention's float64 accumulators keep the online
softmax in float64)."""

from __future__ import annotations

import pytest

from tests.test_pretrain import FLAGS, _logged, _torchrun, assert_same_run, single_process_run


@pytest.mark.slow
def test_torchrun_cp2_tp2_sp_equals_single_process(tmp_path) -> None:
    flags = [*FLAGS, "--train-iters", "20"]
    four = tmp_path / "cp2_tp2.jsonl"
    proc = _torchrun(4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                         "--sequence-parallel", *flags, "--log-jsonl", str(four)])
    assert "dp0cp1:tp[2, 3]" in proc.stdout  # the grid: CP between TP and DP
    single = single_process_run(tuple(flags))
    assert_same_run(_logged(four), single, steps=20, evals=0)
    assert single.losses[-1] < single.losses[0] - 0.1, "loss did not fall"
