"""The rank dry run matches ops by NCCL's rules: per (sender, receiver) pair in posting order,
tags ignored, a batch as its ops in list order, and every op by its call-site identity, so a
reordering of equal-shape transfers or collectives is caught (shapes alone would pass it).

Pure matcher cases first, then planted reorderings that make the in-process dry run fail.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from megatron_lite.arguments import parse_config
from megatron_lite.dry_run import dry_run, run_rank
from megatron_lite.optim.grad_sync import ParamGather
from megatron_lite.parallel import audit
from megatron_lite.parallel.audit import CommOp, identity, match
from megatron_lite.pipeline.p2p import StageComm

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2",
        "--num-query-groups", "1", "--seq-length", "16", "--vocab-size", "64",
        "--micro-batch-size", "1", "--dry-run"]
PP2_INTERLEAVED = ["--pipeline-model-parallel-size", "2",
                   "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4"]
DP2_ZERO1 = ["--use-distributed-optimizer", "--ddp-bucket-size", "1", "--global-batch-size",
             "2"]
"""DP=2 with one parameter per bucket: the four layers' equal weights give equal buckets."""

WORLD = (0, 1)


def _op(kind: str, ident=None, peer: int | None = None, shape=(4,)) -> CommOp:
    return CommOp(kind, WORLD, "float32", (shape,), 16, peer, "here",
                  ident if ident is None else identity(*ident[:1], **ident[1]))


def _act(mb: int, chunk: int = 0) -> tuple:
    return ("activation", {"mb": mb, "chunk": chunk})


def _grad(mb: int, chunk: int = 0) -> tuple:
    return ("grad", {"mb": mb, "chunk": chunk})


def _anonymous(records: dict[int, list[CommOp]]) -> dict[int, list[CommOp]]:
    """The records as the shape-only matcher saw them."""
    return {r: [dataclasses.replace(op, identity=None) for op in ops]
            for r, ops in records.items()}


# ---- pure matcher ---------------------------------------------------------------------------


def test_reordered_equal_shape_p2p_is_named_by_rank_op_and_position() -> None:
    records = {0: [_op("send", _act(3, 1), 1), _op("send", _grad(2), 1)],
               1: [_op("recv", _grad(2), 0), _op("recv", _act(3, 1), 0)]}
    assert match(_anonymous(records)) is None  # same shapes and dtypes: the old rule passes
    problem = match(records)
    assert problem is not None
    assert problem.startswith("rank 0 -> rank 1: send #0 is (activation, mb 3, chunk 1)")
    assert "but recv #0 on rank 1 expects (grad, mb 2, chunk 0)" in problem
    assert "same shapes, different identities" in problem


def test_tags_are_ignored_and_only_per_pair_order_counts() -> None:
    """Send and receive of one batch may be listed either way round (NCCL posts a pair's
    sends and its receives as two ordered streams), but two sends to one peer may not."""
    exchange = {0: [_op("send", _act(0), 1), _op("recv", _grad(0), 1)],
                1: [_op("send", _grad(0), 0), _op("recv", _act(0), 0)]}
    assert match(exchange) is None
    flipped = {0: exchange[0], 1: exchange[1][::-1]}
    assert match(flipped) is None
    batch = {0: [_op("send", _act(0), 1), _op("send", _act(0, 1), 1)],
             1: [_op("recv", _act(0, 1), 0), _op("recv", _act(0), 0)]}
    assert "send #0 is (activation, mb 0, chunk 0)" in match(batch)


def test_swapped_equal_size_gathers_are_named() -> None:
    gathers = [("param_gather", {"buffer": 0, "bucket": b}) for b in (3, 2)]
    records = {0: [_op("all_gather", g) for g in gathers],
               1: [_op("all_gather", g) for g in gathers[::-1]]}
    assert match(_anonymous(records)) is None
    problem = match(records)
    assert problem is not None and "group [0, 1], collective #0" in problem
    assert "rank 0 issues all_gather (param_gather, buffer 0, bucket 3)" in problem
    assert "rank 1 issues all_gather (param_gather, buffer 0, bucket 2)" in problem


def test_a_missing_receive_names_both_ends() -> None:
    problem = match({0: [_op("send", _act(0), 1), _op("send", _act(1), 1)],
                     1: [_op("recv", _act(0), 0)]})
    assert "rank 0 -> rank 1: send #1 is (activation, mb 1, chunk 0)" in problem
    assert "rank 1 receives nothing more from rank 0" in problem


def test_identities_cost_nothing_outside_an_audit() -> None:
    def never() -> list:
        raise AssertionError("identities built without an audit")

    assert not audit.recording()
    assert audit.op_identity("x", bucket=1) is audit.batch_identity(never)


# ---- planted reorderings in the dry run -----------------------------------------------------


def _records(extra: list[str], world: int) -> dict[int, list[CommOp]]:
    cfg = parse_config([*TINY, *extra])
    return {r: run_rank(cfg, world, r, time_host=False).ops for r in range(world)}


def test_activation_grad_order_reversed_on_odd_stages_fails(monkeypatch) -> None:
    """Odd stages post each batch's grads before its activations (the schedule posts
    activations first): gloo, matching by tag, would compute correctly; NCCL would not."""
    real = StageComm.post

    def grads_first(self, ops, outgoing):
        if self.pstate.pp_rank % 2:
            ops = sorted(ops, key=lambda op: op.tensor == "activation")
        return real(self, ops, outgoing)

    monkeypatch.setattr(StageComm, "post", grads_first)
    records = _records(PP2_INTERLEAVED, 2)
    assert match(_anonymous(records)) is None
    problem = match(records)
    print(problem)
    assert problem is not None
    assert problem.startswith(("rank 0 -> rank 1: ", "rank 1 -> rank 0: "))
    assert " #" in problem and "(grad, mb" in problem and "(activation, mb" in problem


def test_two_equal_size_zero1_gathers_swapped_on_odd_dp_ranks_fail(monkeypatch) -> None:
    real = ParamGather.start
    swapped = []

    def swap_two(self, async_op):
        keys = self.bufs.bucket_keys()
        sizes = [self.bufs.buffers[b].layout.buckets[k].range.size for b, k in keys]
        pair = next((i, j) for i in range(len(keys)) for j in range(i + 1, len(keys))
                    if sizes[i] == sizes[j])
        if self.ctx.replicas.rank % 2:
            keys[pair[0]], keys[pair[1]] = keys[pair[1]], keys[pair[0]]
            self.bufs.bucket_keys = lambda: keys
            swapped.append(pair)
        try:
            real(self, async_op)
        finally:
            self.bufs.__dict__.pop("bucket_keys", None)

    monkeypatch.setattr(ParamGather, "start", swap_two)
    records = _records(DP2_ZERO1, 2)
    assert swapped
    assert match(_anonymous(records)) is None
    problem = match(records)
    print(problem)
    assert problem is not None and "group [0, 1], collective #" in problem
    assert "rank 0 issues all_gather (param_gather" in problem
    assert "rank 1 issues all_gather (param_gather" in problem


@pytest.mark.parametrize("planted", [False, True])
def test_batches_posted_in_reverse_on_odd_ranks_fail_dry_run_ranks_all(
        planted: bool, monkeypatch, capsys) -> None:
    """The issue's check: a wrapper around torch.distributed.batch_isend_irecv that posts
    every batch in reverse on odd ranks, nothing else changed, on a PP=2 interleaved layout."""
    real = dist.batch_isend_irecv

    def reversed_on_odd(p2p_op_list):
        if dist.get_rank() % 2:
            p2p_op_list = p2p_op_list[::-1]
        return real(p2p_op_list)

    if planted:
        monkeypatch.setattr(dist, "batch_isend_irecv", reversed_on_odd)
    cfg = parse_config([*TINY, *PP2_INTERLEAVED, "--world-size", "2", "--dry-run-ranks", "all"])
    status = dry_run(cfg, 2)
    out = capsys.readouterr().out
    verdict = out[out.rindex("\ncollectives") + 1:]
    print(verdict)
    if not planted:
        assert status == 0 and verdict.startswith("collectives matched")
        return
    assert status == 1 and "collectives matched" not in out
    assert verdict.startswith("collectives DO NOT match: rank ")
    assert "same shapes, different identities" in verdict


# ---- the current schedules keep NCCL's order ------------------------------------------------

LAYOUTS = {
    "1f1b-pp2": (["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"],
                 {"activation", "grad"}),
    "zb-h1-pp2": (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1",
                   "--global-batch-size", "4"], {"activation", "grad"}),
    "zbv-pp2": (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
                 "--global-batch-size", "4"], {"activation", "grad"}),
    "cp2-ring": (["--context-parallel-size", "2", "--global-batch-size", "2"],
                 {"ring_kv", "ring_kv_backward", "ring_dkv"}),
    "zero1-dp2": (DP2_ZERO1, {"grad_reduce", "param_gather"}),
    "zero2-dp2": ([*DP2_ZERO1, "--data-parallel-sharding-strategy", "optim_grads"],
                  {"grad_reduce_scatter", "param_gather"}),
    "zero3-dp2": ([*DP2_ZERO1, "--data-parallel-sharding-strategy", "optim_grads_params"],
                  {"grad_reduce_scatter", "unit_gather"}),
}
"""Layout -> the identity kinds its call sites must have labelled."""
LABELLED = {"send", "recv", "all_gather", "reduce_scatter"}
"""Ops every call site of these layouts labels (all-reduces are labelled only per bucket)."""


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_current_schedule_matches_with_identities(layout: str) -> None:
    flags, kinds = LAYOUTS[layout]
    records = _records(flags, 2)
    assert match(records) is None
    ops = [op for ops in records.values() for op in ops]
    assert all(op.identity is not None for op in ops if op.op in LABELLED), layout
    assert kinds <= {op.identity[0] for op in ops if op.identity is not None}, layout
