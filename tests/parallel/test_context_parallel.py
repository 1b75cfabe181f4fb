"""Context parallelism against one process: the same samples, split over CP ranks (with TP,
SP, PP, DP and ZeRO-1 around it), give the same loss, gradients and 10-step training.

Every run reads its batches through `MicroBatchLoader` from the same mock samples, so the
loader's CP split (each CP rank of a DP rank takes its two chunks of the same samples) is
part of what is checked. fp32 throughout.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_lite.config import Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from megatron_lite.data.loader import MicroBatchLoader, SequenceLayout, context_parallel_index
from megatron_lite.data.mock import MockDataset
from megatron_lite.layers import tags
from megatron_lite.layers.attention import zigzag_token_index
from megatron_lite.layers.init import unshard
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.training import (
    StepRunner,
    build_model,
    global_token_count,
    reduce_loss,
    train_step,
)
from tests.distributed import run_ranks
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
                                    seed=7))


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
        grads[name] = comms.all_reduce_(p.grad.clone(), pstate.cp_group)
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
    opt.close()
    params = model_parameters(chunks)
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


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def test_loader_index_is_the_attention_zigzag() -> None:
    for size in (1, 2, 4):
        for rank in range(size):
            assert torch.equal(context_parallel_index(32, size, rank),
                               zigzag_token_index(32, size, rank))
    whole = torch.cat([context_parallel_index(32, 4, r) for r in range(4)])
    assert torch.equal(whole.sort().values, torch.arange(32))


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_loss_and_grads_equal_one_process(tmp_path, cp: int) -> None:
    ref = loss_and_grads(single_process_state(), make_config())
    ranks = run_ranks(loss_and_grads, cp, tmp_path, cfg=make_config(cp=cp),
                      config=make_config(cp=cp))
    for r in ranks:
        assert abs(r["loss"] - ref["loss"]) <= 1e-5
        for name, g in ref["grads"].items():
            err = (r["grads"][name] - g).abs().max().item()
            assert err <= 1e-5, f"{name}: {err:.2e}"


LAYOUTS = {
    "cp2": (2, dict(cp=2)),
    "cp4": (4, dict(cp=4)),
    "tp2-cp2-sp": (4, dict(tp=2, cp=2, sequence_parallel=True)),
    "cp2-pp2-interleaved": (4, dict(cp=2, pp=2, num_layers_per_virtual_pipeline_stage=1)),
    "cp2-dp2-zero1-overlap": (4, dict(cp=2, use_distributed_optimizer=True,
                                      overlap_grad_reduce=True, ddp_bucket_size=2000)),
}


@pytest.fixture(scope="module")
def reference() -> dict:
    return train(single_process_state(), make_config())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ten_steps_equal_one_process(tmp_path, reference: dict, layout: str) -> None:
    world, sizes = LAYOUTS[layout]
    cfg = make_config(**sizes)
    ranks = run_ranks(train, world, tmp_path, cfg=cfg, config=cfg, timeout=300)
    losses = torch.tensor(ranks[0]["losses"])
    expected = torch.tensor(reference["losses"])
    assert (losses - expected).abs().max().item() <= 1e-5, (losses - expected).abs().max()
    assert losses[-1] < losses[0] - 0.1  # it trains
    got = full_params(ranks)
    for name, ref in reference["params"].items():
        err = rel_err(got[name], ref)
        assert err <= 1e-4, f"{name}: relative error {err:.2e}"
