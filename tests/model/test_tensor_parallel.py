"""TP=2/4, with and without sequence parallelism, against the single-process model."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.layers import tags
from megatron_lite.layers.init import shard_full
from megatron_lite.model.llama import BuildOptions, LlamaChunk
from megatron_lite.parallel.state import ParallelState, single_process_state
from tests.distributed import run_ranks

# Odd vocab (needs padding), GQA (8 query heads over 4 KV groups), ffn not a power of two.
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
             ffn_hidden_size=48, seq_length=8, vocab_size=101, make_vocab_size_divisible_by=4,
             untie_embeddings_and_output_weights=False)


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
    model = LlamaChunk(cfg, pstate, range(cfg.num_layers), pre_process=True,
                       post_process=True, opts=BuildOptions(seed=7, sequence_parallel=sp))
    tokens, labels = _batch()
    losses = model(tokens, labels)
    nodes = _graph_nodes(losses.grad_fn)
    losses.sum().backward()
    return {"losses": losses.detach(),
            "sp_linears": nodes.count("_SequenceGatherLinearBackward"),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "splits": {n: tags.tp_split(p) for n, p in model.named_parameters()}}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("tp,sp,untie", [(2, False, False), (2, True, True), (4, True, False)])
def test_tp_matches_single_process(tmp_path, tp: int, sp: bool, untie: bool) -> None:
    ref = _forward_backward(single_process_state(), sp=False, untie=untie)
    ranks = run_ranks(_forward_backward, tp, tmp_path, tp=tp, sp=sp, untie=untie)
    for rank, out in enumerate(ranks):
        # SP runs every column-parallel linear (qkv, gate_up per layer; the head) through the
        # Function that saves only the input shard; without SP none does.
        assert out["sp_linears"] == (2 * MODEL["num_layers"] + 1 if sp else 0), rank
        assert _rel_err(out["losses"], ref["losses"]) <= 1e-5, f"rank {rank} losses differ"
        for name, grad in out["grads"].items():
            full = ref["grads"][name]
            split = out["splits"][name]
            padded_rows = tags.padded_vocab_size(split)
            if padded_rows is not None:  # padding depends on the TP size
                padded = torch.zeros(padded_rows, *full.shape[1:])
                rows = min(padded.size(0), full.size(0))
                padded[:rows] = full[:rows]
                full = padded
            expected = shard_full(full, split, tp, rank)
            if split is None and sp:
                # Replicated norm weights see only this rank's sequence slice under SP: their
                # partial gradients must add up over TP (the optimizer sums them before the
                # step), the cause of Megatron-LM issue 1446 when forgotten.
                total = sum(r["grads"][name] for r in ranks)
                assert _rel_err(total, full) <= 1e-5, f"summed SP gradient of {name} differs"
                continue
            assert _rel_err(grad, expected) <= 1e-5, f"rank {rank}: gradient of {name} differs"
