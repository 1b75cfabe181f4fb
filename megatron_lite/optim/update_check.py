"""Is the update AdamW is about to make sure to leave weights and Adam state finite?

With --check-for-nan-in-loss-and-grad (the default) a step is skipped unless it is, decided
before anything is written, so nothing needs restoring (no second copy of the state). Each
rank bounds its proposed update from its shards' largest |weight|, |m|, v and its LR
(`UpdateCheck.terms`); those terms ride in the gradient norm's all-reduce (the same collective
and host sync), summed over the same group: every shard when the state is sharded, the
model-parallel ranks otherwise (replicas hold identical state). With the reduced norm G
bounding every clipped gradient element, AdamW's new weight obeys
|p'| <= P (1 + lr wd) + lr / (1 - b1^t) * (M + G) / eps, and m', v' stay below M + G and
V + G^2: finite inputs, a finite LR and a bound below the dtype's largest value / 16 mean a
finite update. NaN/Inf in a weight or moment, a NaN LR, or an update that would overflow skip
the step on every rank, as a NaN gradient does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_lite.config import OptimConfig
from megatron_lite.optim.zero1 import ShardState
from megatron_lite.parallel import comms

UPDATE_LIMIT_DIVISOR = 16.0
"""The bound must stay below the dtype's largest value over this (a margin for the rounding
of the bound's own arithmetic and of the bf16 copy of the weights)."""


class UpdateCheck:
    """The bound terms of one rank's shards and the verdict on their reduced sums."""

    def __init__(self, shards: Sequence[ShardState], optim: OptimConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.shards, self.optim, self.dtype, self.device = list(shards), optim, dtype, device
        self.limit = min([torch.finfo(s.buffer.param.dtype).max for s in self.shards]
                         + [torch.finfo(s.master.dtype).max for s in self.shards],
                         default=math.inf) / UPDATE_LIMIT_DIVISOR
        self._state_max = torch.zeros(3)
        """This step's largest |master|, |exp_avg|, exp_avg_sq (for the skip message)."""

    def terms(self, step: int, lr: float, decoupled_lr: float | None, weight_decay: float
              ) -> torch.Tensor:
        """This rank's [P (1 + lr wd), M, V, lr / (1 - b1^t)] for AdamW step `step`: the
        largest |master|, |exp_avg| and exp_avg_sq of its shards, NaN when one holds a NaN;
        read-only passes over the state, no sync."""
        rates = [lr] if decoupled_lr is None else [lr, decoupled_lr]
        top = max(rates) if all(math.isfinite(r) for r in rates) else math.nan
        largest = []
        for pick in (lambda s: s.master, lambda s: s.exp_avg, lambda s: s.exp_avg_sq):
            parts = [pick(s) for s in self.shards if pick(s).numel()]
            # aminmax: one pass, no |x| temporary, NaN through (an inf-norm is ~20x slower
            # on CPU); v >= 0, so its max is its largest magnitude
            tops = [torch.maximum(lo.neg(), hi) for lo, hi in map(torch.aminmax, parts)]
            largest.append(torch.stack([t.to(self.dtype) for t in tops]).max() if tops
                           else torch.zeros((), dtype=self.dtype, device=self.device))
        self._state_max = torch.stack(largest)
        bias1 = 1.0 - self.optim.adam_beta1 ** step
        step_size = torch.full((), top / bias1, dtype=self.dtype, device=self.device)
        return torch.stack([largest[0] * (1.0 + top * weight_decay), largest[1],
                            largest[2], step_size])

    def passes(self, terms: list[float], norm: float) -> bool:
        """The summed terms say every new weight and moment is finite (module docstring)."""
        decayed, moment, variance, step_size = terms
        clip = self.optim.clip_grad
        grad = min(norm, clip) if clip > 0 else norm  # bounds every clipped gradient element
        eps = self.optim.adam_eps  # > 0 once validated; 0 (set later) is 0/0 somewhere
        ratio = (moment + grad) / eps if eps > 0 else math.inf
        bounds = (ratio, step_size * ratio, decayed + step_size * ratio, variance + grad ** 2)
        return all(math.isfinite(b) and b <= self.limit for b in bounds)

    def culprits(self, mine: torch.Tensor, norm: float, rates: list[float], rank: int,
                 group: dist.ProcessGroup | None, kind: str) -> str:
        """The rare path after a failed check: the ranks whose own terms `mine` fail it, and
        their numbers (collective over the norm's `group`, which every member joins: they
        all skip)."""
        p, m, v = self._state_max.tolist()
        found = None
        if not self.passes(mine.tolist(), norm):
            found = (f"rank {rank} (largest |weight| {p:.3g}, |Adam m| {m:.3g}, "
                     f"Adam v {v:.3g}, LR {', '.join(f'{r:.3g}' for r in rates)}, --adam-eps "
                     f"{self.optim.adam_eps:g}, gradient norm {norm:.3g})")
        every = [x for x in comms.all_gather_objects(found, group, self.device, kind=kind) if x]
        where = "; ".join(every) if every else "no single rank (only the summed bound overflows)"
        return f"the update would not be finite on {where}"
