"""End to end through `training.train`: DP=2 with and without ZeRO-1 (and its overlaps)
logs the same losses as one process on the same global batch (--fp64, within EXACT)."""

from __future__ import annotations

import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.training import train
from tests.distributed import run_ranks
from tests.numerics import assert_close

FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
         "4", "--ffn-hidden-size", "64", "--seq-length", "16", "--vocab-size", "97",
         "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "2e-3", "--lr-warmup-iters", "2",
         "--train-iters", "6", "--eval-iters", "0", "--peak-tflops", "1", "--fp64",
         "--log-interval", "1"]
ZERO1 = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
         "--ddp-bucket-size", "3000"]


def _losses(pstate: ParallelState, runs: list[list[str]]) -> list[list[float]]:
    return [train(parse_config(flags), pstate).losses for flags in runs]


@pytest.mark.quick
def test_dp2_losses_match_single_process(tmp_path) -> None:
    cfg = parse_config(FLAGS)
    assert cfg.train.fp64
    single = train(cfg, single_process_state()).losses
    ranks = run_ranks(_losses, 2, tmp_path, runs=[FLAGS, [*FLAGS, *ZERO1]])
    for plain, zero1 in ranks:
        assert_close(plain, single, what="DP=2 losses")
        assert_close(zero1, single, what="ZeRO-1 losses")
    assert single[-1] < single[0]
