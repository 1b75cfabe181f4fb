"""ZeRO-3 (--data-parallel-sharding-strategy optim_grads_params): parameters sharded over DP.

Every rank keeps only its 1/dp slice of each bucket of the parameter buffer (the same slice
ZeRO-1 updates), so between uses a model chunk holds 2/dp bytes per bf16 parameter; with the
sharded gradient and optimizer state that is 18/dp bytes per parameter (2 + 4 + 12).

Each model chunk says how it is cut into units (its `sharding_units()`, e.g. LlamaChunk's:
the embedding, each transformer layer, the head); each unit's parameters form their own
buckets (a bucket never spans two units). A unit is materialised by all-gathering its
buckets into full-size bucket tensors that its parameters' `.data` permanently view; freeing
resizes those storages to zero bytes, so the parameters keep their identity (autograd's saved
references to the weights, the optimizer's hooks) and only the bytes come and go. Per micro-batch:

- forward: a pre-hook on the unit's first module waits for its gather (or runs it) and starts
  the next unit's gather asynchronously; a post-hook on its last module frees every unit whose
  last forward user it is, and hooks the unit's output gradient. The last unit (the head) is
  the exception: with ZeRO-3 (no PP) its backward follows at once, so freeing it would only
  buy a blocking re-gather; when its output needs a gradient, it and what it reads stay
  gathered for the backward;
- backward: that output-gradient hook fires before any of the unit's backward nodes run; it
  re-gathers the unit (waiting for the prefetch; the head is still gathered) and starts the
  previous unit's gather;
- once the last parameter of a unit has received its gradient (the post-accumulate hooks),
  every node that reads those weights has run, and the unit is freed. The optimizer's own
  hooks, which run first, have by then reduce-scattered the unit's buckets into the gradient
  shards (ZeRO-2's path: a bucket goes as soon as all its members arrived).

So each unit but the head is gathered twice per micro-batch (the head once) and its gradients
reduce-scattered once. A weight used by two units (the tied embedding read by the head) stays
gathered from its first forward use through the head's backward to its own: one gather per
micro-batch, one more unit of memory all along (planner.gathered_unit_bytes counts it). A
forward whose backward never comes (a measuring forward with autograd on) leaves the head
gathered; the next forward's first unit gives it back. Recomputation composes: a forward
re-run inside backward (detected with autograd's current graph task) only waits for the
units it reads and frees nothing; the backward then frees them as above.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from megatron_lite.optim.buffers import Bucket, BufferLayout, Range
from megatron_lite.parallel import comms
from megatron_lite.parallel.audit import op_identity
from megatron_lite.parallel.state import ReplicaGroup

if TYPE_CHECKING:  # fp8_params imports this module (OwnedSlices)
    from megatron_lite.optim.fp8_params import Fp8Params

BucketKey = tuple[int, int]
"""(buffer index, bucket index)."""


def unit_modules(chunks: Sequence[nn.Module]) -> list[tuple[nn.Module, ...]]:
    """Every chunk's units in forward order (chunk by chunk)."""
    units = []
    for chunk in chunks:
        if not hasattr(chunk, "sharding_units"):
            raise TypeError(f"{type(chunk).__name__} does not say how ZeRO-3 cuts it into "
                            "units (a `sharding_units()` method)")
        units += chunk.sharding_units()
    return units


def unit_of_params(units: Sequence[tuple[nn.Module, ...]]) -> dict[int, int]:
    """id(parameter) -> the first unit (in forward order) that holds it."""
    owner: dict[int, int] = {}
    for u, modules in enumerate(units):
        for module in modules:
            for p in module.parameters():
                owner.setdefault(id(p), u)
    return owner


class OwnedSlices:
    """The owned ranges of a flat buffer (one per bucket), stored back to back and addressed
    in buffer coordinates, so code written for a full-size buffer (`buffer.param[a:b]` inside
    one owned range) runs unchanged on the shard."""

    def __init__(self, owned: Sequence[Range], dtype: torch.dtype, device: torch.device
                 ) -> None:
        self.owned = list(owned)
        self._starts = [r.start for r in self.owned]
        self.offsets = [0]
        for r in self.owned:
            self.offsets.append(self.offsets[-1] + r.size)
        self.data = torch.zeros(self.offsets[-1], dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __getitem__(self, index: slice) -> Tensor:
        """Buffer range [start, stop) inside the owned ranges, which may span touching ones
        (at one replica every bucket is owned whole; merged norm ranges cross buckets)."""
        start, stop = index.start, index.stop
        if stop <= start:
            return self.data[:0]
        first, last = self._offset(start), self._offset(stop - 1)
        if last - first != stop - 1 - start:
            raise IndexError(f"buffer range [{start}, {stop}) is not inside the owned ranges")
        return self.data[first:last + 1]

    def _offset(self, position: int) -> int:
        b = bisect_right(self._starts, position) - 1
        if b < 0 or position >= self.owned[b].end:
            raise IndexError(f"buffer element {position} is not owned here")
        return self.offsets[b] + position - self.owned[b].start

    def bucket(self, b: int) -> Tensor:
        return self.data[self.offsets[b]:self.offsets[b + 1]]

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def free(t: Tensor) -> None:
    """Give a full-size tensor's bytes back (its views keep their shapes)."""
    t.untyped_storage().resize_(0)


def allocate(t: Tensor) -> None:
    """Give a freed tensor its bytes again (contents undefined until written)."""
    t.untyped_storage().resize_(t.numel() * t.element_size())


class ShardedParamBuffer:
    """`GradBuffer(full_grad=False)` without full-size tensors either: the owned slice of
    the parameters (`param`, an `OwnedSlices`), no gradient buffer (the reduced gradient is
    the ShardState's), and per bucket a full-size parameter tensor (`full`) that the
    parameters view and that holds bytes only while its unit is gathered."""

    def __init__(self, params: Sequence[nn.Parameter], layout: BufferLayout,
                 grad_dtype: torch.dtype, dp_rank: int) -> None:
        self.params, self.layout, self.grad_dtype = list(params), layout, grad_dtype
        self.grad = None
        first = self.params[0]
        self.param = OwnedSlices(layout.owned(dp_rank, sharded=True), first.dtype,
                                 first.device)
        self.full: list[Tensor] = []
        with torch.no_grad():
            for bucket, own in zip(layout.buckets, self.param.owned):
                full = torch.zeros(bucket.range.size, dtype=first.dtype, device=first.device)
                for i in bucket.params:
                    p = self.params[i]
                    r = layout.param_ranges[i].relative_to(bucket.range.start)
                    view = full[r.start:r.end].view_as(p)
                    view.copy_(p.detach())
                    p.data = view  # the unsharded original is dropped here
                local = own.relative_to(bucket.range.start)
                self.param.bucket(bucket.index).copy_(full[local.start:local.end])
                free(full)
                self.full.append(full)

    def new_bucket_grad(self, bucket: Bucket, dtype: torch.dtype) -> Tensor:
        """A zeroed stand-alone gradient for one bucket (one micro-batch of one unit)."""
        return torch.zeros(bucket.range.size, dtype=dtype, device=self.param.device)

    def param_grad_view(self, bucket_grad: Tensor, bucket: Bucket, i: int) -> Tensor:
        """Parameter `i`'s part of a `new_bucket_grad` tensor, shaped like the parameter."""
        r = self.layout.param_ranges[i].relative_to(bucket.range.start)
        return bucket_grad[r.start:r.end].view_as(self.params[i])

    def write_param(self, i: int, value: Tensor) -> None:
        """Set parameter `i` (a full local tensor, e.g. from a checkpoint): its owned part."""
        r = self.layout.param_ranges[i]
        flat = value.reshape(-1)
        for own in self.param.owned:
            part = r.intersect(own)
            if part is not None:
                self.param[part.start:part.end].copy_(
                    flat[part.start - r.start:part.end - r.start])

    def nbytes(self) -> int:
        """Bytes of a full-size gradient buffer: none."""
        return 0


class OwnedParamBuffer(ShardedParamBuffer):
    """ZeRO-1/2 under --fp8-param-gather, for the FP8 linears' weights: their values are kept
    as owned slices only (what AdamW writes and the fp8 cast reads), since every forward reads
    the gathered fp8 copy instead (optim/fp8_params.py), the way Transformer Engine keeps an
    fp8 parameter in place of the bf16 one; the gradient is ZeRO-1's full-size buffer
    (`full_grad`) or, under ZeRO-2, none. The bf16 buckets hold bytes only inside a
    `gathered()` (for reading weights outside a forward)."""

    def __init__(self, params: Sequence[nn.Parameter], layout: BufferLayout,
                 grad_dtype: torch.dtype, dp_rank: int, full_grad: bool) -> None:
        super().__init__(params, layout, grad_dtype, dp_rank)
        if full_grad:
            first = self.params[0]
            self.grad = torch.zeros(layout.numel, dtype=grad_dtype, device=first.device)
            for p, r in zip(self.params, layout.param_ranges):
                p.main_grad = self.grad[r.start:r.end].view_as(p)

    def bucket_grad(self, bucket: Bucket) -> Tensor:
        return self.grad[bucket.range.start:bucket.range.end]

    def nbytes(self) -> int:
        """Bytes of the full-size gradient buffer (0 without one)."""
        return 0 if self.grad is None else self.grad.numel() * self.grad.element_size()


@dataclass
class Unit:
    """One gather unit: its modules (run in this order), its own buckets, what it reads."""

    modules: tuple[nn.Module, ...]
    keys: list[BucketKey]
    uses: list[int]
    """Units whose parameters its forward reads (itself first)."""
    params: list[int]
    """Optimizer indices of the parameters it owns."""


def _in_backward() -> bool:
    """True inside an autograd backward pass (a recomputation's forward runs there)."""
    return torch._C._current_graph_task_id() != -1


class FullyShardedParams:
    """Gathers and frees the units of one rank's model chunks (see the module docstring)."""

    def __init__(self, chunks: Sequence[nn.Module], params: Sequence[nn.Parameter],
                 slot: Sequence[BucketKey], buffers: Sequence[ShardedParamBuffer],
                 replicas: ReplicaGroup, traffic: comms.Traffic,
                 fp8: Fp8Params | None = None) -> None:
        self.buffers, self.replicas, self.traffic = list(buffers), replicas, traffic
        self.fp8 = fp8  # --fp8-param-gather: FP8 weights' buckets gathered as fp8 bytes
        self.params, self.slot = list(params), list(slot)
        modules = unit_modules(chunks)
        owner = unit_of_params(modules)
        index = self._index = {id(p): i for i, p in enumerate(self.params)}
        self._buffer_index = {id(p): j for buf in self.buffers for j, p in enumerate(buf.params)}
        self.units: list[Unit] = []
        for u, mods in enumerate(modules):
            mine = [index[id(p)] for p in dict.fromkeys(q for m in mods for q in m.parameters())
                    if owner[id(p)] == u and id(p) in index]
            reads = {owner[id(p)] for m in mods for p in m.parameters() if id(p) in index}
            self.units.append(Unit(mods, sorted({self.slot[i] for i in mine}),
                                   [u, *sorted(reads - {u})], mine))
        self._unit_of = {i: u for u, unit in enumerate(self.units) for i in unit.params}
        if len(self._unit_of) != len(self.params):
            raise ValueError("some trainable parameters belong to no module of any ZeRO-3 "
                             "unit (`sharding_units()` must cover the whole chunk)")
        last_use: dict[int, int] = {}
        for u, unit in enumerate(self.units):
            for v in unit.uses:
                last_use[v] = u
        self._frees_after = [[v for v, last in last_use.items() if last == u]
                             for u in range(len(self.units))]
        self._gathers: dict[int, list[dist.Work | None]] = {}
        """Unit -> its in-flight all-gathers."""
        self._ready: set[int] = set()
        self._arrived: set[int] = set()
        """Parameters whose gradient of the running backward pass is in."""
        self.peak_gathered_bytes = 0
        """The most bytes of full-size parameter buckets held at once so far."""
        self.blocking_gathers = 0
        """Gathers not prefetched (the compute waited for all of it) so far: per micro-batch
        the first unit's forward only (the head stays gathered into its backward)."""
        self._kept: set[int] = set()
        """Units the head's forward left gathered for the backward that follows it."""
        self._holding_all = False
        """Inside `gathered()`: nothing is given back by the hooks' bookkeeping."""
        self.hooks: list[RemovableHandle] = []
        for u, unit in enumerate(self.units):
            self.hooks.append(unit.modules[0].register_forward_pre_hook(
                partial(self._before_forward, u)))
            self.hooks.append(unit.modules[-1].register_forward_hook(
                partial(self._after_forward, u)))
        for i, p in enumerate(self.params):
            self.hooks.append(p.register_post_accumulate_grad_hook(partial(self._on_grad, i)))

    # ---- gather / free ---------------------------------------------------------------------

    def _start_gather(self, u: int, async_op: bool) -> None:
        self.blocking_gathers += not async_op
        works = []
        for key in self.units[u].keys:
            if self._is_fp8(key):
                works.append(self.fp8.gather(key, async_op, self.traffic, "fp8_unit_gather"))
                continue
            buffer = self.buffers[key[0]]
            full = buffer.full[key[1]]
            allocate(full)
            with op_identity("unit_gather", unit=u, buffer=key[0], bucket=key[1]):
                works.append(comms.all_gather_flat(full, buffer.param.bucket(key[1]),
                                                   self.replicas.group,
                                                   kind=self.replicas.kind, async_op=async_op,
                                                   traffic=self.traffic))
        self._gathers[u] = works
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def _prefetch(self, u: int) -> None:
        if u not in self._ready and u not in self._gathers:
            self._start_gather(u, async_op=True)

    def materialize(self, u: int) -> None:
        """Unit `u`'s parameters hold their full values once this returns."""
        if u in self._ready:
            return
        if u not in self._gathers:
            self._start_gather(u, async_op=False)
        for work in self._gathers.pop(u):
            if work is not None:
                work.wait()
        self._ready.add(u)

    def release(self, u: int) -> None:
        """Give unit `u`'s full-size bytes back (waits for a gather still in flight)."""
        if u in self._gathers:
            self.materialize(u)
        if u in self._ready:
            for key in self.units[u].keys:
                free(self.buffers[key[0]].full[key[1]])
                if self._is_fp8(key):
                    self.fp8.release(key)
            self._ready.discard(u)

    def _is_fp8(self, key: BucketKey) -> bool:
        return self.fp8 is not None and key[0] in self.fp8.wire

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit materialised inside (reading weights outside a forward, e.g. in tests:
        a freed parameter has no bytes, and reading one is undefined, even a crash)."""
        for u in range(len(self.units)):
            self.materialize(u)
            for key in filter(self._is_fp8, self.units[u].keys):  # bf16 from the fp8 values
                allocate(self.buffers[key[0]].full[key[1]])
                self.fp8.dequantize(key)
        self._holding_all = True
        try:
            yield
        finally:
            self._holding_all = False
            self._kept.clear()
            for u in range(len(self.units)):
                self.release(u)

    # ---- hooks -----------------------------------------------------------------------------

    def _before_forward(self, u: int, *_: object) -> None:
        if u == 0 and self._kept and not _in_backward() and not self._holding_all:
            for v in self._kept - set(self.units[0].uses):
                self.release(v)  # the last forward had no backward
            self._kept.clear()
        for v in self.units[u].uses:
            self.materialize(v)
        if not _in_backward() and u + 1 < len(self.units):
            for v in self.units[u + 1].uses:
                self._prefetch(v)

    def _after_forward(self, u: int, _module: nn.Module, _args: object, output: object
                       ) -> None:
        if _in_backward():
            return  # a recomputation: the backward frees these units once their grads are in
        needs_grad = isinstance(output, Tensor) and output.requires_grad
        if needs_grad:
            output.register_hook(partial(self._before_backward, u))
        if needs_grad and u == len(self.units) - 1:
            self._kept.update(self._frees_after[u])  # its backward comes next: keep them
            return
        for v in self._frees_after[u]:
            self.release(v)

    def _before_backward(self, u: int, _grad: Tensor) -> None:
        for v in self.units[u].uses:
            self.materialize(v)
        if u > 0:
            for v in self.units[u - 1].uses:
                self._prefetch(v)

    def _on_grad(self, i: int, _param: nn.Parameter) -> None:
        """Post-accumulate hook, after the optimizer's: free a unit whose gradients are in."""
        u = self._unit_of[i]
        self._arrived.add(i)
        if all(j in self._arrived for j in self.units[u].params):
            self._arrived.difference_update(self.units[u].params)
            self._kept.discard(u)
            self.release(u)

    def zero_grad(self) -> None:
        self._arrived.clear()

    def close(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()

    def write_param(self, param: nn.Parameter, value: Tensor) -> None:
        """Set a parameter from a full local tensor (loading a checkpoint)."""
        key = self.slot[self._index[id(param)]]
        self.buffers[key[0]].write_param(self._buffer_index[id(param)], value)

    def gathered_bytes(self) -> int:
        """Bytes of full-size parameter buckets held right now (gathered or arriving)."""
        return sum(self.buffers[k[0]].full[k[1]].untyped_storage().nbytes()
                   + (self.fp8.full[k].untyped_storage().nbytes() if self._is_fp8(k) else 0)
                   for u in self._ready | set(self._gathers) for k in self.units[u].keys)
