"""Document masking end to end: loader (document_layout, CP split) -> model (RoPE positions,
attention masks, ring) -> per-token losses.

A packed sample of k documents must give every token the loss it has when its document runs
alone (positions from 0, nothing before it to attend to), with and without CP; switching the
flags off must change the loss (the documents then see each other). float64 on both sides:
within EXACT (worst observed 5e-17).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.data.loader import SequenceLayout, to_batch
from megatron_lite.layers.context import BatchContext, LayerContext
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.parallel.state import ParallelState, single_process_state
from tests.distributed import relayout, run_ranks
from tests.numerics import assert_close
from tests.parallel.test_context_parallel import make_config

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=48, seq_length=32, vocab_size=104,
                    make_vocab_size_divisible_by=4)
EOD = 103
LENGTHS = ([10, 13, 10], [5, 20, 8])
"""Two samples of 33 tokens (32 inputs + the last label), three documents each, every
document ending with EOD; the two rows cut in different places."""


def samples() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    out = []
    for lengths in LENGTHS:
        docs = [np.append(rng.integers(0, EOD, n - 1), EOD) for n in lengths]
        out.append(np.concatenate(docs).astype(np.int64))
    return out


def model(pstate: ParallelState) -> LlamaChunk:
    torch.manual_seed(0)
    ctx = LayerContext.from_state(pstate, seed=1, dtype=torch.float64)
    return LlamaChunk(replace(MODEL), ctx, range(MODEL.num_layers), pre_process=True,
                      post_process=True)


def packed_losses(pstate: ParallelState, documents: bool = True) -> dict:
    """Per-token losses of this rank's tokens of the packed batch (and where they sit)."""
    layout = SequenceLayout(pstate.cp_rank, pstate.cp_size, reset_position_ids=documents,
                            reset_attention_mask=documents)
    batch = to_batch(samples(), EOD, eod_mask_loss=False, layout=layout)
    chunk = model(pstate)
    sequence = {k: batch[k] for k in ("token_index", "positions", "documents") if k in batch}
    with torch.no_grad():
        losses = chunk(batch["tokens"], batch["labels"], BatchContext.of(sequence))
    index = batch.get("token_index", torch.arange(MODEL.seq_length))
    return {"losses": losses, "index": index, "batch": batch}


def separate_losses() -> torch.Tensor:
    """Each document alone, as its own sequence: [b, s] losses put back in packed order."""
    chunk = model(single_process_state())
    out = torch.zeros(len(LENGTHS), MODEL.seq_length, dtype=torch.float64)
    for row, (sample, lengths) in enumerate(zip(samples(), LENGTHS, strict=True)):
        start = 0
        for n in lengths:
            end = min(start + n, MODEL.seq_length)
            tokens = torch.from_numpy(sample[start:end])[None]
            labels = torch.from_numpy(sample[start + 1:end + 1])[None]
            with torch.no_grad():
                out[row, start:end] = chunk(tokens, labels)[0]
            start = end
    return out


def assemble(ranks: list[dict]) -> torch.Tensor:
    full = torch.zeros(len(LENGTHS), MODEL.seq_length, dtype=torch.float64)
    for r in ranks:
        full[:, r["index"]] = r["losses"]
    return full


def test_positions_restart_and_documents_count_eods() -> None:
    batch = packed_losses(single_process_state())["batch"]
    first = torch.cat([torch.arange(10), torch.arange(13), torch.arange(9)])
    assert torch.equal(batch["positions"][0], first)
    assert batch["documents"][1].tolist() == [0] * 5 + [1] * 20 + [2] * 7


@pytest.mark.quick
def test_packed_documents_equal_documents_run_separately() -> None:
    alone = separate_losses()
    packed = packed_losses(single_process_state())["losses"]
    assert packed.dtype == torch.float64
    err = assert_close(packed, alone, what="packed losses")
    print(f"packed vs separate documents: relative error {err:.1e}")
    plain = packed_losses(single_process_state(), documents=False)["losses"]
    # without the flags later documents see earlier ones: their losses change
    assert (plain[:, 12:] - alone[:, 12:]).abs().max().item() > 1e-3
    assert abs(plain.mean().item() - packed.mean().item()) > 1e-4


def _both_sizes(pstate: ParallelState) -> dict[int, dict]:
    """CP=2 (x DP=2) and CP=4 in one 4-rank job."""
    out = {}
    for cp in (2, 4):
        pstate = relayout(pstate, make_config(cp=cp))
        out[cp] = packed_losses(pstate)
    return out


def test_packed_documents_under_context_parallelism(tmp_path) -> None:
    alone = separate_losses()
    ranks = run_ranks(_both_sizes, 4, tmp_path, cfg=make_config(cp=4))
    for cp in (2, 4):
        for first in range(0, 4, cp):  # CP=2: both DP replicas (the same samples)
            got = assemble([r[cp] for r in ranks[first:first + cp]])
            err = assert_close(got, alone, what=f"CP={cp} packed losses")
            print(f"CP={cp} packed vs separate documents: relative error {err:.1e}")
