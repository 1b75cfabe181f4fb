"""Activation recomputation: same loss and gradients as storing everything (float64, within
EXACT: recomputing reruns the same kernels on the same inputs, observed 0), fewer saved
bytes."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.config import Config, ModelConfig, TrainConfig
from megatron_lite.layers.context import LayerContext
from megatron_lite.memory import measure_saved_bytes
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.parallel.state import single_process_state
from tests.numerics import assert_all_close, assert_close

SHAPE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=64, seq_length=16, vocab_size=64)
OPTIONS = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=2),
    "full-block-1": dict(recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=1),
}


def _model(option: str, num_layers: int = 4, dtype: torch.dtype = torch.float32
           ) -> LlamaChunk:
    cfg = ModelConfig(**{**SHAPE, "num_layers": num_layers})
    ctx = LayerContext.from_state(single_process_state(), seed=3, dtype=dtype, **OPTIONS[option])
    return LlamaChunk(cfg, ctx, range(num_layers), pre_process=True, post_process=True)


def _loss_and_grads(option: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = _model(option, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 17), generator=g)
    loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("option", [pytest.param("selective", marks=pytest.mark.quick),
                                    "full-uniform-2", "full-block-1"])
def test_recompute_matches_no_recompute(option: str) -> None:
    ref_loss, ref_grads = _loss_and_grads("none")
    loss, grads = _loss_and_grads(option)
    assert loss.dtype == torch.float64
    assert_close(loss, ref_loss, what="loss")
    assert_all_close(grads, ref_grads, what=f"{option}: ")


def _saved(option: str, num_layers: int = 4) -> int:
    cfg = Config(model=ModelConfig(**{**SHAPE, "num_layers": num_layers}),
                 train=TrainConfig(micro_batch_size=2))
    return measure_saved_bytes([_model(option, num_layers)], cfg, single_process_state())


def test_saved_bytes_fall_as_expected() -> None:
    """Full recompute keeps exactly one [s, b, h] input per checkpointed group."""
    for n in (1, 4):
        OPTIONS[f"full-uniform-{n}"] = dict(recompute_granularity="full",
                                            recompute_method="uniform", recompute_num_layers=n)
    none, selective = _saved("none"), _saved("selective")
    full1, full2, full4 = (_saved(f"full-uniform-{n}") for n in (1, 2, 4))
    sbh_bytes = SHAPE["seq_length"] * 2 * SHAPE["hidden_size"] * 4  # fp32
    assert full1 - full2 == 2 * sbh_bytes  # 4 groups vs 2 groups
    assert full2 - full4 == sbh_bytes  # 2 groups vs 1 group
    head = full4 - sbh_bytes  # embedding + head, which are never recomputed
    per_layer_none = (none - head) / 4
    print(f"saved bytes per layer: none {per_layer_none:.0f}, full {sbh_bytes} "
          f"(x{per_layer_none / sbh_bytes:.1f} less), selective {(selective - head) / 4:.0f}")
    assert per_layer_none > 8 * sbh_bytes
    assert selective < none
