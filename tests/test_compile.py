"""--compile under tensor, sequence and pipeline parallelism: same losses as eager, no graph breaks.

With TP each TransformerLayer is compiled in place. Dynamo traces through our TP/SP
communication (the autograd Functions in parallel/comms.py become functional collectives inside
the graph), so a layer is one graph even with sequence parallelism, and every layer reuses it.
Without TP the whole chunk (embedding, layers, head and loss) is one graph per stage.

Both sides run `--fp64`, so compiled vs eager is an equivalence test at `EXACT`: Inductor's
fusions only change the order of float64 sums (measured worst relative error ~1e-15).
Compiling dominates the cost, so both layouts (world size 2) share one spawn, Inductor
compiles in-process (no worker pool to start) and the eager reference runs once, here.
The single-process compiled fp32 curve is checked by tests/test_regression.py.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.parallel.state import ParallelState
from megatron_lite.training import train
from tests.distributed import run_ranks
from tests.numerics import assert_close
from tests.test_pretrain import layout_state, single_process_run
from tests.test_regression import inductor_cache_per_capability

FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
         "4", "--ffn-hidden-size", "64", "--seq-length", "16", "--vocab-size", "97",
         "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "2e-3", "--train-iters", "4", "--eval-iters", "0",
         "--peak-tflops", "1", "--fp64", "--log-interval", "1"]
LAYOUTS = {  # name: (flags, tp, pp)
    "tp2-sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, 1),
    "pp2": (["--pipeline-model-parallel-size", "2"], 1, 2),
}


def _train_compiled(world: ParallelState, names: list[str]
                    ) -> dict[str, tuple[list[float], dict, dict]]:
    """Per layout: losses plus Dynamo's counters (graphs compiled, graph breaks) of this rank,
    each layout from a clean Dynamo state."""
    import torch._dynamo
    import torch._inductor.config
    from torch._dynamo.utils import counters

    torch._inductor.config.compile_threads = 1  # a worker pool costs more than it saves here
    out = {}
    for name in names:
        extra, tp, pp = LAYOUTS[name]
        torch._dynamo.reset()
        counters.clear()
        with contextlib.redirect_stdout(io.StringIO()):
            losses = train(parse_config([*FLAGS, *extra, "--compile"]),
                           layout_state(world, tp, pp)).losses
        out[name] = (losses, dict(counters["stats"]), dict(counters["graph_break"]))
    return out


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> list[dict]:
    with pytest.MonkeyPatch.context() as mp:
        inductor_cache_per_capability(mp)  # the ranks inherit it
        return run_ranks(_train_compiled, 2, tmp_path_factory.mktemp("compile"), timeout=280,
                         names=sorted(LAYOUTS))


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_compiled_layout_matches_eager_single_process(compiled, layout: str) -> None:
    eager = single_process_run(tuple(FLAGS)).losses
    assert len(eager) == 4
    for rank in compiled:
        losses, stats, breaks = rank[layout]
        assert len(losses) == len(eager)
        for i, (a, b) in enumerate(zip(losses, eager)):
            assert_close(a, b, what=f"{layout} compiled loss at {i + 1}")
        assert breaks == {}, breaks
        assert stats.get("unique_graphs") == 1, stats  # every layer reuses one graph
