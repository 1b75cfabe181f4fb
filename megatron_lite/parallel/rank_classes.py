"""`--dry-run-ranks classes`: run one rank per distinct position, stand the others in.

A rank's position is (pipeline stage, CP index, TP index, EP index, expert-TP index) and
whether its DP replica index is 0; the class representative is the lowest rank of each
position (so DP replica 0 and the first replica > 0 with the same expert position). Every
stage is a position, so the first stage's embedding and the last stage's head and loss run.

Why a rank with DP replica k >= 2 repeats its representative (replica 1, or under MoE the
first replica > 0 with its EP/expert-TP position): what it builds and issues depends on its
coordinates only through (a) the shapes of its shards, set by the TP/CP/EP/expert-TP indices
and the stage, not by the DP index (every replica holds the same stage); (b) the schedule,
set by the stage and the micro-batch count, the same on every replica; (c) code that asks
`dp_rank == 0` (logging, the checkpoint's writer choice), which replicas 1 and k alike answer
False; and (d) the data, which a dry run mocks and whose sample indices differ by replica but
not its shapes. Nothing branches on the DP index beyond 0, so replica k issues replica 1's ops
in the same order, over its own groups of the same kinds. The stand-in's ops are therefore the
representative's with each group (and p2p peer) replaced by the stand-in's group of the kind
its call site named (the audit has checked that the representative's group is its group of
that kind), and `audit.match` then checks the whole world as with `all`.
"""

from __future__ import annotations

import dataclasses

from megatron_lite.config import Config
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.audit import CommOp


def representatives(cfg: Config, world_size: int) -> dict[int, int]:
    """Every global rank -> the rank that runs for it (itself for a representative)."""
    p = cfg.parallel
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    stage = world_size // p.pipeline_model_parallel_size
    ep, etp = parallel_state.expert_sizes(cfg)
    first: dict[tuple, int] = {}
    out = {}
    for rank in range(world_size):
        pp_rank, local = divmod(rank, stage)
        d, rest = divmod(local, cp * tp)
        _, ep_rank, etp_rank = parallel_state.expert_coordinates(local, ep, etp or tp)
        key = (pp_rank, rest, ep_rank, etp_rank, min(d, 1))
        out[rank] = first.setdefault(key, rank)
    return out


def groups_by_kind(cfg: Config, world_size: int, rank: int) -> dict[str, tuple[int, ...]]:
    """`ParallelState.ranks_by_kind` of `rank`, from the fake groups the dry run builds."""
    pstate = parallel_state.initialize_fake(cfg, world_size, rank)
    try:
        return pstate.ranks_by_kind()
    finally:
        parallel_state.destroy(pstate)


def stand_in(ops: list[CommOp], rep: dict[str, tuple[int, ...]],
             mine: dict[str, tuple[int, ...]]) -> list[CommOp]:
    """The representative's `ops` as the rank whose groups are `mine` issues them: each
    group, and each p2p peer by its place in the group, moved to this rank's group of the
    op's kind (a group spanning DP, and the world a p2p op names, is the same on both)."""
    out = []
    for op in ops:
        if op.kind is None or op.kind not in rep:
            raise ValueError(f"{op.describe()}: names no group kind, so no stand-in can "
                             "be made from it (use --dry-run-ranks all)")
        theirs, ours = rep[op.kind], mine[op.kind]
        if op.group not in (theirs, rep["world"]):
            raise ValueError(f"{op.describe()}: over neither the {op.kind} group nor the "
                             "world, so no stand-in can be made from it (use "
                             "--dry-run-ranks all)")
        group = ours if op.group == theirs else op.group  # p2p goes over the world group
        peer = None if op.peer is None else ours[theirs.index(op.peer)]
        out.append(dataclasses.replace(op, group=group, peer=peer))
    return out


def full_world(cfg: Config, world_size: int, records: dict[int, list[CommOp]]
               ) -> dict[int, list[CommOp]]:
    """`records` of the representatives widened to every rank of the job."""
    reps = representatives(cfg, world_size)
    rep_groups = {r: groups_by_kind(cfg, world_size, r) for r in records}
    world = {}
    for rank, rep in reps.items():
        if rank == rep:
            world[rank] = records[rank]
        else:
            world[rank] = stand_in(records[rep], rep_groups[rep],
                                   groups_by_kind(cfg, world_size, rank))
    return world
