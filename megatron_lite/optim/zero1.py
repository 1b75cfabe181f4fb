"""AdamW on the slice of each gradient buffer that this rank owns, with fp32 master weights.

With the distributed optimizer (ZeRO-1) a DP rank owns 1/dp of every bucket and keeps fp32
master weights, momentum and variance for that slice only: 12 bytes per owned element. Plain
data parallelism is the same code with every rank owning whole buckets. Slices cut through
parameters, so per-parameter facts (weight decay only on >= 2-D weights; which elements count
toward the global norm) become lists of element ranges inside the slice.

The update is torch.optim.AdamW's, element for element: decoupled decay p *= 1 - lr*wd, then
m = lerp(m, g, 1-b1), v = b2 v + (1-b2) g^2, p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps).
With --decoupled-lr the embedding and output weights take their own lr in both terms, like a
second AdamW parameter group.

Saved state (`state_dict`), one per DP rank (identical across DP ranks without sharding):
    {"format": FORMAT, "step": int, "dp_rank": int, "dp_size": int, "sharded": bool,
     "buffers": [{"param_dtype": str, "grad_dtype": str, "numel": int,
                  "buckets": [[start, end], ...], "owned": [[start, end], ...],
                  "params": [[name, start, end, [shape...]], ...]}, ...],
     "tensors": {"<buffer>.master" | "<buffer>.exp_avg" | "<buffer>.exp_avg_sq": fp32 1-D}}
Everything but "tensors" is JSON-able; each tensor is the concatenation, bucket by bucket, of
the owned ranges of that buffer (so element k of the shard is buffer element owned[b].start +
k - offset of bucket b). Loading requires the same layout and says which field differs.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_lite.config import OptimConfig
from megatron_lite.optim.buffers import GradBuffer, Range, intersections, merge

FORMAT = "megatron_lite.optimizer/1"


@dataclass(frozen=True)
class ParamInfo:
    """What the optimizer needs to know about one parameter besides its slot."""

    name: str
    shape: tuple[int, ...]
    decay: bool
    """Weight decay applies (weights with >= 2 dims)."""
    counts_in_norm: bool
    """This rank's copy contributes to the global gradient norm (see clip.counts_toward_norm)."""
    decoupled: bool = False
    """Takes --decoupled-lr (the embedding and output weights)."""


class ShardState:
    """fp32 masters and Adam moments for the owned ranges of one buffer (float64 for float64
    parameters, at least fp32 always).

    The reduced gradient of the owned ranges is read through `grad_at`/`bucket_grad_shard`:
    views of the buffer's full-size `grad`, or, when the buffer has none (ZeRO-2/3), of
    `grad`, a shard-sized tensor laid out like `master` that the reduce-scatters fill.
    """

    def __init__(self, buffer: GradBuffer, owned: Sequence[Range],
                 infos: Sequence[ParamInfo]) -> None:
        self.buffer, self.owned, self.infos = buffer, list(owned), list(infos)
        self.offsets = [0]
        for r in self.owned:
            self.offsets.append(self.offsets[-1] + r.size)
        n = self.offsets[-1]
        device = buffer.param.device
        dtype = torch.promote_types(buffer.param.dtype, torch.float32)
        self.master = torch.empty(n, dtype=dtype, device=device)
        self.exp_avg = torch.zeros(n, dtype=dtype, device=device)
        self.exp_avg_sq = torch.zeros(n, dtype=dtype, device=device)
        self.grad = (torch.zeros(n, dtype=buffer.grad_dtype, device=device)
                     if buffer.grad is None else None)
        """ZeRO-2/3: the owned reduced gradient, shard coordinates (None: in `buffer.grad`)."""
        self.copy_params_to_master()
        layout = buffer.layout
        decay, norm, decoupled = [], [], []
        for bucket, own, offset in zip(layout.buckets, self.owned, self.offsets):
            for i, overlap in intersections(own, layout.param_ranges, bucket.params):
                if infos[i].decay:
                    decay.append(overlap.relative_to(own.start - offset))
                if infos[i].counts_in_norm:
                    norm.append(overlap)
                if infos[i].decoupled:
                    decoupled.append(overlap.relative_to(own.start - offset))
        self.decay_ranges = merge(decay)
        """Shard coordinates of the elements that get weight decay."""
        self.decoupled_ranges = merge(decoupled)
        """Shard coordinates of the elements that take --decoupled-lr."""
        self.norm_ranges = merge(norm)
        """Buffer coordinates of the owned gradient elements that count toward the norm."""

    def bucket_grad_shard(self, bucket: int) -> Tensor:
        """The owned slice of bucket `bucket`'s reduced gradient (a reduce-scatter target)."""
        if self.grad is None:
            own = self.owned[bucket]
            return self.buffer.grad[own.start:own.end]
        return self.grad[self.offsets[bucket]:self.offsets[bucket + 1]]

    def grad_at(self, r: Range) -> Tensor:
        """The reduced gradient of buffer range `r`, which lies inside one owned range."""
        if self.grad is None:
            return self.buffer.grad[r.start:r.end]
        b = bisect_right([own.start for own in self.owned], r.start) - 1
        start = self.offsets[b] + r.start - self.owned[b].start
        return self.grad[start:start + r.size]

    def zero_grad(self) -> None:
        if self.grad is not None:
            self.grad.zero_()
        else:
            self.buffer.grad.zero_()

    def pieces(self) -> list[tuple[Range, slice]]:
        """(owned buffer range, matching shard slice) per bucket."""
        return [(r, slice(o, o + r.size)) for r, o in zip(self.owned, self.offsets)]

    def copy_params_to_master(self) -> None:
        with torch.no_grad():
            for own, sl in self.pieces():
                self.master[sl].copy_(self.buffer.param[own.start:own.end])

    def copy_master_to_params(self) -> None:
        """Write the owned slice back into the model's (bf16 or fp32) parameter buffer."""
        with torch.no_grad():
            for own, sl in self.pieces():
                self.buffer.param[own.start:own.end].copy_(self.master[sl])

    def norm_pieces(self) -> list[Tensor]:
        return [self.grad_at(r) for r in self.norm_ranges]

    def padding(self) -> int:
        """Owned elements that belong to no parameter (bucket padding)."""
        layout = self.buffer.layout
        used = sum(overlap.size for bucket, own in zip(layout.buckets, self.owned)
                   for _, overlap in intersections(own, layout.param_ranges, bucket.params))
        return self.master.numel() - used

    def grad_nbytes(self) -> int:
        """Bytes of the shard-sized gradient (0 when the buffer holds the gradient)."""
        return 0 if self.grad is None else self.grad.numel() * self.grad.element_size()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.master, self.exp_avg, self.exp_avg_sq))

    def _by_lr(self, shard_ranges: Sequence[Range]) -> tuple[list[Range], list[Range]]:
        """`shard_ranges` cut into (plain-lr parts, decoupled-lr parts)."""
        plain, decoupled = [], []
        for r in shard_ranges:
            start = r.start
            for d in self.decoupled_ranges:
                inside = r.intersect(d)
                if inside is None:
                    continue
                if inside.start > start:
                    plain.append(Range(start, inside.start))
                decoupled.append(inside)
                start = inside.end
            if start < r.end:
                plain.append(Range(start, r.end))
        return plain, decoupled

    @torch.no_grad()
    def adamw_step(self, cfg: OptimConfig, lr: float, step: int, grad_scale: Tensor,
                   decoupled_lr: float | None = None, weight_decay: float | None = None
                   ) -> None:
        """One AdamW update of the owned slice with gradients scaled by `grad_scale` (and decay
        `weight_decay`, default --weight-decay).

        The Adam part is one fused pass (`torch._fused_adamw_`: read g, m, v, p; write m, v, p)
        instead of ~9 elementwise passes; the fused op divides gradients by its scale, hence
        the reciprocal. Decay stays a separate multiply on the decay ranges, as torch.optim.AdamW
        does it, so the numerics match it element for element up to rounding of the scale.
        """
        lrs = (lr, lr if decoupled_lr is None else decoupled_lr)
        wd = cfg.weight_decay if weight_decay is None else weight_decay
        if wd:
            for group_lr, ranges in zip(lrs, self._by_lr(self.decay_ranges)):
                for r in ranges:
                    self.master[r.start:r.end].mul_(1.0 - group_lr * wd)
        to_buffer = {}  # shard start -> buffer start of the same element
        for own, sl in self.pieces():
            to_buffer[sl.start] = own.start
        pieces = [Range(sl.start, sl.stop) for own, sl in self.pieces() if own.size]
        for group_lr, ranges in zip(lrs, self._by_lr(pieces)):
            masters, grads, exp_avgs, exp_avg_sqs = [], [], [], []
            for r in ranges:
                origin = max(s for s in to_buffer if s <= r.start)
                start = to_buffer[origin] + r.start - origin
                grad = (self.buffer.grad[start:start + r.size] if self.grad is None
                        else self.grad[r.start:r.end])
                masters.append(self.master[r.start:r.end])
                grads.append(grad.to(self.master.dtype))
                exp_avgs.append(self.exp_avg[r.start:r.end])
                exp_avg_sqs.append(self.exp_avg_sq[r.start:r.end])
            if not masters:
                continue
            scale = grad_scale.reshape(())
            if self.master.dtype == torch.float64:
                # The fused op takes an fp32 scale only; --fp64 scales in float64 first.
                grads, scale = torch._foreach_mul(grads, scale.to(torch.float64)), None
            else:
                scale = scale.float().reciprocal()
            steps = [torch.full((), float(step), device=self.master.device)] * len(masters)
            torch._fused_adamw_(masters, grads, exp_avgs, exp_avg_sqs, [], steps,
                                lr=group_lr, beta1=cfg.adam_beta1, beta2=cfg.adam_beta2,
                                weight_decay=0.0, eps=cfg.adam_eps, amsgrad=False,
                                maximize=False, grad_scale=scale)
        self.copy_master_to_params()

    def layout_meta(self) -> dict:
        layout = self.buffer.layout
        return {"param_dtype": str(self.buffer.param.dtype).removeprefix("torch."),
                "grad_dtype": str(self.buffer.grad_dtype).removeprefix("torch."),
                "numel": layout.numel,
                "buckets": [[b.range.start, b.range.end] for b in layout.buckets],
                "owned": [[r.start, r.end] for r in self.owned],
                "params": [[info.name, r.start, r.end, list(info.shape)]
                           for info, r in zip(self.infos, layout.param_ranges)]}


def _meta(shards: Sequence[ShardState], dp_rank: int, dp_size: int, sharded: bool) -> dict:
    return {"dp_rank": dp_rank, "dp_size": dp_size, "sharded": sharded,
            "buffers": [s.layout_meta() for s in shards]}


def state_dict(shards: Sequence[ShardState], step: int, dp_rank: int, dp_size: int,
               sharded: bool) -> dict:
    """The saved state (format above) holding the live master and moment tensors.

    No device copy is made (it would need 12 extra bytes per owned element exactly when a
    save happens): callers copy before training continues, since the next step changes them.
    """
    tensors = {}
    for i, s in enumerate(shards):
        tensors.update({f"{i}.master": s.master, f"{i}.exp_avg": s.exp_avg,
                        f"{i}.exp_avg_sq": s.exp_avg_sq})
    return {"format": FORMAT, "step": step, **_meta(shards, dp_rank, dp_size, sharded),
            "tensors": tensors}


def _differences(saved: object, running: object, path: str) -> list[str]:
    if isinstance(saved, dict) and isinstance(running, dict):
        out = []
        for key in sorted(set(saved) | set(running)):
            out += _differences(saved.get(key), running.get(key), f"{path}.{key}")
        return out
    if isinstance(saved, list) and isinstance(running, list) and len(saved) == len(running):
        return [d for i, (a, b) in enumerate(zip(saved, running))
                for d in _differences(a, b, f"{path}[{i}]")]
    return [] if saved == running else [f"{path}: saved {saved!r}, running {running!r}"]


def load_state_dict(shards: Sequence[ShardState], state: dict, dp_rank: int, dp_size: int,
                    sharded: bool) -> int:
    """Restore masters and moments (not the model params); returns the saved step count."""
    if state.get("format") != FORMAT:
        raise ValueError(f"optimizer state has format {state.get('format')!r}, expected "
                         f"{FORMAT!r}: it was written by another version of megatron_lite")
    running = _meta(shards, dp_rank, dp_size, sharded)
    diffs = _differences({k: state.get(k) for k in running}, running, "state")
    if diffs:
        shown = "\n  ".join(diffs[:10]) + ("\n  ..." if len(diffs) > 10 else "")
        raise ValueError("optimizer state does not match this run's layout (same model, "
                         "--data-parallel size, --use-distributed-optimizer, bucket size and "
                         "--bf16 are needed; resharding is not supported):\n  " + shown)
    with torch.no_grad():
        for i, s in enumerate(shards):
            s.master.copy_(state["tensors"][f"{i}.master"])
            s.exp_avg.copy_(state["tensors"][f"{i}.exp_avg"])
            s.exp_avg_sq.copy_(state["tensors"][f"{i}.exp_avg_sq"])
    return int(state["step"])
