"""The strategies without a full-size gradient: ZeRO-2 (optim_grads) and ZeRO-3
(optim_grads_params).

The hook adds a micro-batch gradient into a bucket-sized tensor made when the bucket's first
gradient arrives; once every member has arrived the tensor is reduce-scattered into the
owned fp32 shard (`ShardState.grad`) and dropped, so at most the buckets in flight exist at
full size. With gradient accumulation this happens every micro-batch (the default,
--sharded-grad-accumulation reduce-scatter: fp32 accumulation, no full-size storage,
gradient traffic x micro-batches: 1.5x ZeRO-1's total at 2 micro-batches, measured in
tests/optim/test_sharding.py); `full-buffer` keeps the buckets alive in the parameter dtype
(bf16: 2 B/param) until the last micro-batch and sends ZeRO-1's bytes. Per micro-batch is the
default because memory is what ZeRO-2 is chosen for; the shard is folded into this rank's
slice of the next micro-batch's input, so the collective returns the running sum.

ZeRO-3 adds optim/zero3.py's `FullyShardedParams`: parameters gathered per unit for its
forward and backward instead of all-gathered after the step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch.distributed as dist
from torch import Tensor, nn

from megatron_lite.optim import zero3
from megatron_lite.optim.fp8_params import Fp8Params
from megatron_lite.optim.grad_sync import GradSync, ParamGather, SyncContext, arrived_too_late
from megatron_lite.optim.param_buffers import BucketKey, ParamBuffers
from megatron_lite.parallel import comms
from megatron_lite.parallel.audit import op_identity

MAX_INFLIGHT_SCATTERS = 2
"""Reduce-scatters that may run at once; each holds a bucket-sized input."""


class Zero2(GradSync):
    """optim_grads: reduce-scatter from the hooks into the owned gradient shard."""

    def __init__(self, chunks: Sequence[nn.Module], bufs: ParamBuffers, ctx: SyncContext
                 ) -> None:
        super().__init__(chunks, bufs, ctx)
        self.full_accumulator = ctx.parallel.sharded_grad_accumulation == "full-buffer"
        """One reduce-scatter per step from a bucket kept in the parameter dtype."""
        self._live: dict[BucketKey, Tensor] = {}
        """Bucket gradients accumulating since their last reduce-scatter."""
        self._seen: dict[BucketKey, set[int]] = {}
        """Members that added a gradient into the live bucket tensor."""
        self._inflight: dict[BucketKey, tuple[dist.Work | None, Tensor | None]] = {}
        """Each bucket's latest reduce-scatter and the input it must keep alive (None once
        waited for)."""
        self._scattered: set[BucketKey] = set()
        """Buckets whose shard already holds a part of this step's gradient."""
        self.gather = self._param_gather(chunks)

    def _param_gather(self, chunks: Sequence[nn.Module]) -> ParamGather | None:
        return ParamGather(chunks, self.bufs, self.ctx, self.hooks)

    def begin(self, num_microbatches: int) -> None:
        super().begin(num_microbatches)
        self._live.clear()
        self._seen.clear()
        self._inflight.clear()
        self._scattered.clear()

    def on_grad(self, i: int, param: nn.Parameter) -> None:
        """Add into the bucket's live tensor; reduce-scatter it once every member has
        arrived (each micro-batch, or with a full-buffer accumulator the last)."""
        key = self.bufs.slot[i]
        last = self._last_arrival(i)
        if self._arrivals[i] > self.num_microbatches:
            raise arrived_too_late(self.bufs.names[i], self.num_microbatches)
        buffer = self.bufs.buffers[key[0]]
        bucket = buffer.layout.buckets[key[1]]
        live = self._live.get(key)
        if live is None:
            dtype = buffer.param.dtype if self.full_accumulator else buffer.grad_dtype
            live = self._live[key] = buffer.new_bucket_grad(bucket, dtype)
        buffer.param_grad_view(live, bucket, self.bufs.local[i]).add_(param.grad)
        param.grad = None
        if key in self.bufs.deferred:
            return
        if self.full_accumulator:
            if last is not None:
                self._scatter(key)
            return
        seen = self._seen.setdefault(key, set())
        seen.add(i)
        if len(seen) == len(self.bufs.members[key]):
            self._scatter(key)

    def start(self, chunk: int) -> None:
        for key in self.bufs.bucket_keys():
            if (self.bufs.chunk_of[key] == chunk and key in self._live
                    and key not in self.bufs.deferred):
                self._scatter(key)

    def finish(self) -> None:
        """Tied embeddings over the embedding group, the buckets still live (or never
        scattered: every rank must join every collective), then wait for all."""
        for key in sorted(self.bufs.deferred):
            buffer = self.bufs.buffers[key[0]]
            bucket = buffer.layout.buckets[key[1]]
            live = self._live.get(key)
            if live is None:
                live = self._live[key] = buffer.new_bucket_grad(bucket, buffer.grad_dtype)
            for j in bucket.params:
                self.ctx.reduce_tied(buffer.param_grad_view(live, bucket, j))
        for key in self.bufs.bucket_keys():
            if key in self._live or key not in self._scattered:
                self._scatter(key)
        self._retire(keep=0)
        self._inflight.clear()

    def _scatter(self, key: BucketKey) -> None:
        """Reduce-scatter the live bucket tensor into the owned gradient shard.

        A bucket scattered earlier in the step (an earlier micro-batch) already holds a sum
        in its shard: this rank adds it into its own slice of the input first, so the
        collective's result is the running total and no shard-sized temporary is needed.
        """
        replicas = self.ctx.replicas
        buffer = self.bufs.buffers[key[0]]
        bucket = buffer.layout.buckets[key[1]]
        out = self.bufs.shards[key[0]].bucket_grad_shard(key[1])
        live = self._live.pop(key, None)
        if live is None:
            live = buffer.new_bucket_grad(bucket, out.dtype)
        self._seen.pop(key, None)
        self._check(live)
        send = live if live.dtype == out.dtype else live.to(out.dtype)
        if key in self._scattered:
            handle = self._inflight.pop(key)[0]  # (re-inserted last: dicts keep launch order)
            if handle is not None:
                handle.wait()
            own = bucket.shard(replicas.size, replicas.rank).relative_to(bucket.range.start)
            send[own.start:own.end].add_(out)
        with op_identity("grad_reduce_scatter", buffer=key[0], bucket=key[1]):
            handle = comms.reduce_scatter_flat(out, send, replicas.group, kind=replicas.kind,
                                               async_op=True,
                                               traffic=self.ctx.traffic)
        self._inflight[key] = (handle, send)
        self._scattered.add(key)
        self._retire(keep=MAX_INFLIGHT_SCATTERS)

    def _retire(self, keep: int) -> None:
        """Wait for the oldest reduce-scatters until `keep` still hold their input: without
        this every bucket's input would live until `finish`, a full-size gradient."""
        running = [k for k, (_, send) in self._inflight.items() if send is not None]
        for key in running[:max(0, len(running) - keep)]:
            handle = self._inflight[key][0]
            if handle is not None:
                handle.wait()
            self._inflight[key] = (None, None)

    def after_step(self, async_op: bool) -> None:
        if self.gather is not None:
            self.gather.start(async_op)

    def wait_params(self) -> None:
        if self.gather is not None:
            self.gather.wait_all()

    def param_tensors(self) -> list[Tensor]:
        return [*self.bufs.params, *(self.gather.tensors() if self.gather is not None else [])]

    @contextmanager
    def gathered(self) -> Iterator[None]:
        with self.gather.gathered():
            yield


class Zero3(Zero2):
    """optim_grads_params: ZeRO-2's gradients, and parameters kept as owned slices that
    `FullyShardedParams` gathers per unit (its hooks run after the gradient hooks)."""

    def __init__(self, chunks: Sequence[nn.Module], bufs: ParamBuffers, ctx: SyncContext
                 ) -> None:
        super().__init__(chunks, bufs, ctx)
        self.fp8 = (Fp8Params(chunks, bufs, ctx.replicas, ctx.tp_group, per_unit=True)
                    if bufs.fp8 else None)
        """--fp8-param-gather: the owned fp8 bytes, cast after every update (and now)."""
        if self.fp8 is not None:
            self.fp8.cast()
        self.fsdp = zero3.FullyShardedParams(chunks, bufs.params, bufs.slot, bufs.buffers,
                                             ctx.replicas, ctx.traffic, self.fp8)
        self.hooks += self.fsdp.hooks

    def _param_gather(self, chunks: Sequence[nn.Module]) -> ParamGather | None:
        return None  # a unit is gathered when its forward needs it

    def begin(self, num_microbatches: int) -> None:
        super().begin(num_microbatches)
        self.fsdp.zero_grad()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        with self.fsdp.gathered():
            yield

    def write_param(self, param: nn.Parameter, value: Tensor) -> None:
        """Only the owned slice is kept."""
        self.fsdp.write_param(param, value)

    def after_step(self, async_op: bool) -> None:
        if self.fp8 is not None:  # the units' next gathers send the new fp8 bytes
            self.fp8.cast()

    def param_tensors(self) -> list[Tensor]:
        return [b.param.data for b in self.bufs.buffers] + (
            self.fp8.tensors() if self.fp8 is not None else [])

