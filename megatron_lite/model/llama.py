"""The Llama-style decoder: RMSNorm pre-norm, RoPE, grouped-query attention, SwiGLU, no biases.

Variants of the dense models trained today, by Megatron's flags: --kv-channels (a head dim
other than hidden/heads, Qwen3), --add-qkv-bias (Qwen2.5), --qk-layernorm (RMSNorm of each
q and k head before RoPE, Qwen3 / OLMo-2), --use-rope-scaling (Llama 3.1's frequencies),
--rotary-percent (RoPE on the first part of each head only).

Shapes are sequence-first everywhere inside the stack: hidden states are [s, b, h], or
[s/t, b, h] between TP regions under sequence parallelism (so the SP split is a contiguous
dim-0 slice). Token ids and labels stay [b, s] at the edges.

A `LlamaChunk` holds any contiguous run of layers, plus the embedding when it is the first
piece of the model and the final norm + output layer + loss when it is the last. A whole model
is one chunk; a pipeline stage holds one chunk (or v chunks when interleaved, two under ZBV).
Chunks know nothing about schedules: they map (tokens | hidden) to (hidden | per-token loss).
Under context parallelism a chunk sees only its CP rank's tokens; what a forward reads
besides the hidden state comes in one `BatchContext` (layers/context.py): where the tokens sit
in the sequence (RoPE angles and causality follow it), per-document RoPE positions, document
ids (no attention across documents) and the attention plan. Every module is built from one
`LayerContext` (TP/SP/CP, dtype, seed, kernels, recomputation, weight-gradient mode).
Built with `split_backward` (zero-bubble schedules), a chunk's linears and vocab layers defer
their weight gradients to its `weight_grads` queue, which the pipeline engine's W steps run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from megatron_lite.config import ModelConfig, moe_layer_pattern
from megatron_lite.kernels.rope import apply_rotary, rope_tables
from megatron_lite.layers import tags
from megatron_lite.layers.attention import attention
from megatron_lite.layers.context import BatchContext, LayerContext
from megatron_lite.layers.embedding import VocabParallelEmbedding, VocabParallelOutput
from megatron_lite.layers.linear import ColumnParallelLinear, RowParallelLinear
from megatron_lite.layers.mlp import SwiGLUMLP
from megatron_lite.layers.moe import MoE
from megatron_lite.layers.norm import RMSNorm


class Attention(nn.Module):
    """Causal GQA self-attention; each TP rank owns heads/t query and groups/t KV heads.

    With --qk-layernorm, q and k are RMS-normed over each head's d channels before RoPE. The
    two d-wide weights are whole on every TP rank, but each rank's heads give only part of
    their gradient, so it is summed over TP (the tag the SP norms carry; Megatron does the
    same in its finalize step).
    """

    def __init__(self, cfg: ModelConfig, ctx: LayerContext, layer: int) -> None:
        super().__init__()
        t, d = ctx.tp_size, cfg.head_dim
        self.heads, self.groups, self.head_dim = (cfg.num_attention_heads // t,
                                                  cfg.num_query_groups // t, d)
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size,
            [cfg.num_attention_heads * d, cfg.num_query_groups * d, cfg.num_query_groups * d],
            ctx, std=cfg.init_method_std, name=f"layers.{layer}.attention.qkv",
            bias=cfg.add_qkv_bias)
        self.proj = RowParallelLinear(
            cfg.num_attention_heads * d, cfg.hidden_size, ctx,
            std=cfg.init_method_std / math.sqrt(2 * cfg.num_layers),
            name=f"layers.{layer}.attention.proj")
        self.use_triton = ctx.use_triton
        if cfg.qk_layernorm:
            self.q_norm = RMSNorm(d, cfg.norm_epsilon, ctx, per_head=True)
            self.k_norm = RMSNorm(d, cfg.norm_epsilon, ctx, per_head=True)
        else:
            self.q_norm = self.k_norm = None
        self.selective_recompute = ctx.recompute_granularity == "selective"
        self.ring = ctx.ring

    def core(self, qkv: Tensor, batch: BatchContext) -> Tensor:
        """RoPE + causal attention: [s, b, (heads + 2 groups) d] -> [s, b, heads d].

        The batch's `cos`/`sin` are already this rank's tokens' angles when their length is s
        (CP, per-document positions); a longer table is the plain 0..s-1 prefix."""
        s, b = qkv.shape[:2]
        d = self.head_dim
        q, k, v = qkv.split([self.heads * d, self.groups * d, self.groups * d], dim=-1)
        q, k = q.view(s, b, self.heads, d), k.view(s, b, self.groups, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, batch.cos[:s], batch.sin[:s], use_triton=self.use_triton)
        v = v.view(s, b, self.groups, d)
        # SDPA wants [b, heads, s, d]
        q, k, v = (tensor.permute(1, 2, 0, 3) for tensor in (q, k, v))
        # one causal SDPA call without CP or documents (fp32 core on the CPU, flash on meta)
        index = (batch.token_index if batch.token_index is not None
                 else torch.arange(s, device=q.device))
        out = attention(q, k, v, token_index=index, documents=batch.documents, ring=self.ring,
                        plan=batch.plan)
        return out.to(qkv.dtype).permute(2, 0, 1, 3).reshape(s, b, self.heads * d)

    def forward(self, x: Tensor, batch: BatchContext) -> Tensor:
        qkv = self.qkv(x)  # [s, b, (heads + 2 groups) * d]
        if self.selective_recompute and torch.is_grad_enabled():
            # Keep only qkv; rotated q/k and the attention statistics are recomputed.
            out = checkpoint(self.core, qkv, batch, use_reentrant=False)
        else:
            out = self.core(qkv, batch)
        return self.proj(out)


def build_mlp(cfg: ModelConfig, ctx: LayerContext, layer: int) -> nn.Module:
    """The dense SwiGLU MLP, or the MoE layer on the layers --moe-layer-freq selects."""
    moe = ctx.moe
    if moe is None or not moe_layer_pattern(moe.moe_layer_freq, cfg.num_layers)[layer]:
        return SwiGLUMLP(cfg, ctx, cfg.ffn_hidden_size, f"layers.{layer}.mlp")
    return MoE(cfg, moe, ctx, layer)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: ModelConfig, ctx: LayerContext, layer: int) -> None:
        super().__init__()
        self.layer_number = layer
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, ctx)
        self.attention = Attention(cfg, ctx, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, ctx)
        self.mlp = build_mlp(cfg, ctx, layer)

    def forward(self, x: Tensor, batch: BatchContext) -> Tensor:
        x = x + self.attention(self.attention_norm(x), batch)
        return x + self.mlp(self.mlp_norm(x))


class LlamaChunk(nn.Module):
    """A contiguous run of layers, with the embedding and/or the head when at the ends.

    `head_on_stage` (for the first chunk) and `tied_embedding` (for the last) build ZBV's
    first stage, which holds both ends: the head reuses the first chunk's embedding, one
    parameter, instead of a stage copy whose gradient is summed across stages.
    """

    def __init__(self, cfg: ModelConfig, ctx: LayerContext, layer_ids: Sequence[int], *,
                 pre_process: bool, post_process: bool, head_on_stage: bool = False,
                 tied_embedding: nn.Parameter | None = None) -> None:
        super().__init__()
        self.ctx = ctx = ctx.for_chunk()
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_ids = list(layer_ids)
        self.full_recompute = (ctx.recompute_granularity == "full", ctx.recompute_method,
                               ctx.recompute_num_layers)
        self.weight_grads = ctx.weight_grads
        padded = cfg.padded_vocab_size(ctx.tp_size)
        tied = not cfg.untie_embeddings_and_output_weights
        if pre_process:
            self.embedding = VocabParallelEmbedding(cfg.vocab_size, padded, cfg.hidden_size,
                                                    ctx, std=cfg.init_method_std)
        self.layers = nn.ModuleList(TransformerLayer(cfg, ctx.for_layer(i), i)
                                    for i in layer_ids)
        if post_process:
            self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, ctx)
            shared = self.embedding.weight if (tied and pre_process) else None
            if tied and tied_embedding is not None:
                shared = tied_embedding
            self.output = VocabParallelOutput(
                cfg.vocab_size, padded, cfg.hidden_size, ctx, std=cfg.init_method_std,
                weight_name="embedding.weight" if tied else "output.weight",
                shared_weight=shared)
            if tied and shared is None:
                # A second copy of the embedding on the last stage: it starts equal (same
                # seed and name) and its gradient is summed with the first stage's.
                tags.mark_shared_embedding(self.output.weight)
        if tied and pre_process and not post_process and not head_on_stage:
            tags.mark_shared_embedding(self.embedding.weight)
        cos, sin = rope_tables(cfg.max_position_embeddings, cfg.rotary_dim, cfg.rotary_base,
                               device=ctx.device,
                               scaling_factor=(cfg.rope_scaling_factor if cfg.use_rope_scaling
                                               else None))
        self.register_buffer("rope_cos", cos.to(ctx.dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(ctx.dtype), persistent=False)

    def sharding_units(self) -> list[tuple[nn.Module, ...]]:
        """The modules ZeRO-3 gathers together, in forward order: the embedding, each layer,
        the head (final norm, then the output layer, which may read the tied embedding)."""
        units: list[tuple[nn.Module, ...]] = [(self.embedding,)] if self.pre_process else []
        units += [(layer,) for layer in self.layers]
        if self.post_process:
            units.append((self.final_norm, self.output))
        return units

    def forward(self, x: Tensor, labels: Tensor | None = None,
                batch: BatchContext | None = None) -> Tensor:
        """x: token ids [b, s] (first chunk) or hidden [s(/t), b, h], s this CP rank's tokens;
        `batch`: where they sit, their positions and documents, the attention plan (None:
        plain 0..s-1 tokens of one document each).
        Returns the hidden state, or per-token losses [b, s] (fp32) on the last chunk.
        """
        x = self.final_hidden(x, batch)
        if not self.post_process:
            return x
        if labels is None:
            raise ValueError("the last model chunk needs labels to compute the loss")
        return self.output(x, labels)

    def final_hidden(self, x: Tensor, batch: BatchContext | None = None) -> Tensor:
        """`forward` up to the output layer: the final norm's output on the last chunk
        (distillation compares it and takes the logits from it), else the hidden state."""
        if self.pre_process:
            x = self.embedding(x)
        x = self._run_layers(x, self._with_rope(batch or BatchContext()))
        return self.final_norm(x) if self.post_process else x

    def _with_rope(self, batch: BatchContext) -> BatchContext:
        """`batch` with cos/sin for its tokens: [s, d], or [s, b, d] when samples' positions
        differ (the whole tables when positions are the plain 0..s-1, sliced per layer)."""
        positions, token_index = batch.positions, batch.token_index
        if positions is not None:
            index = positions[0] if positions.shape[0] == 1 else positions.t()
            return batch.with_rope(self.rope_cos[index], self.rope_sin[index])
        if token_index is not None:
            return batch.with_rope(self.rope_cos[token_index], self.rope_sin[token_index])
        return batch.with_rope(self.rope_cos, self.rope_sin)

    def _run_group(self, x: Tensor, start: int, end: int, batch: BatchContext) -> Tensor:
        for layer in self.layers[start:end]:
            x = layer(x, batch)
        return x

    def _run_layers(self, x: Tensor, batch: BatchContext) -> Tensor:
        """The layer stack, with full recomputation when configured.

        uniform: groups of N consecutive layers each keep only their input and rerun in
        backward; block: the first N layers of this chunk are recomputed one by one and the
        rest store their activations (Megatron's --recompute-method semantics). RNG state is
        saved and restored by torch.utils.checkpoint, so any randomness replays identically.
        """
        full, method, n = self.full_recompute
        count = len(self.layers)
        if not full or not torch.is_grad_enabled():
            return self._run_group(x, 0, count, batch)
        if method == "uniform":
            for start in range(0, count, n):
                x = checkpoint(self._run_group, x, start, min(start + n, count), batch,
                               use_reentrant=False)
            return x
        for i in range(min(n, count)):
            x = checkpoint(self._run_group, x, i, i + 1, batch, use_reentrant=False)
        return self._run_group(x, min(n, count), count, batch)
