"""The one owner of process groups.

`initialize()` builds every group from a rank grid `arange(world).reshape(pp, dp, cp, tp)`
(Megatron's order: tp innermost, so a TP group stays inside a node, then context parallel,
then data parallel, then pipeline) and returns a frozen `ParallelState` that the
training code passes explicitly to whatever needs it. Nothing here is a module-level global.

A rank takes part only in creating what it needs (`_create_groups` says how and why), and a
group of one rank is never created: its field is None, which every helper in `comms.py` treats
as a no-op group of one. A single process with no launcher gets a state without any process
group (all groups None), so the same code runs everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_lite.config import Config, ConfigError
from megatron_lite.errors import found_on_rank
from megatron_lite.parallel import staged
from megatron_lite.parallel.launch import (
    LaunchEnv,
    check_devices_per_node,
    check_port_free,
    check_tp_within_node,
    detect_launch_env,
    rendezvous_error,
)


@dataclass(frozen=True)
class ReplicaGroup:
    """The ranks that hold the same parameters: data parallel x context parallel.

    Every CP rank holds its stage's full parameters and a partial gradient of them, so the
    gradient is summed, and the optimizer state sharded, over DP x CP (Megatron's
    data-parallel group with context parallelism). The optimizer's strategies and the
    checkpoint files see only this group, never the DP-only one.
    """

    group: dist.ProcessGroup | None
    size: int
    rank: int
    """This rank's index in `group` (dp-major, as the grid orders global ranks)."""
    device: torch.device
    kind: str
    """`group`'s kind (`ranks_by_kind`): dp_cp for the dense parameters, edp for experts laid
    out apart; the gradient sync's collectives name it, and a dry run checks the group."""


@dataclass(frozen=True)
class ParallelState:
    """This rank's coordinates on the (pp, dp, cp, tp) grid and the groups it belongs to."""

    rank: int
    world_size: int
    local_rank: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    device: torch.device
    backend: str | None
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    mp_group: dist.ProcessGroup | None = None
    """tp x pp ranks sharing one (dp, cp) position: a whole model replica (global norms; a CP
    rank holds the same parameters as its CP peers, so norms never span CP)."""
    embedding_group: dist.ProcessGroup | None = None
    """First and last pipeline stage of one (dp, tp) position: tied-embedding gradient sum."""
    world_group: dist.ProcessGroup | None = None
    """All ranks (None in a single process, where every collective is a no-op)."""
    pp_ranks: tuple[int, ...] = (0,)
    """Global ranks of this rank's pipeline, indexed by stage."""
    grid: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...] = ((((0,),),),)
    """grid[pp][dp][cp][tp] = global rank."""
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None
    """The ranks that split this rank's sequences (same pp, dp and tp position)."""
    cp_ranks: tuple[int, ...] = (0,)
    """Global ranks of this rank's CP group, indexed by cp rank (the ring's order)."""
    dp_cp_group: dist.ProcessGroup | None = None
    """dp x cp ranks holding the same parameters: gradients are summed and ZeRO-1 shards over
    it (Megatron's data-parallel group with context parallelism)."""
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    """Expert parallel: the ranks that split the routed experts of a MoE layer between them
    and exchange tokens (Megatron's MoE parallel folding: a stage's ranks, indexed
    (dp·cp + c)·tp + t, re-read as edp x ep x etp with etp innermost; at etp = tp an EP group
    holds consecutive DP x CP replicas of one TP rank, at etp < tp it takes TP ranks too)."""
    etp_size: int | None = None
    etp_rank: int | None = None
    etp_group: dist.ProcessGroup | None = None
    """Expert tensor parallel (--expert-tensor-parallel-size): the ranks that split each
    expert's weights, consecutive TP ranks; not given (None), the TP group itself."""
    edp_size: int = 1
    edp_rank: int = 0
    edp_group: dist.ProcessGroup | None = None
    """Expert data parallel: the ranks holding the same experts (tp·dp·cp / (ep·etp) of them);
    expert gradients are summed, and their optimizer state sharded, over it."""
    group_creations: int = 0
    """Group creations this rank took part in at start-up (the dry run prints it)."""

    @property
    def dp_cp_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def dp_cp_rank(self) -> int:
        """This rank's index in `dp_cp_group` (dp-major, as the grid orders global ranks)."""
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def replicas(self) -> ReplicaGroup:
        """The DP x CP group gradients are summed over (see `ReplicaGroup`)."""
        return ReplicaGroup(self.dp_cp_group if self.cp_size > 1 else self.dp_group,
                            self.dp_cp_size, self.dp_cp_rank, self.device, "dp_cp")

    def __post_init__(self) -> None:
        if self.etp_size is None:  # experts split like the dense weights
            object.__setattr__(self, "etp_size", self.tp_size)
            object.__setattr__(self, "etp_rank", self.tp_rank)
            object.__setattr__(self, "etp_group", self.tp_group)

    def ranks_by_kind(self) -> dict[str, tuple[int, ...]]:
        """Global ranks of this rank's group of each kind (tp, dp, ..., world; `(rank,)` for
        a group of one): what a dry run checks each op's group against (audit.group_kind)."""
        def ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
            return (self.rank,) if group is None else tuple(dist.get_process_group_ranks(group))

        return {kind: ranks(getattr(self, f"{kind}_group")) for kind in (
            "tp", "cp", "dp", "dp_cp", "ep", "edp", "etp", "pp", "mp", "embedding", "world")}

    @property
    def experts_apart(self) -> bool:
        """Whether the experts are laid out otherwise than the dense weights (EP > 1, or an
        expert-TP size other than TP): then they have their own gradient-sync group and
        checkpoint files."""
        return self.ep_size > 1 or self.etp_size != self.tp_size

    @property
    def expert_replicas(self) -> ReplicaGroup:
        """The expert-DP group expert gradients are summed over (DP x CP when not apart)."""
        if not self.experts_apart:
            return self.replicas
        return ReplicaGroup(self.edp_group, self.edp_size, self.edp_rank, self.device, "edp")

    def gradient_replicas(self) -> ParallelState:
        """This state seen by the optimizer and the checkpoint files: the data-parallel
        coordinates widened to DP x CP, since every CP rank holds a full replica of its
        stage's parameters and a partial gradient of it."""
        if self.cp_size == 1:
            return self
        return replace(self, dp_size=self.dp_cp_size, dp_rank=self.dp_cp_rank,
                       dp_group=self.dp_cp_group, cp_size=1, cp_rank=0, cp_group=None,
                       cp_ranks=(self.rank,))

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (wraps around)."""
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    @property
    def next_rank(self) -> int:
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    def describe(self) -> str:
        cp = f"cp {self.cp_rank}/{self.cp_size}, " if self.cp_size > 1 else ""
        return (f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size}, {cp}"
                f"pp {self.pp_rank}/{self.pp_size}, dp {self.dp_rank}/{self.dp_size}, "
                f"device {self.device}")


def single_process_state(device: torch.device | None = None) -> ParallelState:
    """The state of one process with no process group (tools, tests, benchmarks)."""
    return ParallelState(rank=0, world_size=1, local_rank=0, tp_size=1, tp_rank=0, pp_size=1,
                         pp_rank=0, dp_size=1, dp_rank=0,
                         device=device or torch.device("cpu"), backend=None)


def rank_grid(world_size: int, tp: int, pp: int, cp: int = 1) -> list[list[list[list[int]]]]:
    """grid[p][d][c][t] = global rank, tp fastest-varying, then cp, then dp, then pp."""
    dp = world_size // (tp * cp * pp)
    return [[[[((p * dp + d) * cp + c) * tp + t for t in range(tp)] for c in range(cp)]
             for d in range(dp)] for p in range(pp)]


def format_grid(grid: list[list[list[list[int]]]], full: bool = False, width: int = 1000) -> str:
    """Human-readable rank grid (`grid[pp][dp][cp][tp]`) for the start-up log and --dry-run.

    Beyond about a screenful (`width` characters) it is summarized: the layout rule, then the
    first two and the last pipeline stage, each with its first two and last DP groups, TP
    groups written as rank ranges. `full` prints every group. CP appears only when > 1.
    """
    cp = len(grid[0][0])

    def stage_line(p: int, stage: list[list[list[int]]], groups: list[int]) -> str:
        cells = []
        for d in groups:
            if d < 0:
                cells.append("...")
                continue
            for c, cell in enumerate(stage[d]):
                ranks = list(cell)
                contiguous = ranks == list(range(ranks[0], ranks[0] + len(ranks)))
                shown = (f"[{ranks[0]}-{ranks[-1]}]" if contiguous and len(ranks) > 2
                         else str(ranks))
                cells.append(f"dp{d}{f'cp{c}' if cp > 1 else ''}:tp{shown}")
        return f"  pp stage {p}: " + "  ".join(cells)

    lines = [stage_line(p, st, list(range(len(st)))) for p, st in enumerate(grid)]
    text = "\n".join(lines)
    if full or len(text) <= width:
        return text
    pp, dp, tp = len(grid), len(grid[0]), len(grid[0][0][0])
    groups = list(range(dp)) if dp <= 3 else [0, 1, -1, dp - 1]
    stages = list(range(pp)) if pp <= 3 else [0, 1, -1, pp - 1]
    cp_dims = f" x {cp} cp ranks" if cp > 1 else ""
    cp_rule = f" x {cp} + cp)" if cp > 1 else ""
    out = [f"  {pp} pp stages x {dp} dp groups{cp_dims} x {tp} tp ranks = {pp * dp * cp * tp} "
           f"ranks; rank = {'(' if cp > 1 else ''}(pp x {dp} + dp){cp_rule} x {tp} + tp "
           "(TP groups are consecutive ranks); summarized, --log-rank-grid prints every group"]
    for p in stages:
        out.append("  ..." if p < 0 else stage_line(p, grid[p], groups))
    return "\n".join(out)


def _pick_backend(requested: str) -> tuple[str, bool]:
    """(backend string for init_process_group, whether tensors live on CUDA).

    "cuda:gloo" registers gloo for CUDA tensors only: a host tensor reaching a collective then
    fails as it would on NCCL, and two ranks can share one GPU (NCCL refuses that), which is
    how scripts/gpu_check.sh proves the multi-rank CUDA path on a single lent GPU.
    """
    use_cuda = torch.cuda.is_available()
    backend = requested if requested != "auto" else ("nccl" if use_cuda else "gloo")
    if backend == "cuda:gloo" and not use_cuda:
        raise ConfigError("--distributed-backend cuda:gloo needs a CUDA device; use gloo on CPU")
    if backend == staged.NAME:  # GPU-sharing like cuda:gloo, every op through host memory
        staged.register("cuda" if use_cuda else "cpu")
    return backend, use_cuda and backend in ("nccl", "cuda:gloo", staged.NAME)


def _device_index(backend: str, local_rank: int) -> int:
    """CUDA device of a rank: its local rank, or shared round-robin under cuda:gloo and
    staged-gloo."""
    if backend in ("cuda:gloo", staged.NAME):
        return local_rank % torch.cuda.device_count()
    return local_rank


def _elastic_store(env: LaunchEnv, timeout: timedelta) -> dist.Store | None:
    """Under torchrun: its rendezvous store, with keys prefixed by the restart count.

    torchrun --max-restarts keeps one store for all attempts, so a restarted group would read
    the previous attempt's gloo addresses and fail ("connectFullMesh ... Connect timeout");
    a fresh prefix per attempt lets the new group form. None outside torchrun (env://).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # agent hosts the store
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                          is_master=not agent and env.rank == 0, timeout=timeout,
                          multi_tenant=not agent)
    return dist.PrefixStore(f"megatron_lite/attempt_{attempt}", store)


def initialize(cfg: Config, env: LaunchEnv | None = None, init_method: str | None = None
               ) -> ParallelState:
    """Start torch.distributed (when more than one process) and build all groups.

    `init_method` lets tests use a file:// rendezvous; otherwise env:// with the launcher's
    (or Slurm-derived) master address and port.
    """
    env = env or detect_launch_env()
    tp, pp, cp = _sizes(cfg)
    world, rank = env.world_size, env.rank
    grid = rank_grid(world, tp, pp, cp)
    backend, use_cuda = _pick_backend(cfg.parallel.distributed_backend)
    _check_launch(cfg, env, backend, init_method)
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", _device_index(backend, env.local_rank))
        torch.cuda.set_device(device)
    common = _coordinates(env, grid, device, *expert_sizes(cfg))
    if world == 1 and init_method is None:
        return ParallelState(backend=None, **common)

    timeout = timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    # A rank that cannot meet the others says so itself (rank 0 may be the one missing).
    with found_on_rank(rank):
        try:
            store = _elastic_store(env, timeout) if init_method is None else None
            if init_method is None and store is None:
                os.environ.setdefault("MASTER_ADDR", env.master_addr)
                os.environ.setdefault("MASTER_PORT", str(env.master_port))
                init_method = "env://"
            dist.init_process_group(backend, init_method=init_method, store=store, rank=rank,
                                    world_size=world, timeout=timeout,
                                    device_id=device if backend == "nccl" else None)
        except (dist.DistError, TimeoutError) as e:
            raise rendezvous_error(env, e, cfg.parallel.distributed_timeout_minutes) from e
    return _with_groups(backend, timeout, common, grid)


def _hosts_store(env: LaunchEnv) -> bool:
    """Whether this process will open the rendezvous port: rank 0, unless torchrun's agent
    already holds it (it hosts the store its workers join)."""
    return env.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _check_launch(cfg: Config, env: LaunchEnv, backend: str, init_method: str | None) -> None:
    """Launch mistakes refused by name before the rendezvous, where they would otherwise hang
    the job or fail with a socket error far from their cause."""
    check_tp_within_node(env, cfg.parallel.tensor_model_parallel_size,
                         cfg.parallel.allow_tp_across_nodes)
    if backend == "nccl":  # cuda:gloo shares GPUs on purpose
        check_devices_per_node(env, torch.cuda.device_count())
    if env.world_size > 1 and init_method is None and _hosts_store(env):
        check_port_free(env.master_addr, env.master_port)


def initialize_fake(cfg: Config, world_size: int, rank: int) -> ParallelState:
    """Rank `rank` of a `world_size` job in this one process, on the meta device (--dry-run).

    The groups are real torch.distributed groups over torch's fake backend, registered for
    meta tensors only: collectives and p2p complete at once without moving data, and a host
    tensor sent to one fails exactly as on NCCL. Call `destroy` before the next rank.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    env = LaunchEnv(rank=rank, local_rank=rank % 8, world_size=world_size, local_world_size=8,
                    master_addr="", master_port=0, source="dry run", node_rank=rank // 8,
                    num_nodes=max(1, world_size // 8))
    tp, pp, cp = _sizes(cfg)
    grid = rank_grid(world_size, tp, pp, cp)
    common = _coordinates(env, grid, torch.device("meta"), *expert_sizes(cfg))
    timeout = timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    dist.init_process_group("meta:fake", store=FakeStore(), rank=rank, world_size=world_size,
                            timeout=timeout)
    # torch registers the plugin as "FAKE" but looks it up as "fake", so the group gets no
    # default backend and destroy warns once per rank; name it ourselves.
    dist.group.WORLD._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    return _with_groups("meta:fake", timeout, common, grid)


def _sizes(cfg: Config) -> tuple[int, int, int]:
    p = cfg.parallel
    return (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
            p.context_parallel_size)


def expert_sizes(cfg: Config) -> tuple[int, int | None]:
    """(EP size, expert-TP size or None for the TP size) of `cfg`."""
    moe = cfg.moe
    return moe.expert_model_parallel_size, moe.expert_tensor_parallel_size


def expert_coordinates(local: int, ep: int, etp: int) -> tuple[int, int, int]:
    """(edp, ep, etp) ranks of a stage's rank `local` = (d·cp + c)·tp + t, read with the
    expert-TP index innermost, then EP, then expert-DP."""
    rest, etp_rank = divmod(local, etp)
    edp_rank, ep_rank = divmod(rest, ep)
    return edp_rank, ep_rank, etp_rank


def _coordinates(env: LaunchEnv, grid: list[list[list[list[int]]]], device: torch.device,
                 ep: int = 1, etp: int | None = None) -> dict:
    """The ParallelState fields that follow from the rank grid (and the EP and expert-TP
    sizes) alone."""
    pp, dp, cp, tp = len(grid), len(grid[0]), len(grid[0][0]), len(grid[0][0][0])
    etp = etp or tp
    p_idx, rem = divmod(env.rank, dp * cp * tp)
    d_idx, rem = divmod(rem, cp * tp)
    c_idx, t_idx = divmod(rem, tp)
    edp_rank, ep_rank, etp_rank = expert_coordinates((d_idx * cp + c_idx) * tp + t_idx, ep,
                                                     etp)
    return dict(rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                tp_size=tp, tp_rank=t_idx, pp_size=pp, pp_rank=p_idx, dp_size=dp,
                dp_rank=d_idx, cp_size=cp, cp_rank=c_idx, device=device, ep_size=ep,
                ep_rank=ep_rank, etp_size=etp, etp_rank=etp_rank,
                edp_size=dp * cp * tp // (ep * etp), edp_rank=edp_rank,
                pp_ranks=tuple(grid[s][d_idx][c_idx][t_idx] for s in range(pp)),
                cp_ranks=tuple(grid[p_idx][d_idx][c][t_idx] for c in range(cp)),
                grid=tuple(tuple(tuple(tuple(r) for r in dp_row) for dp_row in stage)
                           for stage in grid))


GROUP_KINDS = ("tp_group", "dp_group", "pp_group", "mp_group", "embedding_group", "cp_group",
               "dp_cp_group", "ep_group", "edp_group", "etp_group")
"""The ParallelState group fields, in the order every rank creates them."""


def group_lists(grid: list[list[list[list[int]]]], ep: int = 1, etp: int | None = None
                ) -> dict[str, list[list[int]]]:
    """Every group of every kind: kind -> rank lists (a partition of the world, or of the first
    and last stages for `embedding_group`), each in rank order; single-rank lists included.
    Without CP there are no CP kinds: no ring, and DP x CP is DP; without EP (`ep` = 1) and
    with the expert-TP size `etp` the TP size (None) no expert kinds: the expert-DP group is
    DP x CP, the expert-TP group TP."""
    pp, dp, cp, tp = len(grid), len(grid[0]), len(grid[0][0]), len(grid[0][0][0])
    etp = etp or tp
    cells = [(p, d, c, t) for p in range(pp) for d in range(dp) for c in range(cp)
             for t in range(tp)]

    def lists(key: Callable[[tuple[int, int, int, int]], tuple]) -> list[list[int]]:
        """Group the grid's cells by `key` (the coordinates a group shares), in rank order."""
        out: dict[tuple, list[int]] = {}
        for p, d, c, t in cells:
            out.setdefault(key((p, d, c, t)), []).append(grid[p][d][c][t])
        return list(out.values())

    pp_lists = lists(lambda x: (x[1], x[2], x[3]))
    out = dict(tp_group=lists(lambda x: (x[0], x[1], x[2])),
               dp_group=lists(lambda x: (x[0], x[2], x[3])), pp_group=pp_lists,
               mp_group=lists(lambda x: (x[1], x[2])),
               embedding_group=[sorted({r[0], r[-1]}) for r in pp_lists])
    if cp > 1:
        out.update(cp_group=lists(lambda x: (x[0], x[1], x[3])),
                   dp_cp_group=lists(lambda x: (x[0], x[3])))
    if ep > 1 or etp != tp:  # a stage's rank (d·cp + c)·tp + t read as (edp, ep, etp)
        def expert(x: tuple[int, int, int, int]) -> tuple[int, int, int]:
            return expert_coordinates((x[1] * cp + x[2]) * tp + x[3], ep, etp)

        out.update(ep_group=lists(lambda x: (x[0], expert(x)[0], expert(x)[2])),
                   edp_group=lists(lambda x: (x[0], expert(x)[1], expert(x)[2])))
        if etp != tp:
            out.update(etp_group=lists(lambda x: (x[0], expert(x)[:2])))
    return out


def _plan(lists_by_kind: dict[str, list[list[int]]], rank: int, world_size: int
          ) -> list[tuple[str, list[tuple[int, ...]], tuple[int, ...]]]:
    """Per kind: (field, the groups it newly needs, this rank's own group in this kind).

    The new groups are those of two or more ranks not met before: a group equal to the world is
    the default group, and a rank list met twice (tp and mp when pp = 1) is created once. The
    list is the same on every rank (a `split_group` needs that); the own group is () for a
    single-rank group (its field stays None).
    """
    seen: set[tuple[int, ...]] = {tuple(range(world_size))}
    out = []
    for kind, lists in lists_by_kind.items():
        new = [tuple(r) for r in lists if len(r) > 1 and tuple(r) not in seen]
        seen.update(new)
        own = next((tuple(r) for r in lists if rank in r), ())
        out.append((kind, new, own if len(own) > 1 else ()))
    return out


def planned_creations(lists_by_kind: dict[str, list[list[int]]], rank: int, world_size: int,
                      split: bool) -> int:
    """Group creations `rank` takes part in: with `split` (NCCL with a bound device) one world
    `split_group` per kind that needs a new group, member or not; otherwise one local
    `new_group` per new group that holds the rank."""
    plan = _plan(lists_by_kind, rank, world_size)
    return sum(bool(new) if split else own in new for _, new, own in plan)


def _splits_world() -> bool:
    """Whether groups come from `split_group`: the default group has a bound device (NCCL
    initialized with `device_id`), the only case where torch can split it."""
    return dist.group.WORLD.bound_device_id is not None


def _create_groups(lists_by_kind: dict[str, list[list[int]]], rank: int, world_size: int,
                   timeout: timedelta) -> tuple[dict[str, dist.ProcessGroup | None], int]:
    """Create this rank's groups; return them by field name and the creations it took part in.

    Why two paths (read from torch 2.13's distributed_c10d.py, measured on gloo and meta:fake):
    - NCCL with `device_id` (our nccl runs): every `new_group` becomes an `ncclCommSplit` of
      the world communicator, which all world ranks must enter, members or not (non-members
      call `perform_nocolor_split`). `use_local_synchronization=True` returns early on
      non-members, so the members would wait in the split forever. `split_group` instead
      cuts the world into all groups of one kind in one call: one world-wide split per kind
      (at most 7; 5 for 70B on 1,024 GPUs) instead of one per group (464 before).
    - gloo, cuda:gloo and the dry run's meta:fake (no bound device): `split_group` refuses
      ("No device associated with the default pg"), while `new_group(ranks,
      use_local_synchronization=True)` lets non-members skip the call and synchronizes only
      the members, through a store prefix named after the ranks. Every rank creates its
      groups in the same kind order, so members always meet: a creation of kind k waits only
      on ranks that are done with kinds < k, hence no cycle.
    """
    world = dist.group.WORLD
    split = _splits_world()
    made: dict[tuple[int, ...], dist.ProcessGroup | None] = {tuple(range(world_size)): world}
    groups: dict[str, dist.ProcessGroup | None] = {}
    count = 0
    for kind, new, own in _plan(lists_by_kind, rank, world_size):
        if split and new:
            group = dist.split_group(split_ranks=[list(r) for r in new], timeout=timeout)
            count += 1
            if own in new:
                made[own] = group
        elif own in new:
            made[own] = dist.new_group(list(own), timeout=timeout,
                                       use_local_synchronization=True)
            count += 1
        groups[kind] = made[own] if own else None
    return groups, count


def _with_groups(backend: str, timeout: timedelta, common: dict,
                 grid: list[list[list[list[int]]]]) -> ParallelState:
    """Create this rank's groups once the default group exists (see `_create_groups`)."""
    lists = group_lists(grid, common["ep_size"], common["etp_size"])
    groups, count = _create_groups(lists, common["rank"], common["world_size"], timeout)
    groups.setdefault("cp_group", None)
    groups.setdefault("dp_cp_group", groups["dp_group"])
    groups.setdefault("ep_group", None)
    groups.setdefault("edp_group", groups["dp_cp_group"])
    groups.setdefault("etp_group", groups["tp_group"])
    return ParallelState(backend=backend, world_group=dist.group.WORLD, group_creations=count,
                         **groups, **common)


def destroy(state: ParallelState) -> None:
    """Tear down torch.distributed (safe to call on a single-process state)."""
    if state.distributed and dist.is_initialized():
        dist.destroy_process_group()
