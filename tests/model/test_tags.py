"""Every weight carries the parameter tags its consumers read (layers/tags.py).

The model is only built, never run, on the meta device: a TP=2 or PP=2 rank's chunk needs no
process group to exist, so each layout's tags are checked in this one process.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.export import canonical_tags
from megatron_lite.layers import tags
from megatron_lite.layers.context import LayerContext
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.optim.clip import counts_toward_norm
from megatron_lite.parallel.state import ParallelState, single_process_state

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=48, seq_length=8, vocab_size=101,
                    make_vocab_size_divisible_by=4)


def _rank(tp_size: int = 1, tp_rank: int = 0, pp_size: int = 1, pp_rank: int = 0
          ) -> ParallelState:
    return replace(single_process_state(torch.device("meta")), tp_size=tp_size,
                   tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank)


def _chunk(pstate: ParallelState, *, sp: bool = False, untie: bool = False) -> LlamaChunk:
    cfg = replace(MODEL, untie_embeddings_and_output_weights=untie)
    first, last = pstate.is_first_stage, pstate.is_last_stage
    layers = range(MODEL.num_layers) if pstate.pp_size == 1 else [pstate.pp_rank]
    return LlamaChunk(cfg, LayerContext.from_state(pstate, seed=0, sequence_parallel=sp), layers,
                      pre_process=first, post_process=last)


@pytest.mark.parametrize("tp_size,sp,untie", [(1, False, False), (2, False, True),
                                              (2, True, False)])
def test_each_weight_has_its_layers_split(tp_size: int, sp: bool, untie: bool) -> None:
    canonical = canonical_tags(replace(MODEL, untie_embeddings_and_output_weights=untie))
    padded = MODEL.padded_vocab_size(tp_size)
    for name, param in _chunk(_rank(tp_size), sp=sp, untie=untie).named_parameters():
        split = canonical[name]
        if tags.padded_vocab_size(split) is not None:  # the running model pads the vocab
            split = tags.vocab_split(padded)
        assert tags.tp_split(param) == split, name
        assert tags.is_replicated(param) == (split is None), name
        assert not tags.is_shared_embedding(param), name


@pytest.mark.parametrize("tp_size,sp", [(1, False), (1, True), (2, False), (2, True)])
def test_sequence_parallel_is_resolved_once_for_the_tp_size(tp_size: int, sp: bool) -> None:
    """SP does nothing at TP=1: no layer runs it and no norm gradient is marked for a TP sum."""
    on = sp and tp_size > 1
    assert LayerContext.from_state(_rank(tp_size), seed=0, sequence_parallel=sp
                                   ).sequence_parallel == on
    chunk = _chunk(_rank(tp_size), sp=sp)
    for name, param in chunk.named_parameters():
        assert tags.is_sequence_parallel_grad(param) == (on and name.endswith("norm.weight")), name
    layers = [module for module in chunk.modules() if hasattr(module, "sequence_parallel")]
    assert layers and all(layer.sequence_parallel == on for layer in layers)


def test_tied_embedding_copies_across_stages() -> None:
    """PP=2: the first stage's embedding and the last stage's output are the shared copies;
    the norm counts each once (first stage, TP rank 0) and untied weights never share."""
    for pp_rank, weight in ((0, "embedding.weight"), (1, "output.weight")):
        for tp_rank in range(2):
            pstate = _rank(tp_size=2, tp_rank=tp_rank, pp_size=2, pp_rank=pp_rank)
            params = dict(_chunk(pstate).named_parameters())
            shared = {n for n, p in params.items() if tags.is_shared_embedding(p)}
            assert shared == {weight}
            replicated = {n for n, p in params.items() if tags.is_replicated(p)}
            counted = {n for n, p in params.items() if counts_toward_norm(p, pstate)}
            assert counted == (set(params) - (replicated if tp_rank else set())
                               - (shared if pp_rank else set()))
            untied = _chunk(pstate, untie=True).parameters()
            assert not any(tags.is_shared_embedding(p) for p in untied)
