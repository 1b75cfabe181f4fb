"""End to end: the training loop under TP / SP / PP (interleaved, zero-bubble) / DP + ZeRO-1 vs
one process, in-process and through torchrun.

Every comparison is an equivalence test (tests/numerics.py): both sides run `--fp64`, and the
losses, evaluation losses and global gradient norms (after the DP reduction, before clipping)
of every iteration must agree to `EXACT` (1e-10 relative). Measured on this machine the worst
relative error over all layouts is ~1e-15 (summation order only); a real bug moves them by 1e-3.

Spawning ranks costs more than the tiny runs themselves, so the in-process layouts of one world
size share one spawn (each layout builds its own groups on the started world), and the
single-process reference of a flag set is computed once, in this process.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.config import Config, ParallelConfig
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.training import train
from tests.distributed import relayout, run_ranks
from tests.numerics import assert_close

ROOT = Path(__file__).resolve().parents[1]
# Odd vocab that needs padding at every TP size; GQA; float64 end to end.
FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
         "4", "--num-query-groups", "4", "--ffn-hidden-size", "64", "--seq-length", "16",
         "--vocab-size", "97", "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "2e-3", "--lr-warmup-iters", "2",
         "--train-iters", "10", "--eval-iters", "0", "--peak-tflops", "1", "--fp64",
         "--log-interval", "1"]
# Evaluation after 5 and 10 steps runs the forward-only schedule of every layout.
EVALUATION = ["--eval-iters", "1", "--eval-interval", "5"]


class Run(NamedTuple):
    """What a run logged: per-iteration losses and grad norms, and its evaluation losses."""

    losses: list[float]
    grad_norms: list[float]
    eval_losses: list[float]


def _read_log(path: Path, key: str) -> list[float]:
    return [r[key] for r in map(json.loads, path.read_text().splitlines()) if key in r]


def _read_losses(path: Path) -> list[float]:
    return _read_log(path, "loss")


def _train_logged(pstate: ParallelState, flags: list[str], log: Path) -> Run:
    result = train(parse_config([*flags, "--log-jsonl", str(log)]), pstate)
    norms = _read_log(log, "grad_norm") if pstate.rank == 0 else []
    return Run(result.losses, norms, result.eval_losses)


@functools.cache
def single_process_run(flags: tuple[str, ...]) -> Run:
    """The reference: one plain process (no spawn, no torch.distributed), cached per flags."""
    with tempfile.TemporaryDirectory() as tmp:
        return _train_logged(single_process_state(), list(flags), Path(tmp) / "log.jsonl")


def assert_same_curve(got: list[float], ref: list[float], what: str, length: int) -> float:
    """Same length, every iteration within EXACT; returns the worst relative error."""
    assert len(got) == len(ref) == length, (what, got, ref)
    return max((assert_close(a, b, what=f"{what} at {i + 1}")
                for i, (a, b) in enumerate(zip(got, ref))), default=0.0)


def assert_same_run(got: Run, ref: Run, steps: int, evals: int) -> None:
    worst = {"loss": assert_same_curve(got.losses, ref.losses, "loss", steps),
             "eval": assert_same_curve(got.eval_losses, ref.eval_losses, "eval loss", evals)}
    if got.grad_norms:  # rank 0 logs them
        worst["grad norm"] = assert_same_curve(got.grad_norms, ref.grad_norms, "grad norm",
                                               steps)
    print("worst relative error:", {k: f"{v:.1e}" for k, v in worst.items()})


class Layout(NamedTuple):
    flags: list[str]
    tp: int
    pp: int
    world: int


# The DP layouts shard the optimizer and overlap both its gradient reduction (after the last
# backward / W pass) and its parameter gather.
OVERLAP = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
           "--micro-batch-size", "1"]
LAYOUTS = {
    "tp2": Layout(["--tensor-model-parallel-size", "2"], 2, 1, 2),
    "tp4-sp": Layout(["--tensor-model-parallel-size", "4", "--sequence-parallel"], 4, 1, 4),
    # Tied embeddings split over the first and last stage, interleaved schedule.
    "pp2-v2": Layout(["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                      "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size",
                      "1"], 1, 2, 2),
    "tp2-sp-full-recompute": Layout(["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                     "--recompute-granularity", "full"], 2, 1, 2),
    "pp2-selective-recompute": Layout(["--pipeline-model-parallel-size", "2",
                                       "--recompute-granularity", "selective"], 1, 2, 2),
    # Zero-bubble schedules (their W passes, the V placement of zbv) with TP/SP and DP.
    "pp2-zb-h1-tp2-sp-full-recompute": Layout(
        ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1",
         "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--recompute-granularity", "full", "--micro-batch-size", "1"], 2, 2, 4),
    "pp2-zbv-tp2-sp-selective-recompute": Layout(
        ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv", "--num-layers",
         "4", "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--recompute-granularity", "selective"], 2, 2, 4),
    "pp2-zb-h1-dp2-zero1-overlap": Layout(
        ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1", *OVERLAP],
        1, 2, 4),
    "pp2-zbv-dp2-zero1-overlap": Layout(
        ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv", "--num-layers",
         "4", *OVERLAP], 1, 2, 4),
}


def layout_state(world: ParallelState, tp: int, pp: int) -> ParallelState:
    """A layout's groups built on an already started world, so that several layouts of one
    world size share one spawn (tests/distributed.py: `relayout`)."""
    return relayout(world, Config(parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                                          pipeline_model_parallel_size=pp)))


def _train_layouts(world: ParallelState, names: list[str], log_dir: Path) -> dict[str, Run]:
    out = {}
    for name in names:
        layout = LAYOUTS[name]
        out[name] = _train_logged(layout_state(world, layout.tp, layout.pp),
                                  [*FLAGS, *layout.flags, *EVALUATION],
                                  log_dir / f"{name}.jsonl")
    return out


@pytest.fixture(scope="module")
def layout_runs(request, tmp_path_factory):
    """name -> every rank's Run. The layouts of one world size selected in this session train
    in one spawn, on first use."""
    wanted = {item.callspec.params["layout"] for item in request.session.items
              if getattr(item, "originalname", "") == "test_loss_curve_matches_single_process"
              and hasattr(item, "callspec")}
    runs: dict[int, dict[str, list[Run]]] = {}

    def get(name: str) -> list[Run]:
        world = LAYOUTS[name].world
        if world not in runs:
            names = sorted(n for n in wanted | {name} if LAYOUTS[n].world == world)
            tmp = tmp_path_factory.mktemp(f"world{world}")
            per_rank = run_ranks(_train_layouts, world, tmp, timeout=280, names=names,
                                 log_dir=tmp)
            runs[world] = {n: [rank[n] for rank in per_rank] for n in names}
        return runs[world][name]

    return get


@pytest.mark.parametrize("layout", [pytest.param(n, marks=pytest.mark.quick) if n == "tp2"
                                    else n for n in sorted(LAYOUTS)])
def test_loss_curve_matches_single_process(layout_runs, layout: str) -> None:
    """The training loop (model, schedule, optimizer, evaluation) under a parallel layout vs
    one process: losses, evaluation losses and gradient norms of 10 steps within EXACT."""
    extra = LAYOUTS[layout].flags
    single_flags = [*FLAGS, "--num-layers", "4"] if "--num-layers" in extra else FLAGS
    single = single_process_run((*single_flags, *EVALUATION))
    assert single.losses[-1] < single.losses[0]
    for rank_run in layout_runs(layout):
        assert_same_run(rank_run, single, steps=10, evals=2)


def _torchrun(nproc: int, flags: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nproc}", "pretrain.py", *flags], cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _logged(path: Path) -> Run:
    return Run(_read_losses(path), _read_log(path, "grad_norm"), [])


@pytest.mark.slow
def test_torchrun_tp2_sp_equals_single_process(tmp_path) -> None:
    """The issue's acceptance command, 20 iterations, odd vocab: its JSONL losses and grad
    norms equal one plain process's per iteration (EXACT), and the record has its fields."""
    flags = [*FLAGS, "--train-iters", "20"]
    two = tmp_path / "tp2.jsonl"
    _torchrun(2, [*flags, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                  "--log-jsonl", str(two)])
    single = single_process_run(tuple(flags))
    assert_same_run(_logged(two), single, steps=20, evals=0)
    assert single.losses[-1] < single.losses[0] - 0.1, "loss did not fall"
    record = json.loads(two.read_text().splitlines()[0])
    assert list(record)[:9] == ["iteration", "consumed_samples", "loss", "lr", "grad_norm",
                                "iter_time_ms", "tokens_per_sec", "tflops_per_device", "mfu"]
    assert {"data_wait_ms", "comm_wait_ms", "tokens_seen", "epoch"} <= set(record)


def test_torchrun_moe_ep2_tp2_equals_single_process(tmp_path) -> None:
    """The MoE issue's acceptance command: 4 ranks, 8 experts top-2, EP2 x TP2 (DP 2 folded
    into EP 2), 10 iterations: the JSONL losses and grad norms equal one process's (EXACT)."""
    flags = [*FLAGS, "--num-experts", "8", "--moe-router-topk", "2",
             "--moe-aux-loss-coeff", "1e-2"]
    log = tmp_path / "moe.jsonl"
    _torchrun(4, [*flags, "--expert-model-parallel-size", "2", "--tensor-model-parallel-size",
                  "2", "--log-jsonl", str(log)])
    assert_same_run(_logged(log), single_process_run(tuple(flags)), steps=10, evals=0)


@pytest.mark.slow
def test_torchrun_pp4_interleaved_trains(tmp_path) -> None:
    """The pipeline issue's acceptance command: PP=4, one layer per virtual stage (v=2); its
    12 losses fall and equal one process's."""
    log = tmp_path / "pp4.jsonl"
    flags = [*FLAGS, "--num-layers", "8", "--micro-batch-size", "1", "--train-iters", "12"]
    _torchrun(4, [*flags, "--pipeline-model-parallel-size", "4",
                  "--num-layers-per-virtual-pipeline-stage", "1", "--log-jsonl", str(log)])
    losses = _read_losses(log)
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.1, losses
    assert_same_run(_logged(log), single_process_run(tuple(flags)), steps=12, evals=0)


@pytest.mark.slow
def test_torchrun_pp4_zb_h1_equals_single_process(tmp_path) -> None:
    """The zero-bubble issue's acceptance command: PP=4 under ZB-H1 logs one process's losses
    and grad norms (EXACT)."""
    flags = [*FLAGS, "--num-layers", "4", "--micro-batch-size", "1", "--train-iters", "12"]
    four = tmp_path / "pp4.jsonl"
    _torchrun(4, [*flags, "--pipeline-model-parallel-size", "4", "--pipeline-schedule",
                  "zb-h1", "--log-jsonl", str(four)])
    assert_same_run(_logged(four), single_process_run(tuple(flags)), steps=12, evals=0)
