"""Where every trainable parameter of a rank lives: its buffer, bucket and owned slice.

`ParamBuffers.build` lays the parameters out once (optim/buffers.py: one flat buffer per
dtype, in backward order, cut into buckets) and makes the tensors the chosen strategy needs:
a full-size gradient buffer (no_shard, ZeRO-1), none (ZeRO-2), or a sharded parameter buffer
too (ZeRO-3), plus a `ShardState` per buffer (masters and Adam moments of the owned slice).
The gradient-sync strategies and AdamW then address parameters by index and buckets by
`BucketKey`, and never lay anything out themselves.

Buckets never mix model chunks (a chunk's buckets can start while another chunk is still in
backward), nor ZeRO-3 units (each unit gathers its own), and a tied-embedding copy on the
first or last pipeline stage gets its own buckets: its gradient is summed over the embedding
group before its DP reduction (`deferred`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from megatron_lite.config import ParallelConfig, ddp_bucket_size
from megatron_lite.layers import tags
from megatron_lite.optim import zero1, zero3
from megatron_lite.optim.buffers import GradBuffer, Range, build_layout
from megatron_lite.optim.clip import counts_toward_norm
from megatron_lite.parallel.state import ParallelState, ReplicaGroup
from megatron_lite.sharding import Sharding

BucketKey = tuple[int, int]
"""(buffer index, bucket index)."""
DECOUPLED = ("embedding.", "output.")
"""Parameter names (after the chunk prefix) that take --decoupled-lr, as in Megatron."""


def named_parameters(chunks: Sequence[nn.Module]) -> list[tuple[str, nn.Parameter, int]]:
    """(name, parameter, chunk index) for every trainable parameter once (ties appear twice)."""
    seen: set[int] = set()
    out = []
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((f"chunk{c}.{name}", p, c))
    return out


@dataclass
class ParamBuffers:
    """The layout of one rank's parameters over buffers and buckets (see the module doc)."""

    params: list[nn.Parameter]
    names: list[str]
    buffers: list[GradBuffer | zero3.ShardedParamBuffer] = field(default_factory=list)
    """Per dtype (and under --fp8-param-gather the FP8 weights apart); `ShardedParamBuffer`s
    (ZeRO-3, and the FP8 weights' `OwnedParamBuffer`) keep only the owned slices' values."""
    shards: list[zero1.ShardState] = field(default_factory=list)
    slot: list[BucketKey] = field(default_factory=list)
    """Each parameter's bucket."""
    local: list[int] = field(default_factory=list)
    """Each parameter's index inside its buffer."""
    members: dict[BucketKey, list[int]] = field(default_factory=dict)
    """Each bucket's parameters (optimizer indices)."""
    chunk_of: dict[BucketKey, int] = field(default_factory=dict)
    deferred: set[BucketKey] = field(default_factory=set)
    """Tied-embedding buckets: summed over the embedding group before their DP reduction."""
    fp8: set[int] = field(default_factory=set)
    """Buffers of FP8 linears' weights, gathered in fp8 (--fp8-param-gather)."""

    @classmethod
    def build(cls, chunks: Sequence[nn.Module], select: Callable[[nn.Parameter], bool],
              pstate: ParallelState, parallel: ParallelConfig, strategy: Sharding,
              math_dtype: torch.dtype, replicas: ReplicaGroup, norm_once: bool = False,
              fp8_gather: bool = False) -> ParamBuffers:
        """Lay out the `select`ed parameters of `chunks` for `strategy`, owned slices cut over
        `replicas`; `norm_once`: without sharding, only replica 0 counts them toward the norm
        (their norm is summed over every rank); `fp8_gather`: FP8 linears' weights get
        buffers of their own (one gather moves one dtype)."""
        named = [(n, p, c) for n, p, c in named_parameters(chunks) if select(p)]
        out = cls([p for _, p, _ in named], [n for n, _, _ in named])
        out.slot, out.local = [(0, 0)] * len(named), [0] * len(named)
        units = (zero3.unit_of_params(zero3.unit_modules(chunks)) if strategy.params
                 else None)
        grad_dtype = torch.bfloat16 if parallel.grad_reduce_in_bf16 else math_dtype
        counted = strategy.state or not norm_once or replicas.rank == 0
        index = {id(p): i for i, p in enumerate(out.params)}
        def kind(p: nn.Parameter) -> tuple[torch.dtype, bool]:
            return p.dtype, fp8_gather and tags.is_fp8_weight(p)

        for dtype, fp8 in dict.fromkeys(kind(p) for p in out.params):
            members = [(n, p, c) for n, p, c in named if kind(p) == (dtype, fp8)]
            if units is not None:  # ZeRO-3 refuses PP: no stage copies, one chunk
                groups = [2 * units[id(p)] for _, p, _ in members]
            else:
                groups = [2 * c + (pstate.pp_size > 1 and tags.is_shared_embedding(p))
                          for _, p, c in members]
            layout = build_layout([p.numel() for _, p, _ in members], groups,
                                  list(reversed(range(len(members)))),
                                  ddp_bucket_size(parallel, replicas.size), replicas.size)
            tensors = [p for _, p, _ in members]
            if units is not None:
                buffer = zero3.ShardedParamBuffer(tensors, layout, grad_dtype, replicas.rank)
            elif fp8:  # the forward reads the fp8 copy: keep the owned slices only
                buffer = zero3.OwnedParamBuffer(tensors, layout, grad_dtype, replicas.rank,
                                                full_grad=not strategy.grads)
            else:
                buffer = GradBuffer(tensors, layout, grad_dtype, full_grad=not strategy.grads)
            if fp8:
                out.fp8.add(len(out.buffers))
            out._add(buffer, [index[id(p)] for p in tensors], [c for _, _, c in members])
            infos = [zero1.ParamInfo(n, tuple(p.shape), p.ndim >= 2,
                                     counted and counts_toward_norm(p, pstate),
                                     decoupled=n.split(".", 1)[1].startswith(DECOUPLED))
                     for n, p, _ in members]
            out.shards.append(zero1.ShardState(
                buffer, layout.owned(replicas.rank, strategy.state), infos))
        return out

    def _add(self, buffer: GradBuffer | zero3.ShardedParamBuffer, indices: list[int],
             chunks: list[int]) -> None:
        """Record buffer `buffer`'s buckets; `indices[j]` is its j-th parameter's index."""
        b = len(self.buffers)
        self.buffers.append(buffer)
        for j, i in enumerate(indices):
            self.local[i] = j
        for bucket in buffer.layout.buckets:
            key = (b, bucket.index)
            self.chunk_of[key] = chunks[bucket.params[0]]
            if bucket.group % 2:
                self.deferred.add(key)
            self.members[key] = [indices[j] for j in bucket.params]
            for i in self.members[key]:
                self.slot[i] = key

    def bucket_keys(self) -> list[BucketKey]:
        """Every bucket, buffer by buffer, in backward (fill) order."""
        return [(b, k.index) for b, buf in enumerate(self.buffers) for k in buf.layout.buckets]

    def sequence_parallel_pieces(self) -> list[tuple[int, Range]]:
        """(buffer, owned range) of the gradient elements of SP norm weights: their partial
        sums over the sequence shards must be added over TP after the DP reduction."""
        pieces = []
        for b, shard in enumerate(self.shards):
            layout = shard.buffer.layout
            for p, r in zip(shard.buffer.params, layout.param_ranges):
                if not tags.is_sequence_parallel_grad(p):
                    continue
                for own in shard.owned:
                    overlap = r.intersect(own)
                    if overlap is not None:
                        pieces.append((b, overlap))
        return pieces
