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
Under context parallelism a chunk sees only its CP rank's tokens (`token_index` says where
they sit in the sequence: RoPE angles and causality follow it) and attention passes K/V
around the CP ring; `positions` (per-document RoPE positions) and `documents` (no attention
across documents) come from the batch as well.
Built with `split_backward` (zero-bubble schedules), a chunk's linears and vocab layers defer
their weight gradients to its `weight_grads` queue, which the pipeline engine's W steps run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from megatron_lite.config import ModelConfig, MoEConfig, moe_layer_pattern
from megatron_lite.kernels.rope import apply_rotary, rope_tables
from megatron_lite.kernels.swiglu import swiglu
from megatron_lite.layers import tags
from megatron_lite.layers.attention import AttentionPlan, Ring, attention
from megatron_lite.layers.embedding import VocabParallelEmbedding, VocabParallelOutput
from megatron_lite.layers.linear import ColumnParallelLinear, RowParallelLinear, WeightGradQueue
from megatron_lite.layers.moe import MoE
from megatron_lite.layers.norm import RMSNorm
from megatron_lite.parallel.state import ParallelState


@dataclass(frozen=True)
class BuildOptions:
    """Construction choices shared by every module of one model (not part of its shape)."""

    seed: int
    sequence_parallel: bool = False
    """Sequence parallelism in effect. Callers pass --sequence-parallel as given; `LlamaChunk`
    resolves it once with `for_tp_size`, and every module below it gets the resolved flag."""
    dtype: torch.dtype = torch.float32
    use_triton: bool = False
    recompute_granularity: str | None = None
    """None, "selective" (RoPE + attention core rerun in backward) or "full" (whole layers)."""
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    split_backward: bool = False
    """Defer weight gradients to the pipeline's W steps (--pipeline-schedule zb-h1/zbv)."""
    moe: MoEConfig | None = None
    """Mixture of experts (--num-experts): the layers --moe-layer-freq picks get a `MoE`."""

    def for_tp_size(self, tp_size: int) -> BuildOptions:
        """These options for a TP group of `tp_size`: at TP=1 there is no group to split the
        sequence over, so sequence parallelism is off (the one place this is decided)."""
        return replace(self, sequence_parallel=self.sequence_parallel and tp_size > 1)


class Attention(nn.Module):
    """Causal GQA self-attention; each TP rank owns heads/t query and groups/t KV heads.

    With --qk-layernorm, q and k are RMS-normed over each head's d channels before RoPE. The
    two d-wide weights are whole on every TP rank, but each rank's heads give only part of
    their gradient, so it is summed over TP (the tag the SP norms carry; Megatron does the
    same in its finalize step).
    """

    def __init__(self, cfg: ModelConfig, pstate: ParallelState, layer: int,
                 opts: BuildOptions, weight_grads: WeightGradQueue | None = None) -> None:
        super().__init__()
        t, d = pstate.tp_size, cfg.head_dim
        self.heads, self.groups, self.head_dim = (cfg.num_attention_heads // t,
                                                  cfg.num_query_groups // t, d)
        common = dict(sequence_parallel=opts.sequence_parallel, seed=opts.seed, dtype=opts.dtype,
                      weight_grads=weight_grads)
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size,
            [cfg.num_attention_heads * d, cfg.num_query_groups * d, cfg.num_query_groups * d],
            pstate, std=cfg.init_method_std, name=f"layers.{layer}.attention.qkv",
            bias=cfg.add_qkv_bias, **common)
        self.proj = RowParallelLinear(
            cfg.num_attention_heads * d, cfg.hidden_size, pstate,
            std=cfg.init_method_std / math.sqrt(2 * cfg.num_layers),
            name=f"layers.{layer}.attention.proj", **common)
        self.use_triton = opts.use_triton
        if cfg.qk_layernorm:
            norm = dict(sequence_parallel=pstate.tp_size > 1, device=pstate.device,
                        dtype=opts.dtype, use_triton=opts.use_triton)
            self.q_norm = RMSNorm(d, cfg.norm_epsilon, **norm)
            self.k_norm = RMSNorm(d, cfg.norm_epsilon, **norm)
        else:
            self.q_norm = self.k_norm = None
        self.selective_recompute = opts.recompute_granularity == "selective"
        self.ring = (Ring(pstate.cp_group, pstate.cp_ranks, pstate.cp_rank)
                     if pstate.cp_size > 1 else None)

    def core(self, qkv: Tensor, cos: Tensor, sin: Tensor, token_index: Tensor | None = None,
             documents: Tensor | None = None, plan: AttentionPlan | None = None) -> Tensor:
        """RoPE + causal attention: [s, b, (heads + 2 groups) d] -> [s, b, heads d].

        `cos`/`sin` are already this rank's tokens' angles when their length is s (CP,
        per-document positions); a longer table is the plain 0..s-1 prefix."""
        s, b = qkv.shape[:2]
        d = self.head_dim
        q, k, v = qkv.split([self.heads * d, self.groups * d, self.groups * d], dim=-1)
        q, k = q.view(s, b, self.heads, d), k.view(s, b, self.groups, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, cos[:s], sin[:s], use_triton=self.use_triton)
        v = v.view(s, b, self.groups, d)
        # SDPA wants [b, heads, s, d]
        q, k, v = (tensor.permute(1, 2, 0, 3) for tensor in (q, k, v))
        # one causal SDPA call without CP or documents (fp32 core on the CPU, flash on meta)
        index = token_index if token_index is not None else torch.arange(s, device=q.device)
        out = attention(q, k, v, token_index=index, documents=documents, ring=self.ring,
                        plan=plan)
        return out.to(qkv.dtype).permute(2, 0, 1, 3).reshape(s, b, self.heads * d)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, token_index: Tensor | None = None,
                documents: Tensor | None = None, plan: AttentionPlan | None = None) -> Tensor:
        qkv = self.qkv(x)  # [s, b, (heads + 2 groups) * d]
        if self.selective_recompute and torch.is_grad_enabled():
            # Keep only qkv; rotated q/k and the attention statistics are recomputed.
            out = checkpoint(self.core, qkv, cos, sin, token_index, documents, plan,
                             use_reentrant=False)
        else:
            out = self.core(qkv, cos, sin, token_index, documents, plan)
        return self.proj(out)


class MLP(nn.Module):
    """SwiGLU: down(silu(x W_gate) * (x W_up)), gate and up fused in one column layer."""

    def __init__(self, cfg: ModelConfig, pstate: ParallelState, layer: int,
                 opts: BuildOptions, weight_grads: WeightGradQueue | None = None) -> None:
        super().__init__()
        ffn = cfg.ffn_hidden_size
        common = dict(sequence_parallel=opts.sequence_parallel, seed=opts.seed, dtype=opts.dtype,
                      weight_grads=weight_grads)
        self.gate_up = ColumnParallelLinear(cfg.hidden_size, [ffn, ffn], pstate,
                                            std=cfg.init_method_std,
                                            name=f"layers.{layer}.mlp.gate_up", **common)
        self.down = RowParallelLinear(ffn, cfg.hidden_size, pstate,
                                      std=cfg.init_method_std / math.sqrt(2 * cfg.num_layers),
                                      name=f"layers.{layer}.mlp.down", **common)
        self.use_triton = opts.use_triton

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(swiglu(gate, up, use_triton=self.use_triton))


def build_mlp(cfg: ModelConfig, pstate: ParallelState, layer: int, opts: BuildOptions,
              weight_grads: WeightGradQueue | None = None) -> nn.Module:
    """The dense SwiGLU MLP, or the MoE layer on the layers --moe-layer-freq selects."""
    moe = opts.moe
    if moe is None or not moe_layer_pattern(moe.moe_layer_freq, cfg.num_layers)[layer]:
        return MLP(cfg, pstate, layer, opts, weight_grads)
    return MoE(cfg, moe, pstate, layer, sequence_parallel=opts.sequence_parallel,
               seed=opts.seed, dtype=opts.dtype, use_triton=opts.use_triton)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: ModelConfig, pstate: ParallelState, layer: int,
                 opts: BuildOptions, weight_grads: WeightGradQueue | None = None) -> None:
        super().__init__()
        self.layer_number = layer
        norm = dict(sequence_parallel=opts.sequence_parallel,
                    device=pstate.device, dtype=opts.dtype, use_triton=opts.use_triton)
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, **norm)
        self.attention = Attention(cfg, pstate, layer, opts, weight_grads)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, **norm)
        self.mlp = build_mlp(cfg, pstate, layer, opts, weight_grads)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, token_index: Tensor | None = None,
                documents: Tensor | None = None, plan: AttentionPlan | None = None) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, token_index, documents, plan)
        return x + self.mlp(self.mlp_norm(x))


class LlamaChunk(nn.Module):
    """A contiguous run of layers, with the embedding and/or the head when at the ends.

    `head_on_stage` (for the first chunk) and `tied_embedding` (for the last) build ZBV's
    first stage, which holds both ends: the head reuses the first chunk's embedding, one
    parameter, instead of a stage copy whose gradient is summed across stages.
    """

    def __init__(self, cfg: ModelConfig, pstate: ParallelState, layer_ids: Sequence[int],
                 *, pre_process: bool, post_process: bool, opts: BuildOptions,
                 head_on_stage: bool = False,
                 tied_embedding: nn.Parameter | None = None) -> None:
        super().__init__()
        opts = opts.for_tp_size(pstate.tp_size)
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_ids = list(layer_ids)
        self.full_recompute = (opts.recompute_granularity == "full", opts.recompute_method,
                               opts.recompute_num_layers)
        self.weight_grads = WeightGradQueue() if opts.split_backward else None
        padded = cfg.padded_vocab_size(pstate.tp_size)
        tied = not cfg.untie_embeddings_and_output_weights
        if pre_process:
            self.embedding = VocabParallelEmbedding(
                cfg.vocab_size, padded, cfg.hidden_size, pstate,
                sequence_parallel=opts.sequence_parallel, std=cfg.init_method_std,
                seed=opts.seed, dtype=opts.dtype, weight_grads=self.weight_grads)
        self.layers = nn.ModuleList(TransformerLayer(cfg, pstate, i, opts, self.weight_grads)
                                    for i in layer_ids)
        if post_process:
            self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon,
                                      sequence_parallel=opts.sequence_parallel,
                                      device=pstate.device, dtype=opts.dtype,
                                      use_triton=opts.use_triton)
            shared = self.embedding.weight if (tied and pre_process) else None
            if tied and tied_embedding is not None:
                shared = tied_embedding
            self.output = VocabParallelOutput(
                cfg.vocab_size, padded, cfg.hidden_size, pstate,
                sequence_parallel=opts.sequence_parallel, std=cfg.init_method_std,
                seed=opts.seed, dtype=opts.dtype,
                weight_name="embedding.weight" if tied else "output.weight",
                use_triton=opts.use_triton, shared_weight=shared,
                weight_grads=self.weight_grads)
            if tied and shared is None:
                # A second copy of the embedding on the last stage: it starts equal (same
                # seed and name) and its gradient is summed with the first stage's.
                tags.mark_shared_embedding(self.output.weight)
        if tied and pre_process and not post_process and not head_on_stage:
            tags.mark_shared_embedding(self.embedding.weight)
        cos, sin = rope_tables(cfg.max_position_embeddings, cfg.rotary_dim, cfg.rotary_base,
                               device=pstate.device,
                               scaling_factor=(cfg.rope_scaling_factor if cfg.use_rope_scaling
                                               else None))
        self.register_buffer("rope_cos", cos.to(opts.dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(opts.dtype), persistent=False)

    def sharding_units(self) -> list[tuple[nn.Module, ...]]:
        """The modules ZeRO-3 gathers together, in forward order: the embedding, each layer,
        the head (final norm, then the output layer, which may read the tied embedding)."""
        units: list[tuple[nn.Module, ...]] = [(self.embedding,)] if self.pre_process else []
        units += [(layer,) for layer in self.layers]
        if self.post_process:
            units.append((self.final_norm, self.output))
        return units

    def forward(self, x: Tensor, labels: Tensor | None = None, *,
                token_index: Tensor | None = None, positions: Tensor | None = None,
                documents: Tensor | None = None,
                attention_plan: AttentionPlan | None = None) -> Tensor:
        """x: token ids [b, s] (first chunk) or hidden [s(/t), b, h], s this CP rank's tokens.

        `token_index` [s]: the tokens' places in the whole sequence (None: 0..s-1);
        `positions` [b, s]: RoPE positions when they differ from those (restarting per
        document); `documents` [b, s]: document ids, attention stays inside one;
        `attention_plan`: the micro-batch's host plan of the attention kernel calls (made by
        the loader), shared by every layer.
        Returns the hidden state, or per-token losses [b, s] (fp32) on the last chunk.
        """
        x = self.final_hidden(x, token_index=token_index, positions=positions,
                              documents=documents, attention_plan=attention_plan)
        if not self.post_process:
            return x
        if labels is None:
            raise ValueError("the last model chunk needs labels to compute the loss")
        return self.output(x, labels)

    def final_hidden(self, x: Tensor, *, token_index: Tensor | None = None,
                     positions: Tensor | None = None, documents: Tensor | None = None,
                     attention_plan: AttentionPlan | None = None) -> Tensor:
        """`forward` up to the output layer: the final norm's output on the last chunk
        (distillation compares it and takes the logits from it), else the hidden state."""
        if self.pre_process:
            x = self.embedding(x)
        tables = self._rope_tables(token_index, positions)
        x = self._run_layers(x, *tables, token_index, documents, attention_plan)
        return self.final_norm(x) if self.post_process else x

    def _rope_tables(self, token_index: Tensor | None, positions: Tensor | None
                     ) -> tuple[Tensor, Tensor]:
        """cos/sin for this rank's tokens: [s, d], or [s, b, d] when samples' positions differ
        (the whole tables when positions are the plain 0..s-1, sliced per layer)."""
        if positions is not None:
            if positions.shape[0] == 1:
                return self.rope_cos[positions[0]], self.rope_sin[positions[0]]
            return self.rope_cos[positions.t()], self.rope_sin[positions.t()]
        if token_index is not None:
            return self.rope_cos[token_index], self.rope_sin[token_index]
        return self.rope_cos, self.rope_sin

    def _run_group(self, x: Tensor, start: int, end: int, cos: Tensor, sin: Tensor,
                   token_index: Tensor | None, documents: Tensor | None,
                   plan: AttentionPlan | None = None) -> Tensor:
        for layer in self.layers[start:end]:
            x = layer(x, cos, sin, token_index, documents, plan)
        return x

    def _run_layers(self, x: Tensor, *sequence: Tensor | AttentionPlan | None) -> Tensor:
        """The layer stack, with full recomputation when configured.

        uniform: groups of N consecutive layers each keep only their input and rerun in
        backward; block: the first N layers of this chunk are recomputed one by one and the
        rest store their activations (Megatron's --recompute-method semantics). RNG state is
        saved and restored by torch.utils.checkpoint, so any randomness replays identically.
        """
        full, method, n = self.full_recompute
        count = len(self.layers)
        if not full or not torch.is_grad_enabled():
            return self._run_group(x, 0, count, *sequence)
        if method == "uniform":
            for start in range(0, count, n):
                x = checkpoint(self._run_group, x, start, min(start + n, count), *sequence,
                               use_reentrant=False)
            return x
        for i in range(min(n, count)):
            x = checkpoint(self._run_group, x, i, i + 1, *sequence, use_reentrant=False)
        return self._run_group(x, min(n, count), count, *sequence)
