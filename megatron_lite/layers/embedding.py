"""Vocab-parallel input embedding and the matching output projection + loss.

The (padded) vocabulary is split into t contiguous slices. Each rank looks up only the ids
in its slice, zeroes the rest, and the partial embeddings are summed over TP (or
reduce-scattered to sequence slices under SP). The output side multiplies by the same kind of
slice and hands per-rank logits to a cross-entropy that never gathers the full vocabulary.

Padded rows start at zero and their logits are masked inside the loss, so they never win and
never receive gradient: a padded vocab is numerically invisible, whatever the TP size.
Both read the sequence-parallel flag in effect (already False at TP=1) from their
`LayerContext`. Given a `WeightGradQueue` there (zero-bubble schedules, layers/linear.py)
both defer their weight gradient to the W step, so a tied weight used by two chunks of one
stage (ZBV puts the embedding and the head on the first stage) receives its gradient in W
only, summed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron_lite.kernels.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.layers import tags
from megatron_lite.layers.context import LayerContext
from megatron_lite.layers.init import init_shard
from megatron_lite.layers.linear import DeferredWeight, column_parallel_linear
from megatron_lite.parallel import comms
from megatron_lite.parallel.audit import group_kind


def init_vocab_weight(vocab_size: int, padded_size: int, hidden: int, ctx: LayerContext, *,
                      std: float, name: str) -> nn.Parameter:
    """This rank's [padded/t, h] slice of a weight whose real rows are N(0, std), pad rows 0."""
    split = tags.vocab_split(padded_size)
    return tags.mark_tp_split(nn.Parameter(init_shard(
        (padded_size, hidden), split, std=std, seed=ctx.seed, name=name, tp_size=ctx.tp_size,
        tp_rank=ctx.tp_rank, device=ctx.device, dtype=ctx.dtype, real_rows=vocab_size)), split)


class _EmbeddingWeightGrad(torch.autograd.Function):
    """Identity on looked-up rows (a leaf: the lookup read a detached weight) whose backward
    queues the embedding's weight gradient, the scatter of the rows' gradient into the
    weight rows the ids picked. Token ids have no gradient, so nothing flows further."""

    @staticmethod
    def forward(ctx, rows: Tensor, ids: Tensor, deferred: DeferredWeight) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.deferred = deferred
        return rows

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, None, None]:
        (ids,) = ctx.saved_tensors
        weight = ctx.deferred.weight
        ctx.deferred.queue.push(weight, lambda: torch.ops.aten.embedding_dense_backward(
            grad, ids, weight.size(0), -1, False))
        return None, None, None


class VocabParallelEmbedding(nn.Module):
    """tokens [b, s] -> hidden [s, b, h] (or [s/t, b, h] with sequence parallelism)."""

    def __init__(self, vocab_size: int, padded_size: int, hidden: int, ctx: LayerContext, *,
                 std: float) -> None:
        super().__init__()
        self.tp_group = ctx.tp_group
        self.tp_size = ctx.tp_size
        self.sequence_parallel = ctx.sequence_parallel
        self.per_rank = padded_size // ctx.tp_size
        self.vocab_start = ctx.tp_rank * self.per_rank
        self.weight = init_vocab_weight(vocab_size, padded_size, hidden, ctx, std=std,
                                        name="embedding.weight")
        self.weight_grads = ctx.weight_grads
        if self.weight_grads is not None:
            self.weight_grads.register(self.weight)

    def _lookup(self, ids: Tensor) -> Tensor:
        if self.weight_grads is None:
            return F.embedding(ids, self.weight)
        rows = F.embedding(ids, self.weight.detach()).requires_grad_()
        return _EmbeddingWeightGrad.apply(rows, ids, DeferredWeight(self.weight,
                                                                    self.weight_grads))

    def forward(self, tokens: Tensor) -> Tensor:
        tokens = tokens.t()  # [s, b]: sequence-first from here on
        if self.tp_size == 1:
            out = self._lookup(tokens)
        else:
            local = tokens - self.vocab_start
            outside = (local < 0) | (local >= self.per_rank)
            out = self._lookup(local.masked_fill(outside, 0))
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return comms.reduce_scatter_to_sequence_region(out, self.tp_group, kind="tp")
        return comms.reduce_from_region(out, self.tp_group, kind="tp")


class VocabParallelOutput(nn.Module):
    """Final projection to per-rank vocab logits, then the token losses.

    With tied embeddings the first stage's embedding weight is passed in as `weight`
    (same stage) or a separate copy is created that starts equal (different stage; its
    gradient is summed with the embedding's over the embedding group).
    """

    def __init__(self, vocab_size: int, padded_size: int, hidden: int, ctx: LayerContext, *,
                 std: float, weight_name: str, shared_weight: nn.Parameter | None = None
                 ) -> None:
        super().__init__()
        self.tp_group = ctx.tp_group
        self.sequence_parallel = ctx.sequence_parallel
        self.vocab_size = vocab_size
        self.vocab_start = ctx.tp_rank * (padded_size // ctx.tp_size)
        self.use_triton = ctx.use_triton
        self.shared_weight = shared_weight
        if shared_weight is None:
            self.weight = init_vocab_weight(vocab_size, padded_size, hidden, ctx, std=std,
                                            name=weight_name)
        self.weight_grads = ctx.weight_grads
        if self.weight_grads is not None:
            self.weight_grads.register(self._weight())

    def _weight(self) -> nn.Parameter:
        return self.shared_weight if self.shared_weight is not None else self.weight

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [s(/t), b, h] -> this rank's logits [s, b, V/t]."""
        return column_parallel_linear(hidden, self._weight(), self.tp_group,
                                      self.sequence_parallel, self.weight_grads)

    def forward(self, hidden: Tensor, labels: Tensor) -> Tensor:
        """Per-token loss [b, s] in fp32 (labels [b, s]; -100 = ignore)."""
        return self.token_losses(self.logits(hidden), labels)

    def token_losses(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Per-token loss [b, s] of this rank's logits [s, b, V/t] (distillation keeps them)."""
        with group_kind("tp"):  # the kernel's all-reduces (kernels/ cannot name kinds)
            loss = vocab_parallel_cross_entropy(
                logits, labels.t(), self.vocab_start, self.vocab_size, self.tp_group,
                use_triton=self.use_triton)
        return loss.t()
