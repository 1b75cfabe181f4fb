"""Global gradient norm over a model split across TP, PP (and DP shards), each weight once.

A weight replicated over TP (norm weights) is counted on TP rank 0 only; the last stage's copy
of a tied embedding is skipped (the first stage holds the same gradient). The squared sums are
then added over the model-parallel group (tp x pp), or over every rank when each DP rank
holds a different shard of the gradients (distributed optimizer).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from megatron_lite.layers import tags
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState


def counts_toward_norm(param: nn.Parameter, pstate: ParallelState) -> bool:
    """True when this rank is the one that owns `param`'s contribution to the global norm."""
    if tags.is_replicated(param) and pstate.tp_rank != 0:
        return False
    return not (tags.is_shared_embedding(param) and not pstate.is_first_stage)


def global_norm(grads: Iterable[Tensor], pstate: ParallelState, *, sharded_over_dp: bool,
                dtype: torch.dtype = torch.float32) -> Tensor:
    """L2 norm of the given (already de-duplicated) gradient pieces across all ranks.

    Returns a scalar tensor of `dtype` (the accumulation dtype, the same on every rank: fp32,
    or float64 under --fp64); NaN/Inf anywhere propagates into it.
    """
    return global_norm_and_sums(grads, None, pstate, sharded_over_dp=sharded_over_dp,
                                dtype=dtype)[0]


def global_norm_and_sums(grads: Iterable[Tensor], carry: Tensor | None, pstate: ParallelState,
                         *, sharded_over_dp: bool, dtype: torch.dtype = torch.float32
                         ) -> tuple[Tensor, Tensor | None]:
    """`global_norm`, and `carry` (a 1-D tensor of `dtype`) summed over the same group in the
    same all-reduce: other per-step numbers ride along at no extra collective or sync."""
    sq = _local_square_sum(grads, pstate, dtype)
    group = pstate.world_group if sharded_over_dp else pstate.mp_group
    if carry is None:
        comms.all_reduce_(sq, group)
        return sq.sqrt(), None
    both = comms.all_reduce_(torch.cat([sq.reshape(1), carry]), group)
    return both[0].sqrt(), both[1:]


def _local_square_sum(grads: Iterable[Tensor], pstate: ParallelState, dtype: torch.dtype
                      ) -> Tensor:
    grads = [g for g in grads if g.numel()]
    if grads:
        # One fused pass per piece with fp32 accumulation (no fp32 copy of bf16 gradients),
        # the same reduction torch.nn.utils.clip_grad_norm_ uses.
        norms = torch._foreach_norm(grads, 2, dtype=dtype)
        sq = torch.stack(norms).square().sum()
    else:
        sq = torch.zeros((), dtype=dtype, device=pstate.device)
    return sq


def clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    """Scale factor (<= 1) that brings `norm` down to `max_norm`; 1 when clipping is off."""
    if max_norm <= 0:
        return torch.ones_like(norm)
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)
