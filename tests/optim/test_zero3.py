"""ZeRO-3 (--data-parallel-sharding-strategy optim_grads_params) vs one process, and its costs.

DP=2 and DP=4 with two micro-batches per rank and clipping active at every step: losses,
reduced gradients, gradient norms and weights within EXACT (1e-10, float64 on both sides,
tests/numerics.py) of the single-process run (10 steps at DP=2; 3 at DP=4, whose 10-step
weights test_sharding checks); the same with full and selective recomputation; TP=2 x DP=2
with SP (on the DP=4 spawn's ranks). Memory and traffic are checked on bf16 runs. Per step the wire
carries two all-gathers of the parameters (bf16) and one reduce-scatter of the gradients
(fp32) per micro-batch; between steps a rank holds 18 bytes per parameter / DP, plus the units
a forward or backward gathers, all of them given back afterwards.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lite.arguments import parse_config
from megatron_lite.dry_run import run_rank
from megatron_lite.layers import tags
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.training import StepRunner, build_model, global_token_count, reduce_loss
from tests.checkpoint.common import relayout
from tests.distributed import run_ranks
from tests.numerics import assert_close
from tests.optim.common import (
    OPTIM,
    assert_same_params,
    full_params,
    make_config,
    model_parameters,
    step_batches,
    train_reference,
)

STEPS = 10
SHORT = 4
"""Steps of the DP=4, recompute and TP=2 runs: a wrong gather, shard or recomputed forward
shows at the first step; 10-step weights are test_sharding's and the DP=2 run's."""
ZERO3 = {"data_parallel_sharding_strategy": "optim_grads_params"}


def _owned_grads(opt: Optimizer) -> list[tuple[str, int, torch.Tensor]]:
    """(parameter name, flat offset, reduced gradient values) of every owned piece."""
    out = []
    for buffer, shard in zip(opt.buffers, opt.shards):
        for r, info in zip(buffer.layout.param_ranges, shard.infos):
            for own in shard.owned:
                part = r.intersect(own)
                if part is not None:
                    out.append((info.name.split(".", 1)[1], part.start - r.start,
                                shard.grad_at(part).clone()))
    return out


def _train(pstate: ParallelState, cfg, steps: int = STEPS, grads: bool = False) -> dict:
    """`steps` optimizer steps; losses, norms, traffic, weights, and ZeRO-3's memory."""
    chunks = build_model(cfg, pstate)
    opt = Optimizer(cfg, chunks, pstate)
    runner = StepRunner(cfg, pstate, chunks)
    out: dict = {"losses": [], "norms": [], "grads": [], "bytes": [], "calls": []}
    for step in range(steps):
        batches = step_batches(step, pstate.dp_rank, pstate.dp_size,
                               cfg.train.micro_batch_size, cfg.train.global_batch_size)
        opt.traffic.reset()
        opt.zero_grad()
        local = runner(batches, global_token_count(batches, pstate))
        opt.finalize_grads()
        out["losses"].append(reduce_loss(local, pstate))
        if grads:
            out["grads"].append(_owned_grads(opt))
        result = opt.step(cfg.optim.lr)
        assert not result.skipped
        out["norms"].append(result.grad_norm)
        out["bytes"].append(dict(opt.traffic.bytes_sent))
        out["calls"].append(dict(opt.traffic.calls))
    if opt.fsdp is not None:
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                    for p in opt.params}
        out["idle_param_bytes"] = sum(storages.values())
        out["peak_gathered"] = opt.fsdp.peak_gathered_bytes
        out["blocking_gathers"] = opt.fsdp.blocking_gathers
        out["unit_bytes"] = [sum(opt.buffers[b].full[k].numel() * opt.buffers[b].full[k]
                                 .element_size() for b, k in unit.keys)
                             for unit in opt.fsdp.units]
        out["head_reads"] = opt.fsdp.units[-1].uses
        out["shard_bytes"] = (sum(b.param.nbytes() for b in opt.buffers)
                              + sum(s.grad_nbytes() for s in opt.shards))
    out["padded_numel"] = sum(b.layout.numel for b in opt.buffers)
    out["memory"] = opt.memory()
    with opt.gathered_params():
        out["params"] = model_parameters(chunks)
    out["splits"] = {n: tags.tp_split(p) for n, p in chunks[0].named_parameters()}
    opt.close()
    return out


def _dp_suite(pstate: ParallelState, global_batch: int, tp_cfgs: dict | None = None) -> dict:
    """Every variant of one DP size, each from a fresh model, in one spawn; then the TP=2
    variants (`tp_cfgs`) on the same ranks."""
    zero3 = make_config(global_batch=global_batch, **ZERO3)
    steps = STEPS if pstate.dp_size == 2 else SHORT
    out = {"zero3": _train(pstate, zero3, steps=steps, grads=True)}
    if pstate.dp_size == 2:
        for granularity in ("full", "selective"):
            cfg = make_config(global_batch=global_batch, **ZERO3)
            cfg.train.recompute_granularity = granularity
            out[f"recompute_{granularity}"] = _train(pstate, cfg, steps=SHORT)
        out["bf16"] = _train(pstate, make_config(global_batch=global_batch, bf16=True, **ZERO3),
                             steps=2)
        out["bf16_zero1"] = _train(pstate, make_config(global_batch=global_batch, bf16=True,
                                                       use_distributed_optimizer=True), steps=2)
    if tp_cfgs:
        out["tp2"] = _tp_suite(relayout(pstate, 2, 1), tp_cfgs)
    return out


def _dp_run(dp: int, tmp_path_factory) -> tuple[int, list[dict], dict]:
    """(DP size, per-rank results, single-process reference) at 2 micro-batches per rank."""
    global_batch = 2 * dp
    ranks = run_ranks(_dp_suite, dp, tmp_path_factory.mktemp(f"dp{dp}"), timeout=400,
                      global_batch=global_batch, tp_cfgs=_tp_configs() if dp == 4 else None)
    reference = train_reference(STEPS if dp == 2 else SHORT, global_batch=global_batch)
    assert min(reference["norms"]) > OPTIM.clip_grad, "clipping must be active at every step"
    return dp, ranks, reference


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> tuple[int, list[dict], dict]:
    return _dp_run(2, tmp_path_factory)


@pytest.fixture(scope="module")
def dp4(tmp_path_factory) -> tuple[int, list[dict], dict]:
    return _dp_run(4, tmp_path_factory)


def _assemble(ranks: list[dict], step: int, ref_grads: dict[str, torch.Tensor]
              ) -> dict[str, torch.Tensor]:
    """The full reduced gradients of `step` from every DP rank's owned pieces."""
    full = {n: torch.full((g.numel(),), float("nan"), dtype=g.dtype)
            for n, g in ref_grads.items()}
    for rank in ranks:
        for name, offset, values in rank["zero3"]["grads"][step]:
            full[name][offset:offset + values.numel()] = values
    return {n: full[n].view_as(ref_grads[n]) for n in full}


@pytest.mark.parametrize("layout", ["dp2", "dp4"])
def test_matches_single_process(request, layout: str) -> None:
    """Loss, reduced gradients, norms and weights: within EXACT of one process, every step."""
    _, ranks, ref = request.getfixturevalue(layout)
    for rank in ranks:
        run = rank["zero3"]
        assert len(run["losses"]) == len(ref["losses"])
        assert all(c["all_gather"] > 0 for c in run["calls"])  # really gathering
        assert_close(run["losses"], ref["losses"], what="losses")
        assert_close(run["norms"], ref["norms"], what="norms")
        assert_same_params(run["params"], ref["params"])
    for step in range(len(ref["grads"])):
        assert_same_params(_assemble(ranks, step, ref["grads"][step]), ref["grads"][step])


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_composes(dp2, granularity: str) -> None:
    _, ranks, _ = dp2
    ref = train_reference(SHORT, global_batch=4)
    for rank in ranks:
        run = rank[f"recompute_{granularity}"]
        assert_close(run["losses"], ref["losses"], what="losses")
        assert_same_params(run["params"], ref["params"])
        # recomputation re-runs forwards inside backward, but gathers nothing extra
        assert run["bytes"] == rank["zero3"]["bytes"][:SHORT]
        assert run["blocking_gathers"] == SHORT * 2 * 1  # as without (test below)


def test_gathers_are_prefetched(dp2) -> None:
    """Only the embedding's forward waits for a whole gather (1 per micro-batch): the head
    and the tied embedding it reads stay gathered from the head's forward into its backward,
    which runs right after it; every other unit's gather was started one unit ahead (here 4
    units, 2 micro-batches per rank)."""
    for rank in dp2[1]:
        assert rank["zero3"]["blocking_gathers"] == STEPS * 2 * 1


def test_traffic_is_two_gathers_and_one_reduce_scatter(dp2) -> None:
    """Per micro-batch: every unit's bf16 parameters all-gathered twice (forward, backward;
    the head and the tied embedding it reads once: they stay gathered into the head's
    backward) and its fp32 gradients reduce-scattered once, in ring bytes: 2 x 2 + 4 B x
    (n-1)/n per (padded) parameter; ZeRO-1 moves 2 + 4 B once per step."""
    dp, ranks, _ = dp2
    microbatches = 2
    for rank in ranks:
        run, zero1 = rank["bf16"], rank["bf16_zero1"]
        share = run["padded_numel"] * (dp - 1) / dp
        head = sum(run["unit_bytes"][u] for u in run["head_reads"]) * (dp - 1) / dp
        for sent in run["bytes"]:
            assert sent["all_gather"] == pytest.approx(microbatches * (2 * 2 * share - head),
                                                       rel=0.01)
            assert sent["reduce_scatter"] == pytest.approx(microbatches * 4 * share, rel=0.01)
        zero1_share = zero1["padded_numel"] * (dp - 1) / dp
        for sent in zero1["bytes"]:
            assert sent["all_gather"] == pytest.approx(2 * zero1_share, rel=0.01)
            assert sent["reduce_scatter"] == pytest.approx(4 * zero1_share, rel=0.01)


def test_memory_is_sharded(dp2) -> None:
    """Between steps: 2 B (bf16 shard) + 4 B (fp32 gradient shard) + 12 B (master, Adam) per
    owned element, no full-size parameter bytes; at most the two largest units (the one
    running and the prefetched one) plus the tied embedding gathered at any time."""
    dp, ranks, _ = dp2
    for rank in ranks:
        run = rank["bf16"]
        owned = run["padded_numel"] // dp
        assert run["shard_bytes"] == 6 * owned
        assert run["memory"].state_bytes == 12 * owned
        assert run["memory"].grad_buffer_bytes == 4 * owned
        assert run["idle_param_bytes"] == 0
        units = run["unit_bytes"]
        embedding, layers = units[0], sorted(units[1:-1])
        assert max(layers) <= run["peak_gathered"] <= embedding + layers[-1] + layers[-2] + \
            units[-1]
        per_param = (run["shard_bytes"] + run["memory"].state_bytes) / (
            run["memory"].local_params / dp)
        assert 18 <= per_param < 18 * 1.1  # 10% padding at most on this tiny model


TP2 = {"zero3": {**ZERO3, "sequence_parallel": True},
       "zero3_recompute": {**ZERO3, "sequence_parallel": True}}


def _tp_configs() -> dict:
    out = {name: make_config(tp=2, **flags) for name, flags in TP2.items()}
    out["zero3_recompute"].train.recompute_granularity = "full"
    return out


def _tp_suite(pstate: ParallelState, cfgs: dict) -> dict:
    return {name: _train(pstate, cfg, steps=SHORT) for name, cfg in cfgs.items()}


def test_tp2_dp2_sequence_parallel(dp4) -> None:
    """TP=2 x DP=2 with SP (plain and full recomputation): losses and weights of one process
    within EXACT (float64; in fp32 TP's split matmuls needed lr 1e-3 and 1e-5). ZeRO-1 on
    this layout is held to the same reference in test_data_parallel."""
    ranks = [r["tp2"] for r in dp4[1]]
    ref = train_reference(SHORT)
    for name in TP2:
        assert_close(ranks[0][name]["losses"], ref["losses"], what=f"{name} losses")
        for dp_rank in (0, 1):
            full = full_params([r[name] for r in ranks[2 * dp_rank:2 * dp_rank + 2]], tp=2)
            assert_same_params(full, ref["params"])


@pytest.mark.quick
def test_dry_run_on_meta() -> None:
    """The meta-device rank dry run: shards only between steps, and on the DP group the
    step's collectives are per unit and micro-batch two bf16 gathers (the head and the tied
    embedding one: they stay gathered into the head's backward) and one fp32 scatter."""
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "32", "--vocab-size", "256", "--micro-batch-size", "1",
             "--global-batch-size", "8", "--bf16", "--dry-run", *[
                 "--data-parallel-sharding-strategy", "optim_grads_params"]]
    cfg = parse_config(flags)
    result = run_rank(cfg, 4, 1, time_host=False)
    params = sum(p.numel() for p in build_model(cfg, single_process_state())[0].parameters())
    assert result.params_bytes == pytest.approx(2 * params / 4, rel=0.02)
    assert result.grads_bytes == 2 * result.params_bytes  # fp32 gradient shard
    assert result.optimizer_bytes == 6 * result.params_bytes
    dp_group = tuple(range(4))
    step = result.ops[slice(*result.phase_ops["train_step"])]
    ops = [op for op in step if op.group == dp_group and op.op != "all_reduce"]
    units, microbatches = 4, 2
    gathers = [op for op in ops if op.op == "all_gather"]
    scatters = [op for op in ops if op.op == "reduce_scatter"]
    assert len(gathers) == (2 * units - 2) * microbatches and {op.dtype for op in gathers} == {
        "bfloat16"}
    assert len(scatters) == units * microbatches and {op.dtype for op in scatters} == {
        "float32"}
