"""End to end: the training loop at TP=1 vs TP=2/4 (+SP), in-process and through torchrun."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.training import train
from tests.distributed import run_ranks

ROOT = Path(__file__).resolve().parents[1]
# Odd vocab that needs padding at every TP size; GQA; loss over 10 steps.
FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
         "4", "--num-query-groups", "4", "--ffn-hidden-size", "64", "--seq-length", "16",
         "--vocab-size", "97", "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "2e-3", "--lr-warmup-iters", "2",
         "--train-iters", "10", "--eval-iters", "0", "--peak-tflops", "1"]


def _train(pstate: ParallelState, flags: list[str]) -> list[float]:
    return train(parse_config(flags), pstate).losses


@functools.cache
def _single_process_losses(flags: tuple[str, ...]) -> list[float]:
    """The reference run, in this process (no spawn), cached across layouts."""
    pstate = single_process_state()
    return train(parse_config(list(flags)), pstate).losses


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


LAYOUTS = {
    "tp2": (["--tensor-model-parallel-size", "2"], 2, 1),
    "tp4-sp": (["--tensor-model-parallel-size", "4", "--sequence-parallel"], 4, 1),
    # Tied embeddings split over the first and last stage, interleaved schedule.
    "pp2-v2": (["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "1"], 2, 2),
    "tp2-sp-full-recompute": (["--tensor-model-parallel-size", "2", "--sequence-parallel",
                               "--recompute-granularity", "full"], 2, 1),
    "pp2-selective-recompute": (["--pipeline-model-parallel-size", "2",
                                 "--recompute-granularity", "selective"], 2, 2),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_loss_curve_matches_single_process(tmp_path, layout: str) -> None:
    """The training loop (model, schedule, optimizer) under a parallel layout vs one process."""
    extra, world, pp = LAYOUTS[layout]
    single_flags = [*FLAGS, "--num-layers", "4"] if "--num-layers" in extra else FLAGS
    single = _single_process_losses(tuple(single_flags))
    tp = world // pp
    parallel = run_ranks(_train, world, tmp_path, tp=tp, pp=pp, flags=[*FLAGS, *extra])
    for rank_losses in parallel:
        assert all(_rel(a, b) <= 1e-5 for a, b in zip(rank_losses, single)), \
            (rank_losses, single)
    assert single[-1] < single[0]


def _read_losses(path: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def test_torchrun_tp2_sp_equals_single_process(tmp_path) -> None:
    """The issue's acceptance command, 20 iterations, odd vocab, JSONL compared per iteration."""
    flags = [*FLAGS, "--train-iters", "20"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = tmp_path / "tp1.jsonl"
    subprocess.run([sys.executable, "pretrain.py", *flags, "--log-jsonl", str(one)], cwd=ROOT,
                   env=env, check=True, capture_output=True, timeout=240)
    two = tmp_path / "tp2.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "pretrain.py", *flags, "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--log-jsonl", str(two)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _read_losses(one), _read_losses(two)
    assert len(a) == len(b) == 20
    assert all(_rel(x, y) <= 1e-5 for x, y in zip(b, a)), (a, b)
    assert a[-1] < a[0] - 0.1, "loss did not fall"
    record = json.loads(two.read_text().splitlines()[0])
    assert list(record)[:9] == ["iteration", "consumed_samples", "loss", "lr", "grad_norm",
                                "iter_time_ms", "tokens_per_sec", "tflops_per_device", "mfu"]
    assert {"data_wait_ms", "comm_wait_ms", "tokens_seen", "epoch"} <= set(record)


def test_torchrun_pp4_interleaved_trains(tmp_path) -> None:
    """The pipeline issue's acceptance command: PP=4, one layer per virtual stage (v=2)."""
    log = tmp_path / "pp4.jsonl"
    flags = [*FLAGS, "--num-layers", "8", "--pipeline-model-parallel-size", "4",
             "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "1",
             "--global-batch-size", "4", "--train-iters", "12", "--log-jsonl", str(log)]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
         "pretrain.py", *flags], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _read_losses(log)
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.1, losses


# Zero-bubble schedules: (extra flags, world, tp, pp); the DP layouts shard the optimizer and
# overlap both its gradient reduction (after the last W) and its parameter gather.
ZERO_BUBBLE_OVERLAP = ["--use-distributed-optimizer", "--overlap-grad-reduce",
                       "--overlap-param-gather", "--micro-batch-size", "1"]
ZERO_BUBBLE_LAYOUTS = {
    "pp2-zb-h1-tp2-sp-full-recompute": (
        ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1",
         "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--recompute-granularity", "full", "--micro-batch-size", "1"], 4, 2, 2),
    "pp2-zbv-tp2-sp-selective-recompute": (
        ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv", "--num-layers",
         "4", "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--recompute-granularity", "selective"], 4, 2, 2),
    "pp2-zb-h1-dp2-zero1-overlap": (
        ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1",
         *ZERO_BUBBLE_OVERLAP], 4, 1, 2),
    "pp2-zbv-dp2-zero1-overlap": (
        ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv", "--num-layers",
         "4", *ZERO_BUBBLE_OVERLAP], 4, 1, 2),
}


def _grad_norms(path: Path) -> list[float]:
    return [r["grad_norm"] for r in map(json.loads, path.read_text().splitlines())
            if "grad_norm" in r]


def _train_and_evaluate(pstate: ParallelState, flags: list[str]) -> list[float]:
    result = train(parse_config(flags), pstate)
    return result.losses + result.eval_losses


@pytest.mark.parametrize("layout", sorted(ZERO_BUBBLE_LAYOUTS))
def test_zero_bubble_loss_curve_matches_single_process(tmp_path, layout: str) -> None:
    """--pipeline-schedule zb-h1 / zbv through the whole training loop vs one process: the
    losses, the evaluation losses (forward-only schedule) and the global gradient norms
    (after the DP reduction, before clipping)."""
    extra, world, tp, pp = ZERO_BUBBLE_LAYOUTS[layout]
    single_flags = [*FLAGS, "--num-layers", "4"] if "--num-layers" in extra else FLAGS
    evaluation = ["--eval-iters", "1", "--eval-interval", "5"]
    single_log, parallel_log = tmp_path / "single.jsonl", tmp_path / "parallel.jsonl"
    single = _train_and_evaluate(single_process_state(), [
        *single_flags, *evaluation, "--log-jsonl", str(single_log)])
    parallel = run_ranks(_train_and_evaluate, world, tmp_path, tp=tp, pp=pp, timeout=240,
                         flags=[*FLAGS, *extra, *evaluation, "--log-jsonl", str(parallel_log)])
    assert len(single) == 12  # 10 steps, evaluations after 5 and 10
    for rank_losses in parallel:
        assert len(rank_losses) == len(single)
        assert all(_rel(a, b) <= 1e-5 for a, b in zip(rank_losses, single)), \
            (rank_losses, single)
    norms, reference = _grad_norms(parallel_log), _grad_norms(single_log)
    assert len(norms) == len(reference) == 10
    assert all(_rel(a, b) <= 1e-5 for a, b in zip(norms, reference)), (norms, reference)


def test_torchrun_pp4_zb_h1_equals_single_process(tmp_path) -> None:
    """The zero-bubble issue's acceptance command: PP=4 under ZB-H1 logs one process's losses."""
    flags = [*FLAGS, "--num-layers", "4", "--micro-batch-size", "1", "--train-iters", "12"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one, four = tmp_path / "pp1.jsonl", tmp_path / "pp4.jsonl"
    subprocess.run([sys.executable, "pretrain.py", *flags, "--log-jsonl", str(one)], cwd=ROOT,
                   env=env, check=True, capture_output=True, timeout=240)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
         "pretrain.py", *flags, "--pipeline-model-parallel-size", "4", "--pipeline-schedule",
         "zb-h1", "--log-jsonl", str(four)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _read_losses(one), _read_losses(four)
    assert len(a) == len(b) == 12
    assert all(_rel(x, y) <= 1e-5 for x, y in zip(b, a)), (a, b)
