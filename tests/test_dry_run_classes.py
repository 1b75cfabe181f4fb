"""`--dry-run-ranks classes`: one rank per position runs, the others are stood in by it.

The stand-ins are checked against the real thing: a rank that classes does not run is run
anyway, and its ops must equal the ones synthesized from its representative.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import pretrain
from megatron_lite import dry_run
from megatron_lite.arguments import parse_config
from megatron_lite.parallel import audit
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.rank_classes import groups_by_kind, representatives, stand_in
from tests.test_dry_run import TINY
from tests.test_moe_dry_run import TINY_MOE

TP2_PP2_DP4 = (16, [*TINY, "--tensor-model-parallel-size", "2",
                    "--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                    "--use-distributed-optimizer", "--overlap-grad-reduce"])
"""16 ranks: stage 0 is ranks 0-7 (DP replica d holds ranks 2d, 2d+1), stage 1 ranks 8-15."""
MOE_EP2_DP4 = (4, [*TINY_MOE, "--moe-token-dispatcher-type", "alltoall"])
"""EP 2 over DP 4: EP index = DP index mod 2, so replica 2 (EP 0) is a class of its own."""


def _cli(layout: tuple[int, list[str]], capsys) -> tuple[int, str]:
    world, extra = layout
    rc = pretrain.main([*extra, "--dry-run", "--world-size", str(world),
                        "--dry-run-ranks", "classes"])
    return rc, capsys.readouterr().out


def test_the_class_ranks_are_exactly_the_expected_set() -> None:
    world, extra = TP2_PP2_DP4
    reps = representatives(parse_config([*extra, "--dry-run"]), world)
    assert sorted(set(reps.values())) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert reps[6] == 2 and reps[7] == 3 and reps[13] == 11 and reps[4] == 2
    world, extra = MOE_EP2_DP4
    reps = representatives(parse_config([*extra, "--dry-run"]), world)
    assert reps == {0: 0, 1: 1, 2: 2, 3: 1}


@functools.cache
def _ran(layout: tuple[int, tuple[str, ...]], rank: int) -> list[audit.CommOp]:
    return dry_run.run_rank(parse_config([*layout[1], "--dry-run"]), layout[0], rank,
                            time_host=False).ops


@pytest.mark.parametrize("layout,rank", [(TP2_PP2_DP4, 6), (TP2_PP2_DP4, 13),
                                         (MOE_EP2_DP4, 3)])
def test_a_stand_in_equals_the_rank_run_for_real(layout, rank: int) -> None:
    world, extra = layout
    cfg = parse_config([*extra, "--dry-run"])
    rep = representatives(cfg, world)[rank]
    key = (world, tuple(extra))
    made = stand_in(_ran(key, rep), groups_by_kind(cfg, world, rep),
                    groups_by_kind(cfg, world, rank))
    assert made == _ran(key, rank)


@pytest.mark.parametrize("layout", [TP2_PP2_DP4, MOE_EP2_DP4], ids=["tp2-pp2-dp4", "ep2-dp4"])
def test_classes_match_where_all_matches(layout, capsys) -> None:
    rc, out = _cli(layout, capsys)
    assert rc == 0, out
    run = len(set(representatives(parse_config([*layout[1], "--dry-run"]), layout[0]).values()))
    assert f"{run} ranks run, {layout[0] - run} stood in" in out
    assert f"on {layout[0]} ranks" in out and "collectives matched" in out


def test_an_extra_collective_on_dp_replica_1_fails_the_match(monkeypatch, capsys) -> None:
    """Replica 1 stands for replicas 2 and 3, so its bug is theirs; replica 0 lacks the op."""
    made: list[parallel_state.ParallelState] = []
    real_init, real_loop = parallel_state.initialize_fake, dry_run.train_loop

    def init(*args):
        made.append(real_init(*args))
        return made[-1]

    def loop(trainer):
        if made[-1].dp_rank == 1:  # the plant
            with audit.group_kind("dp"):
                dist.all_reduce(torch.zeros(3, device="meta"), group=made[-1].dp_group)
        return real_loop(trainer)

    monkeypatch.setattr(parallel_state, "initialize_fake", init)
    monkeypatch.setattr(dry_run, "train_loop", loop)
    rc, out = _cli(TP2_PP2_DP4, capsys)
    assert rc == 1, out
    assert "collectives DO NOT match" in out and "all_reduce" in out
    assert "test_dry_run_classes.py" in out  # the planted call site
