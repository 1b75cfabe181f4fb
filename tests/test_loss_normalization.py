"""--calculate-per-token-loss and Megatron's default, with loss masks that differ between
micro-batches (--eod-mask-loss): each mode's loss and gradients equal an independent formula
on one process, the two differ, and DP x CP and PP x DP layouts equal one process in both.

The formulas, written from the micro-batches' per-token losses l and masks m:
  per token: sum(l * m) over the global batch / sum(m) over it;
  default:   mean over the micro-batches of the global batch of sum(l * m) / max(1, sum(m)).
The logged loss is the token mean in both modes (Megatron logs its [sum, count] reduction).
float64 throughout: within EXACT.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_lite.config import Config, ModelConfig, ParallelConfig, TrainConfig
from megatron_lite.data.builder import data_notes
from megatron_lite.data.loader import MicroBatchLoader, SequenceLayout
from megatron_lite.data.mock import MockDataset
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.training import StepRunner, build_model, loss_normalization, reduce_loss
from tests.distributed import relayout, run_ranks
from tests.numerics import EXACT, assert_all_close, assert_close
from tests.optim.common import single_process_name

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=48, seq_length=16, vocab_size=104,
                    make_vocab_size_divisible_by=4, untie_embeddings_and_output_weights=True)
"""Untied, so that no stage holds a copy of another's weight (each gradient lives once)."""
EOD = 0
"""The mock data's most frequent token (Zipf), so the masks vary between micro-batches and
between the CP chunks of one sample."""
GLOBAL_BATCH = 4


def make_config(*, cp: int = 1, pp: int = 1, per_token: bool = False) -> Config:
    return Config(model=replace(MODEL),
                  parallel=ParallelConfig(pipeline_model_parallel_size=pp,
                                          context_parallel_size=cp, distributed_backend="gloo"),
                  train=TrainConfig(micro_batch_size=1, global_batch_size=GLOBAL_BATCH, seed=3,
                                    fp64=True, calculate_per_token_loss=per_token))


def _batches(pstate: ParallelState) -> list[dict[str, torch.Tensor]]:
    loader = MicroBatchLoader(MockDataset(MODEL.vocab_size, MODEL.seq_length, seed=9),
                              micro_batch_size=1, global_batch_size=GLOBAL_BATCH,
                              dp_rank=pstate.dp_rank, dp_size=pstate.dp_size, eod_id=EOD,
                              eod_mask_loss=True,
                              layout=SequenceLayout(pstate.cp_rank, pstate.cp_size))
    return loader.next_step()


def _named_grads(chunks: list) -> dict[str, torch.Tensor]:
    """This rank's gradients under single-process names (global layer numbers)."""
    return {single_process_name(chunk, name): p.grad.clone()
            for chunk in chunks for name, p in chunk.named_parameters()}


def step(pstate: ParallelState, cfg: Config) -> dict:
    """One global batch's logged loss and gradients (summed over DP x CP, as the optimizer's
    reduction does), without an optimizer."""
    chunks = build_model(cfg, pstate)
    batches = _batches(pstate)
    norm = loss_normalization(batches, pstate, cfg.train.calculate_per_token_loss)
    local = StepRunner(cfg, pstate, chunks)(batches, norm)
    grads = {n: comms.all_reduce_(g, pstate.dp_cp_group, kind="dp_cp") if pstate.dp_cp_group else g
             for n, g in _named_grads(chunks).items()}
    return {"loss": reduce_loss(local, pstate), "grads": grads, "dp": pstate.dp_rank,
            "cp": pstate.cp_rank}


def reference(per_token: bool) -> dict:
    """The formula of the module docstring, on one process, with plain autograd."""
    cfg = make_config(per_token=per_token)
    pstate = single_process_state()
    (model,) = build_model(cfg, pstate)
    sums, counts = [], []
    for batch in _batches(pstate):
        losses = model(batch["tokens"], batch["labels"])
        sums.append((losses * batch["loss_mask"]).sum())
        counts.append(batch["loss_mask"].sum().item())
    if per_token:
        objective = torch.stack(sums).sum() / sum(counts)
    else:
        objective = torch.stack([s / max(1.0, c) for s, c in zip(sums, counts)]).mean()
    objective.backward()
    token_mean = (torch.stack(sums).sum() / sum(counts)).item()
    return {"loss": token_mean, "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "counts": counts}


@pytest.fixture(scope="module")
def references() -> dict[bool, dict]:
    return {mode: reference(mode) for mode in (False, True)}


@pytest.mark.quick
def test_each_mode_is_its_formula_and_they_differ(references: dict) -> None:
    assert len(set(references[False]["counts"])) > 1, "the masks must differ between batches"
    for mode in (False, True):
        got = step(single_process_state(), make_config(per_token=mode))
        assert_close(got["loss"], references[mode]["loss"], EXACT, f"per_token={mode} loss")
        assert_all_close(got["grads"], references[mode]["grads"], EXACT,
                         f"per_token={mode} grads")
    a, b = (references[m]["grads"]["embedding.weight"] for m in (False, True))
    assert (a - b).abs().max() > 1e-4 * b.abs().max(), "the two modes should train differently"


LAYOUTS = {"cp2": {"cp": 2}, "dp2": {}, "pp2": {"pp": 2}}
"""Two ranks each (one spawn, then `relayout`): CP counts a micro-batch over its chunks, DP
multiplies by the ranks' micro-batches, PP carries each divisor with its micro-batch."""


def _layouts(pstate: ParallelState) -> dict[str, dict]:
    out = {}
    for name, kw in LAYOUTS.items():
        if name != "cp2":  # the spawned layout
            pstate = relayout(pstate, make_config(**kw))
        out.update({f"{name} per_token={m}": step(pstate, make_config(**kw, per_token=m))
                    for m in (False, True)})
    return out


def test_layouts_equal_one_process_in_both_modes(tmp_path, references: dict) -> None:
    ranks = run_ranks(_layouts, 2, tmp_path, cfg=make_config(cp=2), timeout=300)
    assert len(ranks[0]) == 2 * len(LAYOUTS)
    for key in ranks[0]:
        ref = references[key.endswith("True")]
        for rank in ranks:
            got = rank[key]
            assert_close(got["loss"], ref["loss"], EXACT, f"{key} loss")
            names = [n for n in got["grads"] if n in ref["grads"]]
            assert names, key
            assert_all_close({n: got["grads"][n] for n in names},
                             {n: ref["grads"][n] for n in names}, EXACT, f"{key} grads")


def test_start_up_notes_name_the_surprising_combinations() -> None:
    cfg = Config()
    assert data_notes(cfg) == []
    cfg.data.eod_mask_loss = True
    (note,) = data_notes(cfg)
    assert "--calculate-per-token-loss" in note
    cfg.train.calculate_per_token_loss = True
    cfg.data.reset_attention_mask, cfg.data.create_attention_mask_in_dataloader = True, False
    notes = data_notes(cfg)
    assert len(notes) == 1 and "--reset-attention-mask has no effect" in notes[0]
    cfg.data.reset_position_ids = True
    assert any("--reset-position-ids without" in n for n in data_notes(cfg))
