"""The CP acceptance command: torchrun, 4 CPU processes, CP=2 x TP=2 with SP, 20 iterations,
its --log-jsonl losses equal to one plain process's."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.test_pretrain import FLAGS, ROOT, _read_losses, _rel


def test_torchrun_cp2_tp2_sp_equals_single_process(tmp_path) -> None:
    flags = [*FLAGS, "--train-iters", "20"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = tmp_path / "single.jsonl"
    subprocess.run([sys.executable, "pretrain.py", *flags, "--log-jsonl", str(one)], cwd=ROOT,
                   env=env, check=True, capture_output=True, timeout=300)
    four = tmp_path / "cp2_tp2.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
         "pretrain.py", "--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
         "--sequence-parallel", *flags, "--log-jsonl", str(four)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dp0cp1:tp[2, 3]" in proc.stdout  # the grid: CP between TP and DP
    a, b = _read_losses(one), _read_losses(four)
    assert len(a) == len(b) == 20
    assert all(abs(x - y) <= 1e-5 and _rel(x, y) <= 1e-5 for x, y in zip(b, a)), (a, b)
    assert a[-1] < a[0] - 0.1, "loss did not fall"
