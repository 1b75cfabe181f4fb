"""Weight initialisation that gives the same full model for every TP size.

Each weight is drawn in full from a CPU generator seeded by (run seed, parameter name), then
this rank keeps its slice. So a TP=1 and a TP=4 run with the same seed start from the same
model, which is what makes their losses comparable to float precision. Drawing the full
tensor costs time once at start-up (the same trade Megatron makes with CPU initialisation).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
from torch import Tensor


def named_generator(seed: int, name: str) -> torch.Generator:
    """A generator whose stream depends only on the seed and the parameter name."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()) + seed * 2**32)


def normal_full(shape: Sequence[int], std: float, seed: int, name: str) -> Tensor:
    """The full (unsharded) fp32 weight on CPU."""
    return torch.empty(*shape).normal_(0.0, std, generator=named_generator(seed, name))


def shard_rows(full: Tensor, partitions: Sequence[int], tp_size: int, tp_rank: int) -> Tensor:
    """Column-parallel slice: split each stacked sub-matrix's rows over TP, keep ours.

    `partitions` lists the row counts of sub-matrices fused into one weight (e.g. Q, K, V);
    each is split on its own, so rank r holds [Q_r; K_r; V_r].
    """
    pieces, offset = [], 0
    for rows in partitions:
        per_rank = rows // tp_size
        start = offset + tp_rank * per_rank
        pieces.append(full[start:start + per_rank])
        offset += rows
    return torch.cat(pieces, dim=0)


def shard_cols(full: Tensor, tp_size: int, tp_rank: int) -> Tensor:
    """Row-parallel slice: this rank's block of input columns."""
    per_rank = full.size(1) // tp_size
    return full[:, tp_rank * per_rank:(tp_rank + 1) * per_rank]


def shard_full(full: Tensor, tp_split: tuple | None, tp_size: int, tp_rank: int) -> Tensor:
    """This rank's slice of a full tensor, following a parameter's `tp_split` tag.

    Tags: ("rows", partitions) for column-parallel weights, ("vocab", (padded rows,)) for
    vocab-parallel weights, ("cols",) for row-parallel weights, None for weights replicated
    over TP (norms).
    """
    if tp_split is None:
        return full
    if tp_split[0] in ("rows", "vocab"):
        return shard_rows(full, tp_split[1], tp_size, tp_rank)
    return shard_cols(full, tp_size, tp_rank)


def unshard(pieces: Sequence[Tensor], tp_split: tuple | None) -> Tensor:
    """Inverse of `shard_full`: the full tensor from every TP rank's slice, in rank order."""
    if tp_split is None:
        return pieces[0]
    if tp_split[0] == "cols":
        return torch.cat(list(pieces), dim=1)
    tp_size, parts, offset = len(pieces), [], 0
    for rows in tp_split[1]:
        per_rank = rows // tp_size
        parts.extend(p[offset:offset + per_rank] for p in pieces)
        offset += per_rank
    return torch.cat(parts, dim=0)
