"""--fp8-param-gather: the FP8 linears' weights travel in fp8 after the update.

With the distributed optimizer each rank updates its slice of every bucket, then all ranks
all-gather the parameters (optim/grad_sync.py's `ParamGather`). The weights of FP8 linears
(layers/fp8.py) are cast to fp8 by every forward anyway, so their buffers (buffers of their
own: optim/param_buffers.py) are cast before the gather instead, each piece by the rank that
owns it, and gathered as bytes: 1 byte per element instead of bf16's 2.

For a piece to cast to the forward's fp8 values its owner needs the forward's scale before
anyone holds the whole weight: the whole weight's amax is the MAX of its pieces' amaxes over
the replicas, then over TP (one all-reduce each, of one float per weight), and under delayed
scaling the scale comes from the weight's amax history, as in the forward
(`fp8.weight_scale`). A piece is cast from the model's copy of the owned slice, which AdamW
has just written from the fp32 masters (rounded to the model's dtype first, as Megatron
does), so the fp8 values, the scales and the amaxes recorded for the history are those of a
run without --fp8-param-gather, bit for bit.

The linears compute with the gathered bytes (their `fp8_weight`, a view of `full`), and the
model's copy of each such weight is overwritten on every rank, owners too, with the
dequantized fp8 values: evaluation, export and the checkpoint's model weights see the weight
the forward computes with, while the fp32 masters stay exact. That costs 1 byte per element
for `wire` beside the model's copy (the planner counts it). A skipped step changes and
gathers nothing: the last cast stays.

Under ZeRO-3 (optim/zero3.py) the cast fills the owned slices only, every update; a unit's
gather then brings its FP8 buckets in as fp8 bytes (its bf16 buckets stay empty: the linears
read only the fp8 copy) and gives them back with the unit. Only `gathered()`, for reading
weights outside a forward, fills the bf16 copy, from the fp8 values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron_lite.layers import fp8, tags
from megatron_lite.optim import zero3
from megatron_lite.optim.buffers import Range, intersections
from megatron_lite.optim.param_buffers import BucketKey, ParamBuffers
from megatron_lite.parallel import comms
from megatron_lite.parallel.audit import op_identity
from megatron_lite.parallel.state import ReplicaGroup


class Fp8Params:
    """The fp8 buffers of one sync group: the bytes each rank casts (`wire`: the whole buffer,
    or under ZeRO-3 only the owned slices), the full-size bytes of each bucket the gathers fill
    (`full`: views of `wire`, or under ZeRO-3 tensors of their own that hold bytes only while
    their unit is gathered), the linears reading them, and the owned pieces."""

    def __init__(self, chunks: Sequence[nn.Module], bufs: ParamBuffers, replicas: ReplicaGroup,
                 tp_group: dist.ProcessGroup | None, per_unit: bool) -> None:
        """`per_unit`: ZeRO-3 (its units gather and free the buckets), else ZeRO-1/2 (one
        gather after each step into a `wire` that stays)."""
        self.bufs, self.replicas, self.tp_group = bufs, replicas, tp_group
        linears = {id(m.weight): m for chunk in chunks for m in chunk.modules()
                   if tags.is_fp8_weight(getattr(m, "weight", None))}
        self.wire: dict[int, Tensor | zero3.OwnedSlices] = {}
        self.full: dict[BucketKey, Tensor] = {}
        self.sharded = per_unit
        self.linears: list[nn.Module] = []
        self._weight_of: dict[tuple[int, int], int] = {}
        """(buffer, parameter in it) -> index into `linears`."""
        for b in sorted(bufs.fp8):
            buffer = bufs.buffers[b]
            device = buffer.params[0].device
            layout = buffer.layout
            if self.sharded:
                self.wire[b] = zero3.OwnedSlices(bufs.shards[b].owned, torch.uint8, device)
            else:
                self.wire[b] = torch.zeros(layout.numel, dtype=torch.uint8, device=device)
            for bucket in layout.buckets:
                r = bucket.range
                full = self.full[b, bucket.index] = (
                    torch.zeros(r.size, dtype=torch.uint8, device=device) if self.sharded
                    else self.wire[b][r.start:r.end])
                for j in bucket.params:
                    p, pr = buffer.params[j], layout.param_ranges[j].relative_to(r.start)
                    module = linears[id(p)]
                    # `.data`: a version counter of its own, as a ZeRO-3 parameter's view
                    # has; re-gathering the same bytes before backward is no modification
                    module.fp8_weight = fp8.Fp8Weight(
                        full[pr.start:pr.end].view(fp8.FWD_DTYPE).view(p.shape).data,
                        torch.ones((), dtype=torch.float32, device=device),
                        torch.zeros((), dtype=torch.float32, device=device))
                    self._weight_of[b, j] = len(self.linears)
                    self.linears.append(module)
                if self.sharded:
                    zero3.free(full)
        self._pieces = [(self._weight_of[b, j], b, overlap)
                        for b in sorted(bufs.fp8)
                        for bucket, own in zip(bufs.buffers[b].layout.buckets,
                                               bufs.shards[b].owned)
                        for j, overlap in intersections(
                            own, bufs.buffers[b].layout.param_ranges, bucket.params)]
        """(weight, buffer, owned range in buffer coordinates) for every owned piece."""

    def cast(self) -> None:
        """Every owned piece to fp8 in `wire`, with its whole weight's forward scale."""
        device = self.replicas.device
        amax = torch.zeros(len(self.linears), dtype=torch.float32, device=device)
        if self._pieces:
            local = torch.stack([self._param(b, r).abs().amax().float()
                                 for _, b, r in self._pieces])
            index = torch.tensor([w for w, _, _ in self._pieces], device=device)
            amax.scatter_reduce_(0, index, local, "amax")
        with op_identity("fp8_weight_amax", group=0):
            comms.all_reduce_(amax, self.replicas.group, op=dist.ReduceOp.MAX,
                              kind=self.replicas.kind)
        with op_identity("fp8_weight_amax", group=1):
            comms.all_reduce_(amax, self.tp_group, op=dist.ReduceOp.MAX, kind="tp")
        scales = []
        for w, module in enumerate(self.linears):
            cached = module.fp8_weight
            cached.amax.copy_(amax[w])
            scale = fp8.weight_scale(cached.amax, module.fp8, module.fp8_state)
            cached.inv_scale.copy_(scale.reciprocal())
            scales.append(scale)
        for w, b, r in self._pieces:
            self.wire[b][r.start:r.end].view(fp8.FWD_DTYPE).copy_(
                fp8.cast_scaled(self._param(b, r), scales[w]))

    def gather(self, key: BucketKey, async_op: bool, traffic: comms.Traffic, kind: str
               ) -> dist.Work | None:
        """All-gather one bucket's fp8 bytes (the owned slice was `cast`); `kind`: its
        identity's name (tells the dry run's ops apart). Under ZeRO-3 the bucket's bytes are
        allocated first (`release` gives them back)."""
        bucket = self.bufs.buffers[key[0]].layout.buckets[key[1]]
        own = bucket.shard(self.replicas.size, self.replicas.rank)
        full = self.full[key]
        if self.sharded:
            zero3.allocate(full)
        with op_identity(kind, buffer=key[0], bucket=key[1]):
            return comms.all_gather_flat(full, self.wire[key[0]][own.start:own.end],
                                         self.replicas.group, kind=self.replicas.kind,
                                         async_op=async_op,
                                         traffic=traffic)

    def release(self, key: BucketKey) -> None:
        """ZeRO-3: a gathered bucket's bytes back."""
        zero3.free(self.full[key])

    @torch.no_grad()
    def dequantize(self, key: BucketKey) -> None:
        """A gathered bucket's weights := their fp8 values, dequantized, into the bf16 bucket
        that `gathered()` allocated for reading them (the model keeps none otherwise)."""
        buffer = self.bufs.buffers[key[0]]
        for j in buffer.layout.buckets[key[1]].params:
            cached = self.linears[self._weight_of[key[0], j]].fp8_weight
            buffer.params[j].copy_(cached.data.float() * cached.inv_scale)

    def _param(self, b: int, r: Range) -> Tensor:
        return self.bufs.buffers[b].param[r.start:r.end]

    def tensors(self) -> list[Tensor]:
        """The fp8 bytes kept through a step (the memory report, the dry run), and under
        ZeRO-1/2 the FP8 weights' owned slices (ZeRO-3 lists its own)."""
        if self.sharded:
            return [w.data for w in self.wire.values()]
        return [*self.wire.values(), *(self.bufs.buffers[b].param.data for b in self.wire)]
