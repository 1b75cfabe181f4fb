"""TP=2/4, with and without sequence parallelism, against the single-process model.

float64 on both sides (tests/numerics.py): losses and every gradient within EXACT. One 4-rank
job serves every layout (TP=2 runs there as TP=2 x DP=2, both DP replicas checked), and the
planted breakage: a row-parallel linear that skips its output all-reduce must fail the same
comparison.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config import Config, ModelConfig, ParallelConfig
from megatron_lite.layers import linear, tags
from megatron_lite.layers.context import LayerContext
from megatron_lite.layers.init import shard_full
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.parallel.state import ParallelState, single_process_state
from tests.distributed import relayout, run_ranks
from tests.numerics import assert_close, rel_err

# Odd vocab (needs padding), GQA (8 query heads over 4 KV groups), ffn not a power of two.
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
             ffn_hidden_size=48, seq_length=8, vocab_size=101, make_vocab_size_divisible_by=4,
             untie_embeddings_and_output_weights=False)
# (tp, sp, untie, broken): broken skips the row-parallel output all-reduce of every layer
CASES = {"tp2": (2, False, False, False), "tp2-sp-untied": (2, True, True, False),
         "tp4-sp": (4, True, False, False), "tp2-no-row-reduce": (2, False, False, True)}


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 101, (3, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _graph_nodes(root: torch.autograd.graph.Node) -> list[str]:
    """Names of every node in the autograd graph under `root`, each node once."""
    seen, todo = {root}, [root]
    while todo:
        for nxt, _ in todo.pop().next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return [node.name() for node in seen]


def _forward_backward(pstate: ParallelState, sp: bool, untie: bool) -> dict:
    cfg = ModelConfig(**{**MODEL, "untie_embeddings_and_output_weights": untie})
    torch.manual_seed(123)  # must not matter: init is keyed by (seed, name)
    ctx = LayerContext.from_state(pstate, seed=7, sequence_parallel=sp, dtype=torch.float64)
    model = LlamaChunk(cfg, ctx, range(cfg.num_layers), pre_process=True, post_process=True)
    tokens, labels = _batch()
    losses = model(tokens, labels)
    nodes = _graph_nodes(losses.grad_fn)
    losses.sum().backward()
    return {"losses": losses.detach(), "tp_rank": pstate.tp_rank, "dp_rank": pstate.dp_rank,
            "sp_linears": nodes.count("_SequenceGatherLinearBackward"),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "splits": {n: tags.tp_split(p) for n, p in model.named_parameters()}}


def _no_row_reduce(self: linear.RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """The planted bug: the partial sum of this rank's input features, never all-reduced."""
    return F.linear(x, self.weight)


def _all_layouts(pstate: ParallelState) -> dict[str, list[dict]]:
    out = {}
    for case, (tp, sp, untie, broken) in CASES.items():
        cfg = Config(parallel=ParallelConfig(tensor_model_parallel_size=tp))
        pstate = relayout(pstate, cfg)
        real = linear.RowParallelLinear.forward
        if broken:
            linear.RowParallelLinear.forward = _no_row_reduce
        try:
            out[case] = _forward_backward(pstate, sp=sp, untie=untie)
        finally:
            linear.RowParallelLinear.forward = real
    return out


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Every case's per-rank results from one 4-rank job."""
    tmp: Path = tmp_path_factory.mktemp("tp")
    ranks = run_ranks(_all_layouts, 4, tmp, tp=4, timeout=300)
    return {case: [r[case] for r in ranks] for case in CASES}


def compare(ranks: list[dict], ref: dict, tp: int, sp: bool) -> float:
    """Every rank's losses and gradients against one process within EXACT; the worst error."""
    worst = 0.0
    for rank, out in enumerate(ranks):
        worst = max(worst, assert_close(out["losses"], ref["losses"], what=f"rank {rank} losses"))
        for name, grad in out["grads"].items():
            full = ref["grads"][name]
            split = out["splits"][name]
            padded_rows = tags.padded_vocab_size(split)
            if padded_rows is not None:  # padding depends on the TP size
                padded = torch.zeros(padded_rows, *full.shape[1:], dtype=full.dtype)
                rows = min(padded.size(0), full.size(0))
                padded[:rows] = full[:rows]
                full = padded
            if split is None and sp:
                # Replicated norm weights see only this rank's sequence slice under SP: their
                # partial gradients must add up over TP (the optimizer sums them before the
                # step), the cause of Megatron-LM issue 1446 when forgotten.
                total = sum(r["grads"][name] for r in ranks if r["dp_rank"] == out["dp_rank"])
                worst = max(worst, assert_close(total, full, what=f"summed SP gradient {name}"))
                continue
            expected = shard_full(full, split, tp, out["tp_rank"])
            worst = max(worst, assert_close(grad, expected, what=f"rank {rank} grad {name}"))
    return worst


@pytest.fixture(scope="module")
def references() -> dict[bool, dict]:
    return {untie: _forward_backward(single_process_state(), sp=False, untie=untie)
            for untie in (False, True)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.quick) if c == "tp4-sp" else c
                                  for c in CASES if not CASES[c][3]])
def test_tp_matches_single_process(layouts: dict, references: dict, case: str) -> None:
    tp, sp, untie, _ = CASES[case]
    ranks = layouts[case]
    for rank, out in enumerate(ranks):
        # SP runs every column-parallel linear (qkv, gate_up per layer; the head) through the
        # Function that saves only the input shard; without SP none does.
        assert out["sp_linears"] == (2 * MODEL["num_layers"] + 1 if sp else 0), rank
    worst = compare(ranks, references[untie], tp, sp)
    print(f"{case}: worst relative error {worst:.1e}")


@pytest.mark.quick
def test_skipped_row_parallel_all_reduce_fails_the_comparison(layouts: dict,
                                                              references: dict) -> None:
    """Planted breakage: each rank keeps its partial attention and MLP outputs."""
    ranks = layouts["tp2-no-row-reduce"]
    with pytest.raises(AssertionError, match="relative error"):
        compare(ranks, references[False], 2, False)
    err = rel_err(ranks[0]["losses"], references[False]["losses"])
    print(f"losses relative error without the row-parallel all-reduce: {err:.1e}")
    assert err > 1e-6
