"""The model's parameters, listed once: each one's name, global shape, TP split and tags.

One owner of the decoder's structure for every reader that must not build it: export takes its
names and TP splits from here (`canonical_tags`), the planner its parameter counts, its matmul
weights (the N of 6N) and the order ZeRO-3 cuts gradient buckets in. model/llama.py's modules
create exactly these parameters, in this order (tests/test_structure.py compares the list with
a meta-device build's `named_parameters`: names, shapes and splits, for the GQA, untied,
--add-qkv-bias, --qk-layernorm, --kv-channels and --padded-vocab-size variants, and a
mixture-of-experts model, whose --moe-layer-freq layers list the MoE MLP's parameters).

Pure arithmetic on a `ModelConfig` (no torch), so the planner stays importable without it.
Shapes are global (all TP ranks together); a split weight's rank holds 1/t of it along
`split_dim`. The vocabulary's rows are what the caller passes: `ModelConfig.padded_vocab_size(t)`
for a running model, the real vocabulary for export and for counting unique parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_lite.config import ModelConfig, MoEConfig, moe_layer_pattern


@dataclass(frozen=True)
class Param:
    """One parameter of the model."""

    name: str
    shape: tuple[int, ...]
    split_dim: int | None = None
    """TP split: 0 the output rows (column- and vocab-parallel), 1 the input columns (row-
    parallel), None replicated on every TP rank."""
    partitions: tuple[int, ...] = ()
    """split_dim 0: the row counts of the stacked sub-matrices (Q, K, V; gate, up), each cut
    over TP on its own."""
    vocab: bool = False
    """Its rows are the vocabulary (split by rows, the padding rows last and zero)."""
    matmul: bool = False
    """Takes part in a matmul, so in the N of 6N: not norms, biases, or an input embedding
    that is only looked up (a tied one is the output layer's weight, so it is)."""
    expert: bool = False
    """The routed experts' weight, all E stacked by rows: an EP rank holds E/ep of them (not
    `matmul`: a token passes through top-k of them, which the FLOP count takes from
    plan_time.ModelShape's active width)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_numel(self, tp: int, ep: int = 1) -> int:
        """Elements on one rank of a TP group of `tp` (and an EP group of `ep`)."""
        n = self.numel if self.split_dim is None else self.numel // tp
        return n // ep if self.expert else n


def qkv_rows(model: ModelConfig) -> tuple[int, int, int]:
    """Rows of Q, K and V in the fused qkv weight (heads·d, groups·d, groups·d)."""
    d = model.head_dim
    return (model.num_attention_heads * d, model.num_query_groups * d,
            model.num_query_groups * d)


def moe_parameters(model: ModelConfig, moe: MoEConfig, layer: int) -> list[Param]:
    """A MoE layer's MLP parameters (layers/moe.py), in `named_parameters` order: the E experts
    stacked, gate|up [E·2f, h] (expert e's gate rows then its up rows, each cut over TP on its
    own) and down [E·h, f] (input columns split), the router [E, h] (replicated), then the
    shared expert's fused gate|up and down when --moe-shared-expert-intermediate-size is set
    (with --moe-shared-expert-gate its gate [1, h], replicated, before the router: the
    module's own parameters come before its children's).
    Shapes are those of EP=1: an EP rank holds E/ep of the experts' rows."""
    h, e = model.hidden_size, moe.num_experts or 0
    f = moe.moe_ffn_hidden_size or model.ffn_hidden_size
    p = f"layers.{layer}.mlp."
    out = [Param(p + "gate_up", (e * 2 * f, h), 0, (f,) * (2 * e), expert=True),
           Param(p + "down", (e * h, f), 1, expert=True)]
    if moe.moe_shared_expert_gate:
        out.append(Param(p + "shared_gate", (1, h), matmul=True))
    out.append(Param(p + "router.weight", (e, h), matmul=True))
    shared = moe.moe_shared_expert_intermediate_size
    if shared:
        out += [Param(p + "shared.gate_up.weight", (2 * shared, h), 0, (shared, shared),
                      matmul=True),
                Param(p + "shared.down.weight", (h, shared), 1, matmul=True)]
    return out


def layer_parameters(model: ModelConfig, layer: int, moe: MoEConfig | None = None
                     ) -> list[Param]:
    """Layer `layer`'s parameters in the order its modules create them: the attention norm,
    fused QKV (and its --add-qkv-bias bias), the output projection, the --qk-layernorm
    per-head norms, the MLP norm, fused gate|up and down (on the layers --moe-layer-freq
    picks with `moe`: `moe_parameters`)."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    rows = qkv_rows(model)
    p = f"layers.{layer}."
    out = [Param(p + "attention_norm.weight", (h,)),
           Param(p + "attention.qkv.weight", (sum(rows), h), 0, rows, matmul=True)]
    if model.add_qkv_bias:
        out.append(Param(p + "attention.qkv.bias", (sum(rows),), 0, rows))
    out.append(Param(p + "attention.proj.weight", (h, rows[0]), 1, matmul=True))
    if model.qk_layernorm:
        out += [Param(p + "attention.q_norm.weight", (d,)),
                Param(p + "attention.k_norm.weight", (d,))]
    out.append(Param(p + "mlp_norm.weight", (h,)))
    if moe is not None and moe.num_experts and moe_layer_pattern(
            moe.moe_layer_freq, model.num_layers)[layer]:
        return out + moe_parameters(model, moe, layer)
    return [*out, Param(p + "mlp.gate_up.weight", (2 * f, h), 0, (f, f), matmul=True),
            Param(p + "mlp.down.weight", (h, f), 1, matmul=True)]


def model_parameters(model: ModelConfig, vocab_rows: int, moe: MoEConfig | None = None
                     ) -> list[Param]:
    """The whole model's unique parameters (one chunk holding every layer, as
    `named_parameters` lists them): the embedding, the layers (MoE where `moe` says), the
    final norm, and the output layer when untied (tied, it reads the embedding's weight)."""
    untied = model.untie_embeddings_and_output_weights
    h = model.hidden_size

    def vocab_table(name: str, matmul: bool) -> Param:
        return Param(name, (vocab_rows, h), 0, (vocab_rows,), vocab=True, matmul=matmul)

    out = [vocab_table("embedding.weight", matmul=not untied)]
    for i in range(model.num_layers):
        out += layer_parameters(model, i, moe)
    out.append(Param("final_norm.weight", (h,)))
    return out + ([vocab_table("output.weight", matmul=True)] if untied else [])


def matmul_weights(params: list[Param]) -> int:
    """Elements of the weights that take part in a matmul (`Param.matmul`)."""
    return sum(p.numel for p in params if p.matmul)
