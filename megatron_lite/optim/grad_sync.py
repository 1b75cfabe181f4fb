"""Gradient synchronisation across the replicas of a parameter: the interface every
--data-parallel-sharding-strategy implements, and the parameter all-gather ZeRO-1/2 share.

A strategy owns how the gradients and parameters of one rank's `ParamBuffers` are kept
across its `ReplicaGroup` (DP x CP): the post-accumulate hooks that take each micro-batch's
gradient, when a bucket's reduction starts, waiting for the reductions, and bringing the
parameters up to date after AdamW changed the owned slices. The optimizer (optim/optimizer.py)
chooses one at build time and only ever calls this interface:

    begin(num_microbatches)   a step starts (the gradients are zero)
    on_grad(i, param)         a parameter's micro-batch gradient arrived (the hook)
    start(chunk)              a model chunk ran its last backward (the pipeline's hint)
    finish()                  every bucket reduced; the owned gradient slices are final
    after_step(async_op)      the owned parameter slices changed: bring the others in
    wait_params()             outstanding parameter gathers are done
    gathered() / write_param / param_tensors / grad_tensors / grad_bytes

The strategies (optim/sync_full.py: all-reduce and ZeRO-1; optim/sync_sharded.py: ZeRO-2 and
ZeRO-3) share this base class's bookkeeping: arrivals per parameter (a bucket can start
once its members' last micro-batch is in), the tied-embedding buckets, the hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from megatron_lite.config import ParallelConfig
from megatron_lite.optim import zero3
from megatron_lite.optim.fp8_params import Fp8Params
from megatron_lite.optim.param_buffers import BucketKey, ParamBuffers
from megatron_lite.parallel import comms
from megatron_lite.parallel.audit import op_identity
from megatron_lite.parallel.state import ReplicaGroup


@dataclass
class SyncContext:
    """What a strategy is told besides the buffers: its group and the run's knobs."""

    replicas: ReplicaGroup
    """The DP x CP ranks holding the same parameters: the only group a strategy reduces over."""
    parallel: ParallelConfig
    reduce_tied: Callable[[Tensor], None]
    """Sums a tied-embedding gradient over the first and last pipeline stage, in place
    (before that bucket's DP reduction: the two stages finish backward at different times)."""
    traffic: comms.Traffic
    """DP bytes and calls of the gradient reductions and parameter gathers (tests, bench)."""
    wait_clock: comms.WaitClock
    """Exposed DP communication (the waits the compute could not hide)."""
    grad_check: Callable[[Tensor], None] | None = None
    """Called with each bucket's local gradient right before its DP reduction (NaN/Inf
    checks that can name the rank; see megatron_lite/reliability)."""
    tp_group: dist.ProcessGroup | None = None
    """The TP group an FP8 weight's amax spans (--fp8-param-gather)."""


def arrived_too_late(name: str, microbatches: int) -> RuntimeError:
    return RuntimeError(
        f"a gradient of {name} arrived after its bucket's DP reduction started: more "
        f"backward passes per step than the {microbatches} micro-batches the config implies")


class GradSync:
    """The interface (module docstring) and the bookkeeping every strategy shares."""

    def __init__(self, chunks: Sequence[nn.Module], bufs: ParamBuffers, ctx: SyncContext
                 ) -> None:
        self.bufs, self.ctx = bufs, ctx
        self._index = {id(p): i for i, p in enumerate(bufs.params)}
        self.num_microbatches = 1
        self._arrivals = [0] * len(bufs.params)
        self._waiting: dict[BucketKey, int] = {}
        self.hooks: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(partial(self.on_grad, i))
            for i, p in enumerate(bufs.params)]

    # ---- gradients -------------------------------------------------------------------------

    def begin(self, num_microbatches: int) -> None:
        """A step of `num_microbatches` backward passes starts; its gradients are zero."""
        self.num_microbatches = num_microbatches
        for shard in self.bufs.shards:
            shard.zero_grad()
        for p in self.bufs.params:
            p.grad = None
        self._arrivals = [0] * len(self.bufs.params)
        self._waiting = {key: len(m) for key, m in self.bufs.members.items()}

    def _last_arrival(self, i: int) -> BucketKey | None:
        """Count parameter `i`'s micro-batch gradient; its bucket when that was the last
        gradient the bucket waited for this step (it can be reduced now), else None."""
        self._arrivals[i] += 1
        if self._arrivals[i] != self.num_microbatches:
            return None
        key = self.bufs.slot[i]
        self._waiting[key] -= 1
        return key if self._waiting[key] == 0 else None

    def _check(self, grad: Tensor) -> None:
        if self.ctx.grad_check is not None:
            self.ctx.grad_check(grad)

    def on_grad(self, i: int, param: nn.Parameter) -> None:
        raise NotImplementedError

    def start(self, chunk: int) -> None:
        """Chunk `chunk` ran its last backward: its buckets may start (default: wait)."""

    def finish(self) -> None:
        raise NotImplementedError

    def grad_tensors(self) -> list[Tensor]:
        """The gradient storage kept through a step (full buffers or owned shards)."""
        return ([b.grad for b in self.bufs.buffers if b.grad is not None]
                + [s.grad for s in self.bufs.shards if s.grad is not None])

    def grad_bytes(self) -> int:
        """Bytes of that gradient storage (the memory report)."""
        return (sum(b.nbytes() for b in self.bufs.buffers)
                + sum(s.grad_nbytes() for s in self.bufs.shards))

    # ---- parameters ------------------------------------------------------------------------

    def after_step(self, async_op: bool) -> None:
        """The owned parameter slices changed (default: every rank owns all of them)."""

    def wait_params(self) -> None:
        """Outstanding parameter gathers are done (default: there are none)."""

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter holds its full value inside (default: always)."""
        yield

    def write_param(self, param: nn.Parameter, value: Tensor) -> None:
        """Set a parameter's local tensor (e.g. from a checkpoint); a weight whose values are
        kept as owned slices only (`zero3.OwnedParamBuffer`) gets its owned part."""
        i = self._index[id(param)]
        buffer = self.bufs.buffers[self.bufs.slot[i][0]]
        if isinstance(buffer, zero3.ShardedParamBuffer):
            buffer.write_param(self.bufs.local[i], value)
            return
        with torch.no_grad():
            param.copy_(value)

    def param_tensors(self) -> list[Tensor]:
        """The parameter storage kept through a step."""
        return list(self.bufs.params)

    def close(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()


class ParamGather:
    """ZeRO-1/2: after AdamW updated the owned slices, all-gather every bucket's parameters;
    with --overlap-param-gather in the background, each module waiting for its buckets in
    a forward pre-hook of the next step. Under --fp8-param-gather the FP8 linears' buckets
    are cast and gathered in fp8 (optim/fp8_params.py), once already at construction: their
    forwards read the fp8 copy from the first step on, and the model keeps no bf16 copy of
    those weights (`gathered` makes one for reading)."""

    def __init__(self, chunks: Sequence[nn.Module], bufs: ParamBuffers, ctx: SyncContext,
                 hooks: list[RemovableHandle]) -> None:
        self.bufs, self.ctx = bufs, ctx
        self._gathers: dict[BucketKey, dist.Work | None] = {}
        self.fp8 = (Fp8Params(chunks, bufs, ctx.replicas, ctx.tp_group, per_unit=False)
                    if bufs.fp8 else None)
        if self.fp8 is not None:
            self._start_fp8(async_op=False, kind="fp8_param_init")
        if not ctx.parallel.overlap_param_gather:
            return
        slot = {id(p): bufs.slot[i] for i, p in enumerate(bufs.params)}
        for chunk in chunks:
            for module in chunk.modules():
                keys = {slot[id(p)] for p in module.parameters(recurse=False) if id(p) in slot}
                if keys:
                    hooks.append(module.register_forward_pre_hook(
                        partial(self._wait, sorted(keys))))

    def start(self, async_op: bool) -> None:
        """All-gather each bucket's updated slices, first-used (last) bucket first."""
        if self.fp8 is not None:
            self._start_fp8(async_op)
        replicas = self.ctx.replicas
        for key in reversed(self.bufs.bucket_keys()):
            if key[0] in self.bufs.fp8:
                continue
            buffer = self.bufs.buffers[key[0]]
            bucket = buffer.layout.buckets[key[1]]
            own = bucket.shard(replicas.size, replicas.rank)
            with op_identity("param_gather", buffer=key[0], bucket=key[1]):
                self._gathers[key] = comms.all_gather_flat(
                    buffer.bucket_param(bucket), buffer.param[own.start:own.end],
                    replicas.group, kind=replicas.kind, async_op=async_op,
                    traffic=self.ctx.traffic)

    def _start_fp8(self, async_op: bool, kind: str = "fp8_param_gather") -> None:
        """Cast and gather the fp8 buckets; `kind` names the gathers for the dry run (the
        first, at construction, apart)."""
        self.fp8.cast()
        for key in reversed(self.bufs.bucket_keys()):
            if key[0] in self.bufs.fp8:
                self._gathers[key] = self.fp8.gather(key, async_op, self.ctx.traffic, kind)

    def _wait(self, keys: list[BucketKey], *_: object) -> None:
        """Forward pre-hook (--overlap-param-gather): this module's params must be current."""
        for key in keys:
            handle = self._gathers.pop(key, None)
            if handle is not None:
                with self.ctx.wait_clock:
                    handle.wait()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """The FP8 weights hold their (dequantized fp8) values inside, in bf16 buckets
        allocated for it and given back after (collective-free)."""
        keys = [key for key in self.bufs.bucket_keys() if key[0] in self.bufs.fp8]
        self.wait_all()
        for key in keys:
            zero3.allocate(self.bufs.buffers[key[0]].full[key[1]])
            self.fp8.dequantize(key)
        try:
            yield
        finally:
            for key in keys:
                zero3.free(self.bufs.buffers[key[0]].full[key[1]])

    def tensors(self) -> list[Tensor]:
        """Storage of its own kept through a step (the fp8 bytes, the FP8 weights' slices)."""
        return [] if self.fp8 is None else self.fp8.tensors()

    def wait_all(self) -> None:
        self._wait(list(self._gathers))
