"""Weight initialisation that gives the same full model for every TP size.

Each weight is drawn in full from a CPU generator seeded by (run seed, parameter name), then
this rank keeps its slice. So a TP=1 and a TP=4 run with the same seed start from the same
model, which is what makes their losses comparable to float precision. Drawing the full
tensor costs time once at start-up (the same trade Megatron makes with CPU initialisation).
On the meta device (the rank dry run) nothing is drawn: only the local shard's shape exists.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_lite.layers.tags import TpSplit, row_partitions


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


def shard_full(full: Tensor, split: TpSplit | None, tp_size: int, tp_rank: int) -> Tensor:
    """This rank's slice of a full tensor, following a parameter's TP split (layers/tags.py)."""
    if split is None:
        return full
    partitions = row_partitions(split)
    if partitions is None:
        return shard_cols(full, tp_size, tp_rank)
    return shard_rows(full, partitions, tp_size, tp_rank)


def unshard(pieces: Sequence[Tensor], split: TpSplit | None) -> Tensor:
    """Inverse of `shard_full`: the full tensor from every TP rank's slice, in rank order."""
    if split is None:
        return pieces[0]
    partitions = row_partitions(split)
    if partitions is None:
        return torch.cat(list(pieces), dim=1)
    tp_size, parts, offset = len(pieces), [], 0
    for rows in partitions:
        per_rank = rows // tp_size
        parts.extend(piece[offset:offset + per_rank] for piece in pieces)
        offset += per_rank
    return torch.cat(parts, dim=0)


def local_shape(full_shape: Sequence[int], split: TpSplit | None, tp_size: int
                ) -> tuple[int, ...]:
    """Shape of one TP rank's slice of a full tensor with the given TP split."""
    rows, *rest = full_shape
    if split is None:
        return tuple(full_shape)
    partitions = row_partitions(split)
    if partitions is None:
        return (rows, rest[0] // tp_size)
    return (sum(n // tp_size for n in partitions), *rest)


def init_shard(full_shape: Sequence[int], split: TpSplit | None, *, std: float, seed: int,
               name: str, tp_size: int, tp_rank: int, device: torch.device, dtype: torch.dtype,
               real_rows: int | None = None) -> Tensor:
    """This rank's slice of an N(0, std) weight, on `device` in `dtype`.

    `real_rows` (vocab weights): only the first rows are drawn, the padding rows are zero.
    On the meta device the slice is allocated without drawing anything, so a dry-run rank of
    a 70B model costs no host time or memory.
    """
    if device.type == "meta":
        return torch.empty(local_shape(full_shape, split, tp_size), device=device, dtype=dtype)
    if real_rows is None:
        full = normal_full(full_shape, std, seed, name)
    else:
        full = torch.zeros(*full_shape)
        full[:real_rows] = normal_full((real_rows, *full_shape[1:]), std, seed, name)
    return shard_full(full, split, tp_size, tp_rank).to(device=device, dtype=dtype)
