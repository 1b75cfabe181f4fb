"""The strategies with a full-size gradient buffer: all-reduce (no_shard) and ZeRO-1 (optim).

A hook on every parameter adds its micro-batch gradient into `param.main_grad`, its view of
the buffer (fp32, or bf16 with --grad-reduce-in-bf16), and frees `.grad`. Once per step each
bucket is summed over the replica group (the loss is already divided by the global batch's
token count, so a sum is the mean gradient): by an all-reduce, or under ZeRO-1 by a
reduce-scatter that leaves each rank the slice it updates. With --overlap-grad-reduce a bucket
starts as soon as its members' last micro-batch gradients are in, or when the pipeline says
the chunk is done (`start`); otherwise `finish` starts them all.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch.distributed as dist
from torch import Tensor, nn

from megatron_lite.optim.grad_sync import GradSync, ParamGather, SyncContext, arrived_too_late
from megatron_lite.optim.param_buffers import BucketKey, ParamBuffers
from megatron_lite.parallel import comms
from megatron_lite.parallel.audit import op_identity


class AllReduce(GradSync):
    """no_shard: every replica keeps the whole summed gradient and updates everything."""

    def __init__(self, chunks: Sequence[nn.Module], bufs: ParamBuffers, ctx: SyncContext
                 ) -> None:
        super().__init__(chunks, bufs, ctx)
        self._handles: dict[BucketKey, dist.Work | None] = {}
        """The buckets whose reduction started this step."""

    def begin(self, num_microbatches: int) -> None:
        super().begin(num_microbatches)
        self._handles.clear()

    def on_grad(self, i: int, param: nn.Parameter) -> None:
        key = self.bufs.slot[i]
        if key in self._handles:
            raise arrived_too_late(self.bufs.names[i], self.num_microbatches)
        param.main_grad.add_(param.grad)
        param.grad = None
        if not self.ctx.parallel.overlap_grad_reduce:
            return
        ready = self._last_arrival(i)
        if ready is not None and ready not in self.bufs.deferred:
            self._launch(ready)

    def start(self, chunk: int) -> None:
        if not self.ctx.parallel.overlap_grad_reduce:
            return
        for key in self.bufs.bucket_keys():
            if (self.bufs.chunk_of[key] == chunk and key not in self._handles
                    and key not in self.bufs.deferred):
                self._launch(key)

    def finish(self) -> None:
        """Tied embeddings over the embedding group, the buckets not started, then wait."""
        for key in sorted(self.bufs.deferred):
            buffer = self.bufs.buffers[key[0]]
            for j in buffer.layout.buckets[key[1]].params:
                self.ctx.reduce_tied(buffer.params[j].main_grad)
        keys = self.bufs.bucket_keys()
        for key in keys:
            if key not in self._handles:
                self._launch(key)
        for key in keys:
            handle = self._handles[key]
            if handle is not None:
                handle.wait()

    def _launch(self, key: BucketKey) -> None:
        """Start one bucket's reduction (asynchronously)."""
        buffer = self.bufs.buffers[key[0]]
        grad = buffer.bucket_grad(buffer.layout.buckets[key[1]])
        self._check(grad)
        with op_identity("grad_reduce", buffer=key[0], bucket=key[1]):
            self._handles[key] = self._reduce(key, grad)

    def _reduce(self, key: BucketKey, grad: Tensor) -> dist.Work | None:
        return comms.all_reduce_flat(grad, self.ctx.replicas.group,
                                     kind=self.ctx.replicas.kind, async_op=True,
                                     traffic=self.ctx.traffic)


class Zero1(AllReduce):
    """optim (ZeRO-1): the bucket is reduce-scattered, each rank keeps and updates its slice
    (masters and Adam state for 1/n of the parameters), then all-gathers the parameters."""

    def __init__(self, chunks: Sequence[nn.Module], bufs: ParamBuffers, ctx: SyncContext
                 ) -> None:
        super().__init__(chunks, bufs, ctx)
        self.gather = ParamGather(chunks, bufs, ctx, self.hooks)

    def _reduce(self, key: BucketKey, grad: Tensor) -> dist.Work | None:
        buffer = self.bufs.buffers[key[0]]
        replicas = self.ctx.replicas
        own = buffer.layout.buckets[key[1]].shard(replicas.size, replicas.rank)
        return comms.reduce_scatter_flat(buffer.grad[own.start:own.end], grad, replicas.group,
                                         kind=replicas.kind, async_op=True,
                                         traffic=self.ctx.traffic)

    def after_step(self, async_op: bool) -> None:
        self.gather.start(async_op)

    def wait_params(self) -> None:
        self.gather.wait_all()

    def param_tensors(self) -> list[Tensor]:
        return [*self.bufs.params, *self.gather.tensors()]

    @contextmanager
    def gathered(self) -> Iterator[None]:
        with self.gather.gathered():
            yield
