"""Differentiable collectives for tensor and sequence parallelism.

Each region is an autograd Function whose backward is the conjugate of its forward
(copy <-> all-reduce, split <-> all-gather, all-gather <-> reduce-scatter), so a layer only
states where its input and output live and the gradients follow. Every op takes the group
explicitly and is a no-op for a group of one (or None), which is how one model file runs at
TP=1 in a single process and at TP=8 on a node. Every op also takes `kind`, the logical group
its caller means (tp, ep, edp, world, ...: `ParallelState.ranks_by_kind`): a dry run checks
the group is this rank's group of that kind (`audit.group_kind`; otherwise nothing is built).

Sequence-parallel ops split and gather along dim 0 (activations are sequence-first [s, b, h],
so each rank's slice is contiguous).
"""

from __future__ import annotations

import math
import pickle
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_lite.parallel import host_syncs
from megatron_lite.parallel.audit import group_kind, op_identity

Group = dist.ProcessGroup | None


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: Tensor, group: Group, kind: str) -> Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    with group_kind(kind):
        dist.all_reduce(x, group=group)
    return x


def _split(x: Tensor, dim: int, group: Group) -> Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.size(dim) % n:
        raise ValueError(f"cannot split dim {dim} of size {x.size(dim)} into {n} equal parts")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def _gather(x: Tensor, dim: int, group: Group, kind: str) -> Tensor:
    n = group_size(group)
    if n == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * x.size(0), *x.shape[1:]), dtype=x.dtype, device=x.device)
    with group_kind(kind):
        dist.all_gather_single(out, x, group=group)
    return out.movedim(0, dim).contiguous() if dim else out


def _reduce_scatter(x: Tensor, group: Group, kind: str) -> Tensor:
    """Sum over the group, each rank keeping its dim-0 slice."""
    n = group_size(group)
    if n == 1:
        return x
    if x.size(0) % n:
        raise ValueError(f"cannot reduce-scatter dim 0 of size {x.size(0)} over {n} ranks")
    x = x.contiguous()
    out = torch.empty((x.size(0) // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    with group_kind(kind):
        dist.reduce_scatter_single(out, x, group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group, kind: str) -> Tensor:
        ctx.group, ctx.kind = group, kind
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return _all_reduce(grad.clone(), ctx.group, ctx.kind), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group, kind: str) -> Tensor:
        return _all_reduce(x.clone(), group, kind)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: Group, kind: str) -> Tensor:
        ctx.dim, ctx.group, ctx.kind = dim, group, kind
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _gather(grad, ctx.dim, ctx.group, ctx.kind), None, None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: Group, kind: str) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group, kind)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """All-gather along the sequence; backward reduce-scatters (each rank used the full seq)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group, kind: str) -> Tensor:
        ctx.group, ctx.kind = group, kind
        return _gather(x, 0, group, kind)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return _reduce_scatter(grad, ctx.group, ctx.kind), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group, kind: str) -> Tensor:
        ctx.group, ctx.kind = group, kind
        return _reduce_scatter(x, group, kind)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return _gather(grad, 0, ctx.group, ctx.kind), None, None


class _AllToAll(torch.autograd.Function):
    """Rows exchanged between the ranks of a group, `send[i]` rows to rank i and
    `recv[i]` from it; the backward sends the gradients back the same way (splits swapped)."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group: Group, kind: str
                ) -> Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.kind = send, recv, group, kind
        return _all_to_all(x, send, recv, group, kind)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group, ctx.kind), None, None, None, None


def _all_to_all(x: Tensor, send: list[int], recv: list[int], group: Group, kind: str
                ) -> Tensor:
    out = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype, device=x.device)
    with group_kind(kind):
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def all_to_all_rows(x: Tensor, send: list[int], recv: list[int], group: Group, *, kind: str
                    ) -> Tensor:
    """Differentiable all-to-all of `x`'s rows: `send[i]` consecutive rows go to rank i, the
    result holds `recv[i]` rows from each rank i in rank order (MoE token dispatch)."""
    return x if group_size(group) == 1 else _AllToAll.apply(x, send, recv, group, kind)


class PendingRows:
    """An all-to-all started by `start_all_to_all_rows`: its result may be read only after
    `wait` (the rows it sends are kept alive until then)."""

    def __init__(self) -> None:
        self.work: dist.Work | None = None
        self.sent: Tensor | None = None

    def wait(self, rows: Tensor) -> Tensor:
        """`rows` (the started exchange's output), usable from here on."""
        return _WaitRows.apply(rows, self) if self.work is not None else rows


class _StartAllToAll(torch.autograd.Function):
    """`_AllToAll` issued asynchronously; the backward exchange is a blocking one."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group: Group,
                pending: PendingRows, kind: str) -> Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.kind = send, recv, group, kind
        out = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype, device=x.device)
        pending.sent = x.contiguous()
        with group_kind(kind):
            pending.work = dist.all_to_all_single(out, pending.sent, recv, send, group=group,
                                                  async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        return (_all_to_all(grad, ctx.recv, ctx.send, ctx.group, ctx.kind),
                None, None, None, None, None)


class _WaitRows(torch.autograd.Function):
    """Identity that first waits for the pending exchange writing its input."""

    @staticmethod
    def forward(ctx, rows: Tensor, pending: PendingRows) -> Tensor:
        pending.work.wait()
        pending.work = pending.sent = None
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def start_all_to_all_rows(x: Tensor, send: list[int], recv: list[int], group: Group, *,
                          kind: str) -> tuple[Tensor, PendingRows]:
    """`all_to_all_rows` started, not finished: compute what does not need its result, then
    `pending.wait(rows)` (MoE's shared-expert overlap)."""
    pending = PendingRows()
    if group_size(group) == 1:
        return x, pending
    return _StartAllToAll.apply(x, send, recv, group, pending, kind), pending


def all_to_all_counts(counts: Tensor, group: Group, *, kind: str) -> Tensor:
    """Non-differentiable all-to-all of a [n, k] table: row i goes to rank i; row j of the
    result came from rank j (the per-expert token counts an all-to-all dispatch needs)."""
    if group_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    with group_kind(kind):
        dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def copy_to_region(x: Tensor, group: Group, *, kind: str) -> Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce backward."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group, kind)


def reduce_from_region(x: Tensor, group: Group, *, kind: str) -> Tensor:
    """Leave a TP region by summing partial outputs: all-reduce forward, identity backward."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group, kind)


def scatter_to_region(x: Tensor, dim: int, group: Group, *, kind: str) -> Tensor:
    """Keep this rank's slice along `dim`; backward all-gathers."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, dim, group, kind)


def gather_from_region(x: Tensor, dim: int, group: Group, *, kind: str) -> Tensor:
    """All-gather slices along `dim`; backward keeps this rank's slice of the gradient."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, dim, group, kind)


def gather_from_sequence_region(x: Tensor, group: Group, *, kind: str) -> Tensor:
    """SP -> TP region: all-gather dim 0 forward, reduce-scatter backward."""
    return x if group_size(group) == 1 else _GatherFromSequenceRegion.apply(x, group, kind)


def reduce_scatter_to_sequence_region(x: Tensor, group: Group, *, kind: str) -> Tensor:
    """TP region -> SP: reduce-scatter dim 0 forward, all-gather backward."""
    return x if group_size(group) == 1 else _ReduceScatterToSequenceRegion.apply(x, group, kind)


def all_gather_dim0(x: Tensor, group: Group, *, kind: str, async_op: bool = False
                    ) -> tuple[Tensor, dist.Work | None]:
    """Non-differentiable all-gather of a contiguous `x`'s dim-0 slices, for autograd Functions
    that place their own collectives. With `async_op` the output is valid only after the
    returned Work's wait() (the caller keeps `x` alive until then: hence no hidden copy here)."""
    if group_size(group) == 1:
        return x, None
    out = torch.empty((group_size(group) * x.size(0), *x.shape[1:]), dtype=x.dtype,
                      device=x.device)
    with group_kind(kind):
        return out, dist.all_gather_single(out, x, group=group, async_op=async_op)


def reduce_scatter_dim0(x: Tensor, group: Group, *, kind: str, async_op: bool = False
                        ) -> tuple[Tensor, dist.Work | None]:
    """Non-differentiable sum of a contiguous `x` over `group`, keeping this rank's dim-0 slice.
    With `async_op`, `x` must stay alive and unmodified, and the output unread, until the
    returned Work's wait()."""
    n = group_size(group)
    if n == 1:
        return x, None
    if x.size(0) % n:
        raise ValueError(f"cannot reduce-scatter dim 0 of size {x.size(0)} over {n} ranks")
    out = torch.empty((x.size(0) // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    with group_kind(kind):
        return out, dist.reduce_scatter_single(out, x, group=group, async_op=async_op)


def all_reduce_(x: Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                *, kind: str) -> Tensor:
    """In-place, non-differentiable all-reduce (gradients, statistics); no-op for one rank."""
    if group_size(group) > 1:
        with group_kind(kind):
            dist.all_reduce(x, op=op, group=group)
    return x


def host_scalar(x: Tensor) -> float:
    """A one-element tensor's value on the host (a device sync), NaN on the meta device.

    A dry run (`--dry-run-ranks`) runs the real step on meta tensors, which carry shapes but
    no values; whatever the step reads back for logging then reads "no value" instead.
    """
    if x.is_meta:
        host_syncs.note_meta_syncs(x.device, 1, "host_scalar")
        return math.nan
    return x.item()


def host_value(x: Tensor, dry_run: Any) -> Any:
    """`x` read on the host (`tolist()`: a number or nested lists; a device sync), or the
    caller's `dry_run` stand-in on the meta device, whose tensors have shapes but no values.
    The one place a read-back tells a dry run apart; like host_scalar it counts the read a
    GPU would pay."""
    if x.is_meta:
        host_syncs.note_meta_syncs(x.device, 1, "host_value")
        return dry_run
    return x.tolist()


def barrier(group: Group, device: torch.device, *, kind: str, status: int = 0,
            timeout_s: float | None = None) -> int:
    """Wait until every member of `group` gets here, with a one-element all-reduce on `device`;
    returns the largest `status` any member brought (so a failure reported at the barrier
    reaches every member, which can then stop cleanly instead of hanging in the next one).

    torch's barrier picks its own tensor device from the backend, which a CUDA-only group
    (cuda:gloo, or the meta-only dry-run group) has no backend for; a reduction on the run's
    device works on every group and is as cheap. With `timeout_s`, TimeoutError when the
    others have not all arrived in time, or a member's end ended the reduction (the caller
    knows whom it waits for and says so).
    """
    if group_size(group) == 1:
        return status
    value = torch.full((1,), status, dtype=torch.int64, device=device)
    if timeout_s is None:
        with group_kind(kind):
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return int(host_value(value[0], status))
    with group_kind(kind):
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group, async_op=True)
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():  # polled: Work.wait(timeout) is not honoured by every backend
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every one of {group_size(group)} ranks reached the barrier "
                               f"within {timeout_s:.0f} s")
        time.sleep(0.005)
    try:
        work.wait()
    except RuntimeError as e:  # gloo's own timeout, or a peer that closed its connection
        raise TimeoutError(f"the barrier over {group_size(group)} ranks failed ({e})") from e
    return int(host_value(value[0], status))


def all_gather_objects(obj: object, group: Group, device: torch.device, *, kind: str) -> list:
    """Every group member's picklable `obj`, in group-rank order, over tensors on `device`.

    Unlike torch's all_gather_object (which picks the device from the backend name), the
    bytes travel on the run's device, so a CUDA-only group (NCCL, cuda:gloo) accepts them.
    """
    n = group_size(group)
    if n == 1:
        return [obj]
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = torch.empty(n, dtype=torch.int64, device=device)
    with op_identity("object_sizes"), group_kind(kind):
        dist.all_gather_into_tensor(sizes, size, group=group)
    if payload.is_meta:
        # A dry run: the longest payload is a value meta cannot read back. Every rank sends
        # the same one-byte stand-in (the ops still match as a real run's would) and reads
        # its own object as every member's.
        gathered = torch.empty(n, dtype=torch.uint8, device=device)
        with op_identity("object_bytes"), group_kind(kind):
            dist.all_gather_into_tensor(gathered, payload[:1], group=group)
        return [obj] * n
    longest = int(sizes.max().item())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:payload.numel()] = payload
    gathered = torch.empty(n * longest, dtype=torch.uint8, device=device)
    with op_identity("object_bytes"), group_kind(kind):
        dist.all_gather_into_tensor(gathered, padded, group=group)
    host = gathered.cpu().view(n, longest)
    return [pickle.loads(host[r, :int(k)].numpy().tobytes()) for r, k in enumerate(sizes.tolist())]


# Flat-buffer collectives for data-parallel gradient and parameter sync. Unlike the regions
# above they are not differentiable; they work in place on contiguous buffers, may run
# asynchronously (the returned Work is waited on later) and record their traffic in an
# explicit `Traffic` counter so that tests and benchmarks can compare communication volumes.


@dataclass
class Traffic:
    """Collective calls made and bytes sent by this rank, per collective name.

    Bytes are the ring-algorithm volume a rank sends (what bus-bandwidth figures assume):
    all-reduce 2(n-1)/n x size, reduce-scatter (n-1)/n x input, all-gather (n-1)/n x output.
    An all-reduce is a reduce-scatter plus an all-gather, so ZeRO-1 and plain DP sending the
    same bytes is a checkable fact rather than a claim. Call `reset()` between measurements.
    """

    calls: dict[str, int] = field(default_factory=dict)
    bytes_sent: dict[str, int] = field(default_factory=dict)

    def record(self, name: str, nbytes: int) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.bytes_sent[name] = self.bytes_sent.get(name, 0) + nbytes

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_sent.values())

    def reset(self) -> None:
        self.calls.clear()
        self.bytes_sent.clear()


class WaitClock:
    """Exposed communication: time spent waiting for collectives, `with clock: work.wait()`.

    On CUDA, `Work.wait()` (and a blocking NCCL collective) does not block the host; it makes
    the compute stream wait for the communication stream. CUDA events recorded on the compute
    stream before and after therefore time that stream's stall: the part of the communication
    that compute did not hide. Elsewhere (gloo on CPU) wait() blocks the host and
    `perf_counter` measures the same thing. Callers use the one code path on both.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._start = 0.0

    def __enter__(self) -> WaitClock:
        if self.cuda:
            self._events.append((torch.cuda.Event(enable_timing=True),
                                 torch.cuda.Event(enable_timing=True)))
            self._events[-1][0].record()
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.cuda:
            self.seconds += time.perf_counter() - self._start
            return
        self._events[-1][1].record()
        if len(self._events) > 256:  # nobody popped (a benchmark): fold to bound the list
            self.seconds += self._drain()

    def _drain(self) -> float:
        total = 0.0
        for begin, end in self._events:
            end.synchronize()
            total += begin.elapsed_time(end) / 1e3
        self._events.clear()
        return total

    def pop_seconds(self) -> float:
        """Waiting time since the last pop (syncs on CUDA: call after the step's loss)."""
        total, self.seconds = self.seconds + self._drain(), 0.0
        return total


def _ring_share(nbytes: int, n: int) -> int:
    return nbytes * (n - 1) // n


def all_reduce_flat(x: Tensor, group: Group, *, kind: str, async_op: bool = False,
                    traffic: Traffic | None = None) -> dist.Work | None:
    """In-place sum of a contiguous buffer over `group`; returns the Work when async."""
    n = group_size(group)
    if n == 1:
        return None
    if traffic is not None:
        traffic.record("all_reduce", 2 * _ring_share(x.numel() * x.element_size(), n))
    with group_kind(kind):
        return dist.all_reduce(x, group=group, async_op=async_op)


def reduce_scatter_flat(out: Tensor, x: Tensor, group: Group, *, kind: str,
                        async_op: bool = False,
                        traffic: Traffic | None = None) -> dist.Work | None:
    """Sum `x` over `group` and keep this rank's 1/n slice in `out` (may be a view of `x`)."""
    n = group_size(group)
    if n == 1:
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        return None
    if traffic is not None:
        traffic.record("reduce_scatter", _ring_share(x.numel() * x.element_size(), n))
    with group_kind(kind):
        return dist.reduce_scatter_single(out, x, group=group, async_op=async_op)


def all_gather_flat(out: Tensor, x: Tensor, group: Group, *, kind: str, async_op: bool = False,
                    traffic: Traffic | None = None) -> dist.Work | None:
    """Concatenate every rank's `x` into `out` in rank order (`x` may be a view of `out`)."""
    n = group_size(group)
    if n == 1:
        if out.data_ptr() != x.data_ptr():
            out.copy_(x)
        return None
    if traffic is not None:
        traffic.record("all_gather", _ring_share(out.numel() * out.element_size(), n))
    with group_kind(kind):
        return dist.all_gather_single(out, x, group=group, async_op=async_op)
