"""The MoE router: scores, top-k choice, capacity, and the load-balancing and z losses.

Semantics follow Megatron-core's TopKRouter (megatron/core/transformer/moe/router.py,
moe_utils.py), written here from the formulas:

- softmax scores: top-k of the logits, then a softmax over those k (default), or a softmax
  over all experts first (--moe-router-pre-softmax). sigmoid scores: an independent sigmoid
  per expert, the k chosen normalised to sum to 1 when k > 1; DeepSeek-V3's expert bias is
  added to the sigmoid scores for the choice only, never to the weights.
- group-limited routing: experts form G equal groups, a group scores the sum of its best
  k/group_topk experts, and a token chooses among the experts of its best group_topk groups.
- capacity: ceil(tokens x k / E x factor) rows per expert; "probs" keeps the highest weights
  per expert, "position" the earliest tokens; padding fills every expert to its capacity
  with weight-zero rows.
- aux loss (Switch): E / (k T^2) x sum_e (sum of scores to e) x (tokens routed to e), from the
  scores over all experts and their plain top-k (no bias, no groups, no capacity), T the
  tokens of the micro-batch; seq_aux_loss the same per sequence, averaged over sequences.
- z-loss: mean over tokens of logsumexp(logits)^2.

Under sequence parallelism each TP rank routes its own slice of the sequence, and under
context parallelism each CP rank its two chunks: token counts are summed over those ranks
(so T and the counts are the whole micro-batch's and each rank's loss is its tokens' share of
the global one), the z-loss is divided by their number, and the router weight's gradient is
summed over TP (its SP tag) and over CP (CP ranks are gradient replicas). Losses reach the gradients
through `attach_loss` (added in backward, scaled like the language-model loss).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron_lite.config import MoEConfig
from megatron_lite.layers import tags
from megatron_lite.layers.context import LayerContext
from megatron_lite.layers.init import init_shard
from megatron_lite.parallel import comms

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def group_limited_topk(scores: Tensor, k: int, groups: int, group_topk: int
                       ) -> tuple[Tensor, Tensor]:
    """Top-k over the experts of each token's best `group_topk` of `groups` groups."""
    tokens, experts = scores.shape
    per_group = scores.view(tokens, groups, experts // groups)
    group_scores = per_group.topk(k // group_topk, dim=-1).values.sum(-1)
    best = group_scores.topk(group_topk, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
    keep = keep.unsqueeze(-1).expand_as(per_group).reshape(tokens, experts)
    return scores.masked_fill(~keep, -math.inf).topk(k, dim=-1)


def _topk(scores: Tensor, moe: MoEConfig) -> tuple[Tensor, Tensor]:
    k = moe.moe_router_topk
    if moe.moe_router_group_topk:
        return group_limited_topk(scores, k, moe.moe_router_num_groups, moe.moe_router_group_topk)
    return scores.topk(k, dim=-1)


def _scoring(logits: Tensor) -> Tensor:
    """Scores in fp32 at least (as Megatron computes them): a bf16 sigmoid could not even see
    an expert-bias step of 1e-3."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def route(logits: Tensor, moe: MoEConfig, expert_bias: Tensor | None = None
          ) -> tuple[Tensor, Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k]) of each token's chosen
    experts."""
    dtype, logits = logits.dtype, _scoring(logits)
    if moe.moe_router_score_function == "softmax":
        if moe.moe_router_pre_softmax:
            weights, ids = _topk(torch.softmax(logits, dim=-1), moe)
        else:
            top, ids = _topk(logits, moe)
            weights = torch.softmax(top, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        if expert_bias is not None:
            ids = _topk(scores + expert_bias.to(scores.dtype), moe)[1]
            weights = scores.gather(1, ids)
        else:
            weights, ids = _topk(scores, moe)
        if moe.moe_router_topk > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if moe.moe_router_topk_scaling_factor:
        weights = weights * moe.moe_router_topk_scaling_factor
    return weights.to(dtype), ids


def expert_capacity(tokens: int, experts: int, topk: int, factor: float) -> int:
    """Rows each expert computes at most: ceil(tokens x k / experts x factor)."""
    return math.ceil(tokens * topk / experts * factor)



STAND_IN_SKEW = 1.0
"""Log-normal sigma of the dry run's per-expert popularity: the busiest of 8 experts takes
about 3x the mean share, as a young router's load does."""


def stand_in_counts(tokens: int, moe: MoEConfig, seed: int) -> tuple[int, ...]:
    """Per-expert routed-token counts the rank dry run uses where a meta routing map has no
    values: `tokens` tokens each choosing top-k distinct experts from a seeded skewed
    popularity with one expert never chosen (where E > k), so counts are uneven, rarely
    multiples of 16, and one is 0, as real routing's are; capacity then caps (or, padded,
    fills) each count as `apply_capacity` does. The same `seed` gives every rank the same
    draw, so the ranks' exchanged sizes agree."""
    capacity = None
    if moe.moe_expert_capacity_factor is not None:
        capacity = min(tokens, expert_capacity(tokens, moe.num_experts, moe.moe_router_topk,
                                               moe.moe_expert_capacity_factor))
    return _drawn_counts(tokens, moe.num_experts, moe.moe_router_topk, capacity,
                         moe.moe_pad_expert_input_to_capacity, seed)


@functools.lru_cache(maxsize=4096)
def _drawn_counts(tokens: int, experts: int, topk: int, capacity: int | None, pad: bool,
                  seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    weights = (torch.randn(experts, generator=gen, dtype=torch.float64) * STAND_IN_SKEW).exp()
    if experts > topk:
        weights[seed % experts] = 0.0
    picks = torch.multinomial(weights.expand(tokens, -1), topk, generator=gen)
    counts = torch.bincount(picks.flatten(), minlength=experts)
    if capacity is not None:
        counts = torch.full_like(counts, capacity) if pad else counts.clamp(max=capacity)
    return tuple(counts.tolist())

def apply_capacity(probs: Tensor, routing_map: Tensor, moe: MoEConfig) -> tuple[Tensor, Tensor]:
    """Dense [T, E] weights and map with each expert's over-capacity tokens dropped (with
    padding: the map holds exactly `capacity` tokens per expert, the added ones of weight 0)."""
    tokens, experts = probs.shape
    capacity = expert_capacity(tokens, experts, moe.moe_router_topk,
                               moe.moe_expert_capacity_factor)
    if capacity >= tokens:
        keep = torch.ones_like(routing_map)
    elif moe.moe_token_drop_policy == "probs":
        best = probs.topk(capacity, dim=0).indices
        keep = torch.zeros_like(routing_map).scatter(0, best, True)
    else:  # position: an expert's first `capacity` routed tokens (then the first others)
        order = routing_map.to(torch.int64) * (2 * tokens) - torch.arange(
            tokens, device=probs.device).unsqueeze(1)
        best = order.topk(capacity, dim=0).indices
        keep = torch.zeros_like(routing_map).scatter(0, best, True)
    final = keep if moe.moe_pad_expert_input_to_capacity else routing_map & keep
    return probs * final, final


def aux_scores(logits: Tensor, moe: MoEConfig) -> tuple[Tensor, Tensor]:
    """(scores over all experts [T, E], fp32 at least; their plain top-k map [T, E]) for the
    aux loss."""
    logits = _scoring(logits)
    if moe.moe_router_score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    ids = scores.topk(moe.moe_router_topk, dim=-1).indices
    return scores, torch.zeros_like(scores, dtype=torch.bool).scatter(1, ids, True)


def switch_loss(scores: Tensor, counts: Tensor, tokens: int, topk: int, experts: int) -> Tensor:
    """E / (k T^2) x sum_e scores summed over these tokens x `counts` (routed tokens, of all
    T): this rank's share of the Switch load-balancing loss (without coefficient)."""
    return (scores.sum(0) * counts).sum() * (experts / (topk * tokens * tokens))


class _AttachLoss(torch.autograd.Function):
    """Identity on `x`; backward also sends d(loss) = `scale` into `loss`, so the loss's
    gradient joins the model's without being added to the language-model loss value."""

    @staticmethod
    def forward(ctx, x: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        shape, dtype, device = ctx.loss_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def attach_loss(x: Tensor, loss: Tensor, scale: float) -> Tensor:
    return _AttachLoss.apply(x, loss, scale)


@dataclass
class RouterStats:
    """What a router saw since the step began, kept for the step's log and the bias update."""

    tokens_per_expert: Tensor
    """[E] float64 routed tokens (after capacity), summed over micro-batches."""
    aux_loss: Tensor
    """This rank's share of the load-balancing loss (no coefficient), summed over
    micro-batches."""
    z_loss: Tensor
    """This rank's share of the z-loss (no coefficient), summed over micro-batches."""


class Router(nn.Module):
    """Linear gate [E, h] (replicated over TP) + `route`, with the losses attached."""

    def __init__(self, hidden: int, moe: MoEConfig, ctx: LayerContext, *, std: float,
                 name: str) -> None:
        super().__init__()
        self.moe = moe
        self.experts = moe.num_experts
        self.splits_over_tp = ctx.sequence_parallel
        """Each TP rank routes its own slice of the sequence (SP), not a copy of all tokens."""
        self.token_groups = [(g, kind) for g, kind, on in (
            (ctx.tp_group, "tp", self.splits_over_tp), (ctx.cp_group, "cp", ctx.cp_size > 1)) if on]
        """The groups (and their kinds) the micro-batch's tokens are split over: TP under SP,
        and CP."""
        self.sp_size = (ctx.tp_size if self.splits_over_tp else 1) * ctx.cp_size
        self.weight = tags.mark_replicated(nn.Parameter(init_shard(
            (moe.num_experts, hidden), None, std=std, seed=ctx.seed, name=name, tp_size=1,
            tp_rank=0, device=ctx.device, dtype=ctx.dtype)))
        if ctx.sequence_parallel:
            tags.mark_sequence_parallel_grad(self.weight)
        self.router_dtype = ROUTER_DTYPES.get(moe.moe_router_dtype or "")
        bias = torch.zeros(moe.num_experts, dtype=torch.float32, device=ctx.device)
        self.register_buffer("expert_bias", bias if moe.moe_router_enable_expert_bias
                             else None)
        self.loss_scale = 1.0
        """d(step loss)/d(this router's loss per micro-batch): 1 / (micro-batches x DP), set
        by the step (`moe.set_loss_scale`), as Megatron scales its aux losses."""
        self.stats = self._zero_stats()

    def _zero_stats(self) -> RouterStats:
        zero = torch.zeros((), dtype=torch.float64, device=self.weight.device)
        return RouterStats(torch.zeros(self.experts, dtype=torch.float64,
                                       device=self.weight.device), zero, zero.clone())

    def pop_stats(self) -> RouterStats:
        stats, self.stats = self.stats, self._zero_stats()
        return stats

    def forward(self, x: Tensor, seq: int) -> tuple[Tensor, Tensor]:
        """x [T, h] (T = seq x b, sequence-major) -> dense weights and map [T, E]."""
        dtype = self.router_dtype or x.dtype
        logits = F.linear(x.to(dtype), self.weight.to(dtype))
        weights, ids = route(logits, self.moe, self.expert_bias)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, True)
        probs = torch.zeros_like(logits).scatter(1, ids, weights)
        if self.moe.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_capacity(probs, routing_map, self.moe)
        if torch.is_grad_enabled():
            # a full-recompute rerun (inside backward) attaches the losses again, as autograd
            # needs, but its statistics were counted by the forward it repeats
            record = torch._C._current_graph_task_id() == -1
            probs = self._losses(logits, probs, seq, record)
            if record:
                with torch.no_grad():
                    self.stats.tokens_per_expert += routing_map.sum(0).to(torch.float64)
        return probs, routing_map

    def _losses(self, logits: Tensor, probs: Tensor, seq: int, record: bool) -> Tensor:
        """Attach the configured losses to `probs` (their gradients) and, with `record`,
        add their values to the step's statistics."""
        moe, k, experts = self.moe, self.moe.moe_router_topk, self.experts
        if moe.moe_z_loss_coeff:
            z = torch.logsumexp(logits, dim=-1).square().mean() / self.sp_size
            probs = attach_loss(probs, z * moe.moe_z_loss_coeff, self.loss_scale)
            if record:
                self.stats.z_loss = self.stats.z_loss + z.detach().to(torch.float64)
        balancing = moe.moe_router_load_balancing_type
        if not moe.moe_aux_loss_coeff or balancing == "none":
            return probs
        scores, top = aux_scores(logits, moe)
        if balancing == "aux_loss":
            counts = self._summed(top.sum(0).to(scores.dtype))
            loss = switch_loss(scores, counts, top.size(0) * self.sp_size, k, experts)
        else:  # seq_aux_loss: sequences as extra "experts" columns, then averaged
            batch = logits.size(0) // seq
            scores, top = scores.reshape(seq, batch * experts), top.reshape(seq, batch * experts)
            counts = self._summed(top.sum(0).to(scores.dtype))
            loss = switch_loss(scores, counts, seq * self.sp_size, k, experts) / batch
        if record:
            self.stats.aux_loss = self.stats.aux_loss + loss.detach().to(torch.float64)
        return attach_loss(probs, loss * moe.moe_aux_loss_coeff, self.loss_scale)

    def _summed(self, counts: Tensor) -> Tensor:
        """Token counts of the whole micro-batch (summed over the ranks splitting it)."""
        for group, kind in self.token_groups:
            counts = comms.all_reduce_(counts, group, kind=kind)
        return counts
