"""--compile under tensor, sequence and pipeline parallelism: same losses as eager, no graph breaks.

With TP each TransformerLayer is compiled in place. Dynamo traces through our TP/SP
communication (the autograd Functions in parallel/comms.py become functional collectives inside
the graph), so a layer is one graph even with sequence parallelism, and every layer reuses it.
Without TP the whole chunk (embedding, layers, head and loss) is one graph per stage. Compiling
takes ~25 s of CPU per process, so these are marked slow (not part of CI); the single-process
compiled curve is checked in CI by tests/test_regression.py.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.parallel.state import ParallelState
from megatron_lite.training import train
from tests.distributed import run_ranks

FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
         "4", "--ffn-hidden-size", "64", "--seq-length", "16", "--vocab-size", "97",
         "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "2e-3", "--train-iters", "4", "--eval-iters", "0",
         "--peak-tflops", "1"]
LAYOUTS = {
    "tp2-sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, 1),
    "pp2": (["--pipeline-model-parallel-size", "2"], 1, 2),
}


def _train(pstate: ParallelState, flags: list[str]) -> tuple[list[float], dict, dict]:
    """Losses plus Dynamo's counters (graphs compiled, graph breaks) from this rank."""
    from torch._dynamo.utils import counters

    with contextlib.redirect_stdout(io.StringIO()):
        losses = train(parse_config(flags), pstate).losses
    return losses, dict(counters["stats"]), dict(counters["graph_break"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_compiled_layout_matches_eager_single_process(tmp_path, layout: str) -> None:
    extra, tp, pp = LAYOUTS[layout]
    eager, _, _ = run_ranks(_train, 1, tmp_path, flags=FLAGS)[0]
    for losses, stats, breaks in run_ranks(_train, tp * pp, tmp_path, tp=tp, pp=pp,
                                           flags=[*FLAGS, *extra, "--compile"], timeout=600):
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, eager)), (losses, eager)
        assert breaks == {}, breaks
        assert stats.get("unique_graphs") == 1, stats  # every layer reuses one graph
