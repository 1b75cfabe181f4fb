"""Contiguous gradient/parameter buffers: the layout as pure Range arithmetic, then the tensors.

Every parameter of one dtype gets a slot in one flat buffer, in backward order (the reverse
of registration, last chunk first) so that buckets fill up front to back during backward.
The buffer is cut into buckets of about `bucket_size` elements (a parameter is never split
between buckets; a bucket never spans two groups, e.g. two model chunks). Padding, as in
Megatron-LM's distributed optimizer: each parameter starts at a multiple of PARAM_ALIGN
elements, so every parameter view is 128-byte aligned in bf16 (cuBLAS and NCCL want aligned
pointers), and each bucket ends at a multiple of lcm(dp, BUCKET_ALIGN), so buckets start
aligned too and reduce-scatter evenly: DP rank r owns the r-th 1/dp slice of every bucket.
The gaps are a fraction of a percent at real model sizes (`BufferLayout.padding`). Those
slices cut through parameters freely; the optimizer works on flat slices and only needs,
for each parameter, which part of it falls in the slice (`intersections`).

Everything above the `GradBuffer` class is plain integers and is tested without processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import lcm

import torch
from torch import Tensor, nn

PARAM_ALIGN = 64
"""Every parameter starts at a multiple of this many elements (128 bytes in bf16)."""
BUCKET_ALIGN = 128
"""Every bucket ends at a multiple of lcm(dp, this) elements."""


@dataclass(frozen=True)
class Range:
    """Half-open interval [start, end) of buffer elements."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"bad range [{self.start}, {self.end})")

    @property
    def size(self) -> int:
        return self.end - self.start

    def intersect(self, other: Range) -> Range | None:
        """The overlap of two ranges, None when it is empty."""
        start, end = max(self.start, other.start), min(self.end, other.end)
        return Range(start, end) if start < end else None

    def relative_to(self, origin: int) -> Range:
        """The same elements counted from `origin` (e.g. from the start of a shard)."""
        return Range(self.start - origin, self.end - origin)


@dataclass(frozen=True)
class Bucket:
    """A run of whole parameters reduced by one collective; `range` includes the padding."""

    index: int
    range: Range
    params: tuple[int, ...]
    group: int

    def shard(self, dp_size: int, dp_rank: int) -> Range:
        """The slice of this bucket that DP rank `dp_rank` owns (and updates)."""
        per_rank = self.range.size // dp_size
        start = self.range.start + dp_rank * per_rank
        return Range(start, start + per_rank)


@dataclass(frozen=True)
class BufferLayout:
    """Where each parameter and bucket lives in one flat buffer."""

    param_ranges: tuple[Range, ...]
    """Indexed like the `numels` given to `build_layout`."""
    buckets: tuple[Bucket, ...]
    numel: int
    """Total elements including padding (a multiple of lcm(dp, BUCKET_ALIGN))."""
    dp_size: int

    @property
    def padding(self) -> int:
        """Buffer elements that belong to no parameter (alignment gaps and bucket ends)."""
        return self.numel - sum(r.size for r in self.param_ranges)

    def owned(self, dp_rank: int, sharded: bool) -> list[Range]:
        """Per bucket, the range this rank updates: its shard, or the whole bucket."""
        return [b.shard(self.dp_size, dp_rank) if sharded else b.range for b in self.buckets]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_layout(numels: Sequence[int], groups: Sequence[int], order: Sequence[int],
                 bucket_size: int, dp_size: int) -> BufferLayout:
    """Place parameters in `order` (indices into `numels`), bucketed and padded.

    Each parameter starts at the next multiple of PARAM_ALIGN. A bucket is closed once it
    holds at least `bucket_size` elements, or when the next parameter belongs to a different
    group; its end is rounded up to a multiple of lcm(`dp_size`, BUCKET_ALIGN).
    """
    if bucket_size < 1 or dp_size < 1:
        raise ValueError(f"bucket size ({bucket_size}) and DP size ({dp_size}) must be >= 1")
    bucket_align = lcm(dp_size, BUCKET_ALIGN)
    ranges: dict[int, Range] = {}
    buckets: list[Bucket] = []
    start, members = 0, []
    offset = 0

    def close() -> None:
        nonlocal start, offset, members
        end = _round_up(offset, bucket_align)
        buckets.append(Bucket(len(buckets), Range(start, end), tuple(members),
                              groups[members[0]]))
        start, offset, members = end, end, []

    for i in order:
        if members and groups[i] != groups[members[0]]:
            close()
        first = _round_up(offset, PARAM_ALIGN)
        ranges[i] = Range(first, first + numels[i])
        offset = first + numels[i]
        members.append(i)
        if offset - start >= bucket_size:
            close()
    if members:
        close()
    if sorted(ranges) != list(range(len(numels))):
        raise ValueError("`order` must list every parameter index exactly once")
    return BufferLayout(tuple(ranges[i] for i in range(len(numels))), tuple(buckets),
                        start, dp_size)


def intersections(window: Range, param_ranges: Sequence[Range],
                  members: Sequence[int]) -> list[tuple[int, Range]]:
    """(param index, overlap in buffer coordinates) for each member that meets `window`."""
    out = []
    for i in members:
        overlap = param_ranges[i].intersect(window)
        if overlap is not None:
            out.append((i, overlap))
    return out


def merge(ranges: Sequence[Range]) -> list[Range]:
    """Sorted ranges with touching or overlapping neighbours joined (fewer kernel calls)."""
    out: list[Range] = []
    for r in sorted(ranges, key=lambda r: r.start):
        if out and r.start <= out[-1].end:
            out[-1] = Range(out[-1].start, max(out[-1].end, r.end))
        else:
            out.append(r)
    return out


class GradBuffer:
    """The tensors behind one layout: a gradient buffer and a parameter buffer.

    Parameters are moved into `param` (their `.data` becomes a view of it), so an all-gather
    into a bucket of `param` updates the model in place. Each parameter also gets
    `main_grad`, its view of `grad`, where micro-batch gradients accumulate. With
    `full_grad=False` (ZeRO-2/3) there is no full-size `grad` (None) and no `main_grad`: the
    optimizer accumulates into short-lived per-bucket tensors (`new_bucket_grad`) and keeps
    only the reduced shard.
    """

    def __init__(self, params: Sequence[nn.Parameter], layout: BufferLayout,
                 grad_dtype: torch.dtype, full_grad: bool = True) -> None:
        self.params, self.layout = list(params), layout
        self.grad_dtype = grad_dtype
        first = self.params[0]
        self.param = torch.zeros(layout.numel, dtype=first.dtype, device=first.device)
        self.grad = (torch.zeros(layout.numel, dtype=grad_dtype, device=first.device)
                     if full_grad else None)
        with torch.no_grad():
            for p, r in zip(self.params, layout.param_ranges):
                view = self.param[r.start:r.end].view_as(p)
                view.copy_(p.detach())
                p.data = view
                if self.grad is not None:
                    p.main_grad = self.grad[r.start:r.end].view_as(p)

    def bucket_grad(self, bucket: Bucket) -> Tensor:
        if self.grad is None:
            raise RuntimeError("no full-size gradient buffer under ZeRO-2/3")
        return self.grad[bucket.range.start:bucket.range.end]

    def new_bucket_grad(self, bucket: Bucket, dtype: torch.dtype) -> Tensor:
        """A zeroed stand-alone gradient for one bucket (ZeRO-2/3 accumulation)."""
        return torch.zeros(bucket.range.size, dtype=dtype, device=self.param.device)

    def param_grad_view(self, bucket_grad: Tensor, bucket: Bucket, i: int) -> Tensor:
        """Parameter `i`'s part of a `new_bucket_grad` tensor, shaped like the parameter."""
        r = self.layout.param_ranges[i].relative_to(bucket.range.start)
        return bucket_grad[r.start:r.end].view_as(self.params[i])

    def bucket_param(self, bucket: Bucket) -> Tensor:
        return self.param[bucket.range.start:bucket.range.end]

    def nbytes(self) -> int:
        """Bytes of the full-size gradient buffer (0 without one)."""
        return 0 if self.grad is None else self.grad.numel() * self.grad.element_size()
