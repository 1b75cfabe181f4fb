"""Start-up group creation (issue 27 item 4): each rank creates only its own groups of two or
more ranks, the groups have the right members, and collectives on them work."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from megatron_lite.arguments import parse_config
from megatron_lite.config import Config, ParallelConfig
from megatron_lite.dry_run import dry_run
from megatron_lite.parallel import comms
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.state import GROUP_KINDS, ParallelState, group_lists, rank_grid
from tests.distributed import run_ranks

LLAMA_70B_1024 = ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
                  "--num-query-groups", "8", "--ffn-hidden-size", "28672", "--seq-length",
                  "4096", "--max-position-embeddings", "4096", "--vocab-size", "128256",
                  "--untie-embeddings-and-output-weights", "--bf16",
                  "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
                  "--num-layers-per-virtual-pipeline-stage", "2", "--use-distributed-optimizer",
                  "--micro-batch-size", "1", "--global-batch-size", "128"]
"""scripts/pretrain_llama_70b.sh's shape and layout, with 8 micro-batches (quicker)."""


def _expected(pstate: ParallelState) -> dict[str, list[int] | None]:
    """Each kind's members for this rank from the rank grid alone (None: a group of one)."""
    grid = [[[list(c) for c in d] for d in p] for p in pstate.grid]
    out: dict[str, list[int] | None] = {}
    for kind, lists in group_lists(grid).items():
        own = next(r for r in lists if pstate.rank in r)
        out[kind] = own if len(own) > 1 else None
    out.setdefault("cp_group", None)
    out.setdefault("dp_cp_group", out["dp_group"])
    out.setdefault("ep_group", None)
    out.setdefault("edp_group", out["dp_cp_group"])
    out.setdefault("etp_group", out["tp_group"])  # expert TP = TP unless set smaller
    return out


def _members_and_sums(pstate: ParallelState) -> tuple[dict, dict, int]:
    """Members of every group field, and an all-reduce of the global rank over each."""
    members, sums = {}, {}
    for kind in GROUP_KINDS:
        group = getattr(pstate, kind)
        members[kind] = None if group is None else dist.get_process_group_ranks(group)
        value = torch.tensor([float(pstate.rank)])
        # None: a no-op, no collective
        sums[kind] = comms.all_reduce_(value, group, kind=kind.removesuffix("_group")).item()
    return members, sums, pstate.group_creations


def _both_layouts(pstate: ParallelState, cp_cfg: Config, init_file: str) -> list[tuple]:
    """This layout's groups, then the same ranks re-initialized as `cp_cfg` (one spawn of 8
    processes for both: starting them is most of the test's time)."""
    first = _members_and_sums(pstate)
    parallel_state.destroy(pstate)
    again = parallel_state.initialize(cp_cfg, env=_env(pstate.rank),
                                      init_method=f"file://{init_file}")
    return [first, _members_and_sums(again)]  # the harness destroys `again`


def _cfg(tp: int, pp: int, cp: int) -> Config:
    return Config(parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                          pipeline_model_parallel_size=pp,
                                          context_parallel_size=cp, distributed_backend="gloo",
                                          distributed_timeout_minutes=2))


def test_every_rank_gets_its_groups_and_collectives_work(tmp_path) -> None:
    """8 gloo ranks as TP2 x PP2 x DP2, then as TP2 x PP2 x CP2: every group kind has the
    rank grid's members on every rank, sums over it, and each rank made 4 creations."""
    layouts = [(2, 2, 1), (2, 2, 2)]
    results = run_ranks(_both_layouts, 8, tmp_path, cfg=_cfg(*layouts[0]),
                        cp_cfg=_cfg(*layouts[1]), init_file=str(tmp_path / "second"))
    for i, (tp, pp, cp) in enumerate(layouts):
        grid = rank_grid(8, tp, pp, cp)
        for rank, per_layout in enumerate(results):
            members, sums, made = per_layout[i]
            state = ParallelState(**parallel_state._coordinates(  # the grid's view of rank
                _env(rank), grid, torch.device("cpu")), backend="gloo")
            expected = _expected(state)
            assert members == expected, (tp, pp, cp, rank)
            for kind, ranks in expected.items():
                assert sums[kind] == (sum(ranks) if ranks else rank), (tp, pp, cp, rank, kind)
            assert made == 4, f"rank {rank} took part in {made} creations"
            if cp > 1:
                assert members["cp_group"] is not None and members["dp_group"] is None


def _env(rank: int) -> parallel_state.LaunchEnv:
    return parallel_state.LaunchEnv(rank=rank, local_rank=rank, world_size=8, local_world_size=8,
                                    master_addr="", master_port=0, source="test", node_rank=0,
                                    num_nodes=1)


def test_counts_before_and_after_on_70b_1024_rank_0() -> None:
    lists = group_lists(rank_grid(1024, tp=8, pp=8))
    assert sum(len(v) for v in lists.values()) == 464  # what every rank used to create
    assert parallel_state.planned_creations(lists, 0, 1024, split=False) == 5
    assert parallel_state.planned_creations(lists, 500, 1024, split=False) == 4  # mid stage
    assert parallel_state.planned_creations(lists, 500, 1024, split=True) == 5  # one per kind


def test_nccl_path_splits_the_world_once_per_kind(monkeypatch) -> None:
    """With a bound device every rank enters one split_group per kind with the same lists."""
    cfg = parse_config(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                        "2", "--context-parallel-size", "2", "--num-layers", "4", "--dry-run"])
    calls: dict[int, list] = {}
    real_new_group = dist.new_group
    for rank in (0, 5):
        calls[rank] = []

        def split(split_ranks: list[list[int]], timeout: object, _rank: int = rank
                  ) -> dist.ProcessGroup | None:
            calls[_rank].append(split_ranks)
            own = next((r for r in split_ranks if _rank in r), None)
            return None if own is None else real_new_group(own, use_local_synchronization=True)

        monkeypatch.setattr(dist, "split_group", split)
        monkeypatch.setattr(parallel_state, "_splits_world", lambda: True)
        pstate = parallel_state.initialize_fake(cfg, 8, rank)
        try:
            assert pstate.group_creations == len(calls[rank])
            assert dist.get_process_group_ranks(pstate.cp_group) == [rank - rank % 4 + rank % 2,
                                                                     rank - rank % 4 + rank % 2
                                                                     + 2]
        finally:
            parallel_state.destroy(pstate)
        monkeypatch.undo()
    assert calls[0] == calls[5] and len(calls[0]) == 4  # tp, pp, mp, cp: same lists on each


def test_70b_1024_dry_run_prints_group_creations_and_host_syncs(tmp_path, capsys) -> None:
    out = tmp_path / "dry.jsonl"
    cfg = parse_config([*LLAMA_70B_1024, "--dry-run", "--world-size", "1024",
                        "--dry-run-ranks", "0", "--log-jsonl", str(out)])
    assert dry_run(cfg, 1024) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text().splitlines()[0])
    assert record["group_creations"] <= 16
    assert (f"dry run: rank 0 took part in {record['group_creations']} process-group creations"
            in printed)
    # the same run's step: device->host syncs independent of its 80 layers, the host's time
    assert record["host_syncs_per_step"] <= 6 and record["host_step_s"] > 0
    assert (f"dry run: rank 0 step: {record['host_syncs_per_step']} device->host syncs"
            in printed)
