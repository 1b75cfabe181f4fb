"""After training, nothing that names a process group may outlive `train()`.

A model, graph or optimizer kept alive past `train()` keeps its process groups, and so gloo's
worker threads, alive into interpreter shutdown; a worker still releasing the tensors of its
last collective there aborts the process ("terminate called without an active exception"),
so a finished torchrun job could exit with SIGABRT. These tests pin the two leaks that did it:
the optimizer's gradient hooks (a parameter -> hook -> optimizer -> parameter cycle) and the
memory report's measuring forward (saved outputs held by their own graph nodes).
"""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from megatron_lite.arguments import parse_config
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.training import train
from tests.distributed import run_ranks

FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
         "4", "--ffn-hidden-size", "64", "--seq-length", "16", "--vocab-size", "96",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
         "--eval-iters", "0", "--peak-tflops", "1", "--log-interval", "1"]


def _live(kind: type) -> int:
    gc.collect()
    return sum(type(o) is kind for o in gc.get_objects())


def test_train_leaves_no_model_or_parameters_alive() -> None:
    chunks, params = _live(LlamaChunk), _live(torch.nn.Parameter)
    train(parse_config(FLAGS), single_process_state())
    assert _live(LlamaChunk) == chunks
    assert _live(torch.nn.Parameter) == params


def _group_refcounts(pstate: ParallelState, flags: list[str]) -> tuple[list[int], list[int]]:
    groups = [g for g in (pstate.world_group, pstate.tp_group, pstate.dp_group, pstate.pp_group,
                          pstate.mp_group, pstate.embedding_group)
              if g is not None]  # a single-rank group is None (None's refcount is not ours)
    gc.collect()
    before = [sys.getrefcount(g) for g in groups]
    train(parse_config(flags), pstate)
    gc.collect()
    return before, [sys.getrefcount(g) for g in groups]


@pytest.mark.parametrize("extra,world,tp,pp", [
    pytest.param(["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, 2, 1,
                 marks=pytest.mark.quick),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
      "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"], 4, 2, 2),
], ids=["tp2-sp", "tp2-pp2-zero1-overlap"])
def test_train_releases_every_process_group(tmp_path, extra: list[str], world: int, tp: int,
                                            pp: int) -> None:
    results = run_ranks(_group_refcounts, world, tmp_path, tp=tp, pp=pp, flags=[*FLAGS, *extra])
    for rank, (before, after) in enumerate(results):
        assert after == before, f"rank {rank}: group references {before} -> {after}"
