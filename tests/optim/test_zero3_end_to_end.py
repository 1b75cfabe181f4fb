"""ZeRO-3 through the training loop: torchrun vs one process, and checkpoints across layouts.

A ZeRO-3 checkpoint holds no gathered model: every rank writes its optimizer shard, whose
masters are the weights (cast to the model dtype exactly as the step casts them), so any
strategy and layout can resume from it. Everything runs --fp64 and compares within EXACT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.training import train
from tests.checkpoint.common import relayout
from tests.distributed import run_ranks
from tests.numerics import assert_close

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
         "4", "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "16",
         "--vocab-size", "97", "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "1",
         "--global-batch-size", "8", "--lr", "2e-3", "--lr-warmup-iters", "2",
         "--eval-iters", "0", "--peak-tflops", "1", "--fp64", "--log-interval", "1"]
"""float64 (equivalence, tests/numerics.py: EXACT); odd vocabulary (padded), GQA; 8 samples:
2 or 4 micro-batches per rank at DP 4 or 2."""
ZERO3 = ["--data-parallel-sharding-strategy", "optim_grads_params"]


def _read_losses(path: Path, key: str = "loss") -> list[float]:
    return [r[key] for r in map(json.loads, path.read_text().splitlines()) if key in r]


@pytest.mark.slow
def test_torchrun_zero3_equals_single_process(tmp_path) -> None:
    """The issue's acceptance command: two ZeRO-3 ranks log one plain process's losses, and
    its evaluations (forward only: gathered and freed without a backward) agree too."""
    flags = [*FLAGS, "--train-iters", "6", "--eval-iters", "1", "--eval-interval", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one, two = tmp_path / "one.jsonl", tmp_path / "zero3.jsonl"
    subprocess.run([sys.executable, "pretrain.py", *flags, "--log-jsonl", str(one)], cwd=ROOT,
                   env=env, check=True, capture_output=True, timeout=240)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "pretrain.py", *flags, *ZERO3, "--log-jsonl", str(two)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _read_losses(one), _read_losses(two)
    assert len(a) == len(b) == 6
    assert_close(b, a, what="losses")
    assert a[-1] < a[0]
    evals = [_read_losses(log, "eval_loss") for log in (one, two)]
    assert len(evals[0]) == len(evals[1]) == 2
    assert_close(evals[1], evals[0], what="eval losses")


def _runs(pstate: ParallelState, runs: list[list[str]]) -> list[list[float]]:
    return [train(parse_config(flags), pstate).losses for flags in runs]


def _resume_runs(pstate: ParallelState, dp4: list[list[str]], tp2: list[list[str]]
                 ) -> tuple[list[list[float]], list[list[float]]]:
    """The DP=4 runs, then the TP=2 x DP=2 ones on the same ranks (one spawn)."""
    return _runs(pstate, dp4), _runs(relayout(pstate, 2, 1), tp2)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict[str, list[float]]:
    """ZeRO-3 at DP=4 (float64): 4 steps straight, and 2 steps saved then resumed for 2 more at
    DP=4 (ZeRO-3), and at TP=2 x DP=2 under optim and under optim_grads_params."""
    tmp = tmp_path_factory.mktemp("zero3_ckpt")
    base = FLAGS
    save = ["--save", str(tmp / "ckpt"), "--save-interval", "2"]
    load = ["--train-iters", "4", "--load", str(tmp / "ckpt"), "--tensor-model-parallel-size",
            "2", "--sequence-parallel"]
    dp4, tp2 = zip(*run_ranks(_resume_runs, 4, tmp, timeout=400, dp4=[
        [*base, *ZERO3, "--train-iters", "4"],
        [*base, *ZERO3, "--train-iters", "2", *save],
        [*base, *ZERO3, "--train-iters", "4", "--load", str(tmp / "ckpt")]], tp2=[
        [*base, "--data-parallel-sharding-strategy", "optim", *load],
        [*base, *ZERO3, *load]]))
    files = sorted(p.name for p in (tmp / "ckpt" / "iter_0000002").iterdir())
    return {"straight": dp4[0][0], "first": dp4[0][1], "same": dp4[0][2],
            "optim_tp2": tp2[0][0], "zero3_tp2": tp2[0][1], "files": files}


def test_resume_same_layout_is_exact(resumed) -> None:
    assert resumed["first"] == resumed["straight"][:2]
    assert resumed["same"] == resumed["straight"][2:]


def test_resume_under_optim_at_tp2_dp2(resumed) -> None:
    """The next step's loss reads only the weights: bit-exact between optim and ZeRO-3 at the
    new layout, and both resumed runs within EXACT of the uninterrupted one (float64; the
    bf16 version needed 1e-3 for TP's rounding)."""
    assert resumed["optim_tp2"][0] == resumed["zero3_tp2"][0]
    for run in ("optim_tp2", "zero3_tp2"):
        assert len(resumed[run]) == 2
        assert_close(resumed[run], resumed["straight"][2:], what=run)


def test_checkpoint_holds_shards_only(resumed) -> None:
    """One optimizer file per DP rank (the shards); the model file carries only the layout."""
    assert [f for f in resumed["files"] if f.startswith("optim_")] == [
        f"optim_tp0_pp0_dp{d}.safetensors" for d in range(4)]


def test_untied_output_layer_matches_single_process(tmp_path) -> None:
    """Untied head (its own unit; the embedding is freed right after its forward) with full
    recomputation, through the training loop at DP=2 vs one process."""
    flags = [*FLAGS, "--train-iters", "4", "--untie-embeddings-and-output-weights",
             "--recompute-granularity", "full"]
    single = train(parse_config(flags), single_process_state()).losses
    zero3 = run_ranks(_runs, 2, tmp_path, timeout=240, runs=[[*flags, *ZERO3]])
    for rank in zero3:
        assert len(rank[0]) == len(single) == 4
        assert_close(rank[0], single, what="losses")
