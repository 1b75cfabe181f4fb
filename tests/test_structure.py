"""megatron_lite/structure.py is the model's parameter list: a meta-device build of the modules
has exactly its names, order, shapes and TP splits (for each dense variant and a MoE model),
and the planner's and export's counts read it.

Built on the meta device only (no weights drawn, no process group for TP=2)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_lite import structure
from megatron_lite.config import ModelConfig, MoEConfig
from megatron_lite.export import canonical_tags, tp_split
from megatron_lite.layers import tags
from megatron_lite.layers.context import LayerContext
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.parallel.state import single_process_state
from megatron_lite.planner import (
    ModelShape,
    layer_params,
    matmul_params,
    total_params,
    zero3_grad_buckets,
)

BASE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                   ffn_hidden_size=48, seq_length=8, vocab_size=101,
                   make_vocab_size_divisible_by=4)
VARIANTS = {
    "gqa_tied": BASE,
    "untied_padded": replace(BASE, untie_embeddings_and_output_weights=True, padded_vocab=120),
    "qkv_bias": replace(BASE, add_qkv_bias=True, num_query_groups=4),
    "qwen3": replace(BASE, qk_layernorm=True, add_qkv_bias=True, kv_channels=16,
                     untie_embeddings_and_output_weights=True),
}


def _meta_build(model: ModelConfig, tp: int = 1, moe: MoEConfig | None = None
                ) -> dict[str, torch.nn.Parameter]:
    pstate = replace(single_process_state(torch.device("meta")), tp_size=tp, etp_size=tp)
    chunk = LlamaChunk(model, LayerContext.from_state(pstate, seed=0, moe=moe),
                       range(model.num_layers), pre_process=True, post_process=True)
    return dict(chunk.named_parameters())


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_structure_is_what_the_modules_build(name: str) -> None:
    model = VARIANTS[name]
    built = _meta_build(model)
    listed = structure.model_parameters(model, model.padded_vocab_size(1))
    assert [(p.name, p.shape) for p in listed] == [(n, tuple(w.shape)) for n, w in built.items()]
    for p in listed:
        assert tp_split(p) == tags.tp_split(built[p.name]), p.name
    # export's splits are the same list over the real vocabulary
    splits = canonical_tags(model)
    assert list(splits) == list(built)
    vocab = tags.vocab_split(model.vocab_size)
    assert all(splits[n] == vocab for n in built if n in ("embedding.weight", "output.weight"))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_planner_counts_are_the_structures(name: str) -> None:
    """The planner's parameter counts against the built tensors (TP=1 and a TP=2 rank), its
    matmul weights against the dimension formula, ZeRO-3's buckets against the build's order."""
    model = VARIANTS[name]
    built = _meta_build(model)
    padded_rows = model.padded_vocab_size(1) - model.vocab_size
    tables = 2 if model.untie_embeddings_and_output_weights else 1
    assert total_params(model) == (sum(w.numel() for w in built.values())
                                   - tables * padded_rows * model.hidden_size)
    for tp in (1, 2):
        layer0 = [w for n, w in _meta_build(model, tp).items() if n.startswith("layers.0.")]
        assert layer_params(model, tp) == sum(w.numel() for w in layer0)
        assert zero3_grad_buckets(model, tp, 1)[1] == [w.numel() for w in reversed(layer0)]
    shape = ModelShape.from_config(model, 1)
    assert matmul_params(shape) == matmul_params(replace(shape, layer_matmul=0))
    untied_embedding = model.untie_embeddings_and_output_weights
    weights = [w for n, w in built.items() if w.dim() == 2
               and not (untied_embedding and n == "embedding.weight")]
    assert matmul_params(shape) == sum(w.numel() for w in weights)


# layer 0 MoE (4 experts of width 16, a shared expert of 8), layer 1 dense
MOE = MoEConfig(num_experts=4, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=8,
                moe_layer_freq="[1,0]")


def test_moe_structure_is_what_the_modules_build() -> None:
    """A MoE layer lists its stacked experts, router and shared expert as built (names, shapes,
    TP splits at TP=1, a TP=2 rank's sizes), and export's splits follow."""
    model = VARIANTS["qwen3"]
    built = _meta_build(model, moe=MOE)
    listed = structure.model_parameters(model, model.padded_vocab_size(1), MOE)
    assert [(p.name, p.shape) for p in listed] == [(n, tuple(w.shape)) for n, w in built.items()]
    assert "layers.0.mlp.router.weight" in built and "layers.1.mlp.gate_up.weight" in built
    for p in listed:
        assert tp_split(p) == tags.tp_split(built[p.name]), p.name
    assert [p.name for p in listed if p.expert] == ["layers.0.mlp.gate_up", "layers.0.mlp.down"]
    rank = _meta_build(model, tp=2, moe=MOE)
    assert [p.local_numel(2) for p in listed if p.name in rank and not p.vocab] == [
        w.numel() for n, w in rank.items() if n not in ("embedding.weight", "output.weight")]
    assert list(canonical_tags(model, MOE)) == list(built)
