"""Context parallelism against one process: the same samples, split over CP ranks (with TP,
SP, PP, DP and ZeRO-1/2/3 around it), give the same loss, gradients and 10-step training.

Every run reads its batches through `MicroBatchLoader` from the same mock samples, so the
loader's CP split (each CP rank of a DP rank takes its two chunks of the same samples) is
part of what is checked. float64 throughout (tests/numerics.py): losses, gradients and the
weights after ten AdamW steps within EXACT (worst observed: 4e-16 for loss and gradients,
9e-15 for losses and weights after ten steps).

Two spawned jobs (2 and 4 ranks) serve every layout of a size (`relayout` between layouts),
and the planted breakage: a ring that drops one step of attention, and SP norm gradients
never summed over TP, must each fail the same comparison.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from megatron_lite.config import (
    Config,
    ConfigError,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    validate,
)
from megatron_lite.data.builder import build_loaders
from megatron_lite.data.loader import MicroBatchLoader, SequenceLayout, context_parallel_index
from megatron_lite.data.mock import MockDataset
from megatron_lite.layers import attention as attn
from megatron_lite.layers import tags
from megatron_lite.layers.attention import zigzag_token_index
from megatron_lite.layers.init import unshard
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.optim.param_buffers import ParamBuffers
from megatron_lite.parallel import comms
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.state import (
    ParallelState,
    format_grid,
    rank_grid,
    single_process_state,
)
from megatron_lite.training import (
    StepRunner,
    build_model,
    global_token_count,
    reduce_loss,
    train_step,
)
from tests.distributed import relayout, run_ranks
from tests.numerics import assert_all_close, assert_close, rel_err
from tests.optim.common import model_parameters

MODEL = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=48, seq_length=32, vocab_size=104,
                    make_vocab_size_divisible_by=4)
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, adam_beta2=0.95)


def make_config(*, cp: int = 1, tp: int = 1, pp: int = 1, global_batch: int = 4,
                **parallel: object) -> Config:
    return Config(model=replace(MODEL),
                  parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                          pipeline_model_parallel_size=pp,
                                          context_parallel_size=cp,
                                          distributed_backend="gloo", **parallel),
                  optim=replace(OPTIM),
                  train=TrainConfig(micro_batch_size=1, global_batch_size=global_batch,
                                    seed=7, fp64=True))


def _loader(cfg: Config, pstate: ParallelState) -> MicroBatchLoader:
    return MicroBatchLoader(MockDataset(MODEL.vocab_size, MODEL.seq_length, seed=5),
                            micro_batch_size=cfg.train.micro_batch_size,
                            global_batch_size=cfg.train.global_batch_size,
                            dp_rank=pstate.dp_rank, dp_size=pstate.dp_size,
                            layout=SequenceLayout(pstate.cp_rank, pstate.cp_size))


def _coords(pstate: ParallelState) -> dict:
    return {"tp": pstate.tp_rank, "pp": pstate.pp_rank, "dp": pstate.dp_rank,
            "cp": pstate.cp_rank}


def loss_and_grads(pstate: ParallelState, config: Config) -> dict:
    """One global batch's loss and the gradients summed over CP (what DP x CP reduction
    gives the optimizer), without an optimizer."""
    chunks = build_model(config, pstate)
    batches = _loader(config, pstate).next_step()
    local = StepRunner(config, pstate, chunks)(batches, global_token_count(batches, pstate))
    grads = {}
    for name, p in chunks[0].named_parameters():
        grads[name] = comms.all_reduce_(p.grad.clone(), pstate.cp_group, kind="cp")
    return {"loss": reduce_loss(local, pstate), "grads": grads, **_coords(pstate)}


def train(pstate: ParallelState, config: Config, steps: int = 10) -> dict:
    """`steps` optimizer steps through the training loop's own `train_step`."""
    chunks = build_model(config, pstate)
    opt = Optimizer(config, chunks, pstate)
    hook = opt.start_grad_sync if config.parallel.overlap_grad_reduce else None
    runner = StepRunner(config, pstate, chunks, on_grads_ready=hook)
    loader = _loader(config, pstate)
    losses = [train_step(runner, opt, loader, pstate, config.optim.lr).loss
              for _ in range(steps)]
    with opt.gathered_params():  # ZeRO-3 keeps only shards between forwards
        params = model_parameters(chunks)
    opt.close()
    splits = dict(zip(params, (tags.tp_split(p) for c in chunks for p in c.parameters()),
                      strict=True))
    return {"losses": losses, "params": params, "splits": splits, **_coords(pstate)}


def full_params(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """The whole model from DP rank 0 / CP rank 0: stages merged, TP pieces unsharded."""
    mine = [r for r in ranks if r["dp"] == 0 and r["cp"] == 0]
    out = {}
    for stage in sorted({r["pp"] for r in mine}):
        pieces = sorted((r for r in mine if r["pp"] == stage), key=lambda r: r["tp"])
        for name in pieces[0]["params"]:
            out[name] = unshard([p["params"][name] for p in pieces], pieces[0]["splits"][name])
    return out


def test_loader_index_is_the_attention_zigzag() -> None:
    for size in (1, 2, 4):
        for rank in range(size):
            assert torch.equal(context_parallel_index(32, size, rank),
                               zigzag_token_index(32, size, rank))
    whole = torch.cat([context_parallel_index(32, 4, r) for r in range(4)])
    assert torch.equal(whole.sort().values, torch.arange(32))


LAYOUTS = {
    "cp2": (2, dict(cp=2)),
    "cp4": (4, dict(cp=4)),
    "tp2-cp2-sp": (4, dict(tp=2, cp=2, sequence_parallel=True)),
    "cp2-pp2-interleaved": (4, dict(cp=2, pp=2, num_layers_per_virtual_pipeline_stage=1)),
    "cp2-dp2-zero1-overlap": (4, dict(cp=2, use_distributed_optimizer=True,
                                      overlap_grad_reduce=True, ddp_bucket_size=2000)),
    "cp2-pp2-zb-h1": (4, dict(cp=2, pp=2, pipeline_schedule="zb-h1")),
    # ZeRO-2/3 shard gradients (and parameters) over DP x CP, as ZeRO-1 does
    "cp2-zero2": (2, dict(cp=2, data_parallel_sharding_strategy="optim_grads")),
    "cp2-dp2-zero3": (4, dict(cp=2, data_parallel_sharding_strategy="optim_grads_params")),
}
BROKEN_STEPS = 2
"""Optimizer steps of the SP breakage run: the first step's forward is still right."""


def _drop_previous_block(pstate: ParallelState) -> None:
    """The planted CP bug: every attention layer skips the K/V block that arrives from the
    previous CP rank (one ring step), forward and backward."""
    size = pstate.cp_size
    previous = zigzag_token_index(MODEL.seq_length, size, (pstate.cp_rank - 1) % size)
    real = attn.block_pairs

    def dropping(q_ids: torch.Tensor, k_ids: torch.Tensor, batch: int) -> list:
        return [] if torch.equal(k_ids[0], previous) else real(q_ids, k_ids, batch)

    attn.block_pairs = dropping


def _no_sp_norm_reduce(self: ParamBuffers) -> list:
    """The planted SP bug: no SP norm weight gradient is summed over TP."""
    return []


def _job(pstate: ParallelState, world: int) -> dict[str, dict]:
    """Every run of one world size on this rank."""
    out = {}
    cp = world  # loss and gradients: CP over every rank
    pstate = relayout(pstate, make_config(cp=cp))
    out[f"grads-cp{cp}"] = loss_and_grads(pstate, make_config(cp=cp))
    if world == 2:
        real = attn.block_pairs
        _drop_previous_block(pstate)
        try:
            out["grads-cp2-dropped-step"] = loss_and_grads(pstate, make_config(cp=cp))
        finally:
            attn.block_pairs = real
    for layout, (size, sizes) in LAYOUTS.items():
        if size == world:
            cfg = make_config(**sizes)
            pstate = relayout(pstate, cfg)
            out[layout] = train(pstate, cfg)
    if world == 4:
        cfg = make_config(**LAYOUTS["tp2-cp2-sp"][1])
        pstate = relayout(pstate, cfg)
        real = ParamBuffers.sequence_parallel_pieces
        ParamBuffers.sequence_parallel_pieces = _no_sp_norm_reduce
        try:
            out["tp2-cp2-sp-no-norm-reduce"] = train(pstate, cfg, steps=BROKEN_STEPS)
        finally:
            ParamBuffers.sequence_parallel_pieces = real
    return out


class Jobs:
    """World size -> per-rank results, each job spawned once for the module on first use."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.factory, self.done = tmp_path_factory, {}

    def __getitem__(self, world: int) -> list[dict[str, dict]]:
        if world not in self.done:
            tmp = self.factory.mktemp(f"cp{world}")
            self.done[world] = run_ranks(_job, world, tmp, cfg=make_config(cp=world),
                                         timeout=400, world=world)
        return self.done[world]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    return Jobs(tmp_path_factory)


@pytest.fixture(scope="module")
def reference_grads() -> dict:
    return loss_and_grads(single_process_state(), make_config())


def compare_grads(ranks: list[dict], ref: dict) -> float:
    """Each rank's loss and CP-summed gradients within EXACT of one process; the worst."""
    worst = 0.0
    for r in ranks:
        worst = max(worst, assert_close(r["loss"], ref["loss"], what=f"cp rank {r['cp']} loss"))
        worst = max(worst, assert_all_close(r["grads"], ref["grads"],
                                            what=f"cp rank {r['cp']} gradient "))
    return worst


@pytest.mark.parametrize("cp", [pytest.param(2, marks=pytest.mark.quick), 4])
def test_cp_loss_and_grads_equal_one_process(jobs: Jobs, reference_grads: dict, cp: int
                                             ) -> None:
    worst = compare_grads([r[f"grads-cp{cp}"] for r in jobs[cp]], reference_grads)
    print(f"CP{cp} loss and gradients: worst relative error {worst:.1e}")


def test_dropped_ring_step_fails_the_comparison(jobs: Jobs, reference_grads: dict) -> None:
    """Planted breakage: attention without the previous rank's K/V block."""
    ranks = [r["grads-cp2-dropped-step"] for r in jobs[2]]
    with pytest.raises(AssertionError, match="relative error"):
        compare_grads(ranks, reference_grads)
    err = rel_err(ranks[0]["loss"], reference_grads["loss"])
    print(f"loss relative error with a dropped ring step: {err:.1e}")
    assert err > 1e-6


@pytest.fixture(scope="module")
def reference() -> dict:
    return train(single_process_state(), make_config())


def compare_training(ranks: list[dict], ref: dict) -> float:
    """Losses of every step and the weights after them within EXACT; the worst error."""
    worst = assert_close(ranks[0]["losses"], ref["losses"], what="losses")
    return max(worst, assert_all_close(full_params(ranks), ref["params"], what="weight "))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ten_steps_equal_one_process(jobs: Jobs, reference: dict, layout: str) -> None:
    world, _ = LAYOUTS[layout]
    ranks = [r[layout] for r in jobs[world]]
    losses = ranks[0]["losses"]
    assert losses[-1] < losses[0] - 0.1  # it trains
    worst = compare_training(ranks, reference)
    print(f"{layout}: worst relative error after ten steps {worst:.1e}")


def test_unsummed_sp_norm_gradients_fail_the_comparison(jobs: Jobs) -> None:
    """Planted breakage: TP2 x CP2 with SP, the optimizer skipping its TP sum of the norm
    weights' gradients (each rank steps on its own half of the sequence's gradient)."""
    ranks = [r["tp2-cp2-sp-no-norm-reduce"] for r in jobs[4]]
    ref = train(single_process_state(), make_config(), steps=BROKEN_STEPS)
    with pytest.raises(AssertionError, match="relative error"):
        compare_training(ranks, ref)
    got = full_params(ranks)
    err = max(rel_err(got[n], ref["params"][n]) for n in ref["params"] if "norm" in n)
    print(f"norm weights' relative error without the SP gradient sum: {err:.1e}")
    assert err > 1e-6


def test_rank_grid_puts_cp_between_tp_and_dp() -> None:
    grid = rank_grid(16, tp=2, pp=2, cp=2)  # dp = 2
    assert grid[0] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert grid[1][1][1] == [14, 15]
    text = format_grid(grid)
    assert "pp stage 0: dp0cp0:tp[0, 1]  dp0cp1:tp[2, 3]  dp1cp0:tp[4, 5]" in text
    assert "dp0:tp" in format_grid(rank_grid(4, tp=2, pp=1))  # CP=1 reads as before


def test_fake_state_coordinates_and_groups() -> None:
    cfg = make_config(cp=2, tp=2, pp=2)
    pstate = parallel_state.initialize_fake(cfg, 16, 11)  # pp 1, dp 0, cp 1, tp 1
    try:
        assert (pstate.pp_rank, pstate.dp_rank, pstate.cp_rank, pstate.tp_rank) == (1, 0, 1, 1)
        assert pstate.cp_ranks == (9, 11) and pstate.pp_ranks == (3, 11)
        assert (pstate.dp_size, pstate.cp_size, pstate.dp_cp_size, pstate.dp_cp_rank) == (2, 2,
                                                                                          4, 1)
        assert dist.get_process_group_ranks(pstate.cp_group) == [9, 11]
        assert dist.get_process_group_ranks(pstate.dp_group) == [11, 15]
        assert dist.get_process_group_ranks(pstate.dp_cp_group) == [9, 11, 13, 15]
        assert dist.get_process_group_ranks(pstate.mp_group) == [2, 3, 10, 11]  # no CP peer
        view = pstate.gradient_replicas()
        assert (view.dp_size, view.dp_rank, view.dp_group) == (4, 1, pstate.dp_cp_group)
    finally:
        parallel_state.destroy(pstate)


@pytest.mark.parametrize("flags,world,message", [
    (dict(cp=2), 3, "world size 3 is not divisible by --tensor-model-parallel-size 1 x "
                    "--context-parallel-size 2"),
    (dict(cp=3), 3, "--context-parallel-size 3 needs --seq-length (32) divisible by 2 x 3"),
    (dict(cp=4, tp=2, sequence_parallel=True), 8,
     "--sequence-parallel with --context-parallel-size 4 needs --seq-length (32) divisible by "
     "2 x 4 x --tensor-model-parallel-size 2 = 16"),
    (dict(cp=2, global_batch=3), 4,  # CP ranks share samples: dp = 4 / 2
     "--global-batch-size 3 is not divisible by --micro-batch-size 1 x data-parallel size 2"),
])
def test_impossible_layouts_name_the_flag(flags: dict, world: int, message: str) -> None:
    cfg = make_config(**flags)
    if "global_batch" not in flags and flags.get("cp") == 4:
        cfg.model.seq_length = 40  # divisible by 2 x 4 but not by 2 x 4 x 2
        message = message.replace("(32)", "(40)")
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(cfg, world)


def test_mock_data_refuses_document_flags() -> None:
    cfg = make_config()
    cfg.data.mock_data, cfg.data.reset_attention_mask = True, True
    with pytest.raises(ConfigError, match="--mock-data"):
        build_loaders(cfg, 0, 1)
