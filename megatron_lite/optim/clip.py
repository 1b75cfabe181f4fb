"""Global gradient norm over a model split across TP, PP (and DP shards), each weight once.

A weight replicated over TP (norm weights) is counted on TP rank 0 only; the last stage's copy
of a tied embedding is skipped (the first stage holds the same gradient). The squared sums are
then added over a group where every element is counted once: the model-parallel group
(tp x pp) when the replicas hold the same gradient, every rank when each holds a different
shard (the distributed optimizer) or a different expert (optim/optimizer.py's groups).
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


def reduced_square_sum(grads: Iterable[Tensor], carry: Tensor | None, group: comms.Group,
                       dtype: torch.dtype, device: torch.device, *, kind: str
                       ) -> Tensor:
    """[sum of squares of the given (already de-duplicated) pieces, *carry] summed over
    `group` (of `kind`) in one all-reduce: other per-step numbers ride along at no extra
    collective or sync. A 1-D tensor of `dtype` (fp32, or float64 under --fp64); NaN/Inf
    propagates."""
    sq = _local_square_sum(grads, dtype, device).reshape(1)
    both = sq if carry is None else torch.cat([sq, carry])
    return comms.all_reduce_(both, group, kind=kind)


def _local_square_sum(grads: Iterable[Tensor], dtype: torch.dtype, device: torch.device
                      ) -> Tensor:
    grads = [g for g in grads if g.numel()]
    if grads:
        # One fused pass per piece with fp32 accumulation (no fp32 copy of bf16 gradients),
        # the same reduction torch.nn.utils.clip_grad_norm_ uses.
        norms = torch._foreach_norm(grads, 2, dtype=dtype)
        sq = torch.stack(norms).square().sum()
    else:
        sq = torch.zeros((), dtype=dtype, device=device)
    return sq


def clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    """Scale factor (<= 1) that brings `norm` down to `max_norm`; 1 when clipping is off."""
    if max_norm <= 0:
        return torch.ones_like(norm)
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)
