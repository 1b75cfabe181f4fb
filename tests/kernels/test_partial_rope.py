"""Partial RoPE (--rotary-percent, Megatron's meaning): the first int(d x percent) channels of
each head turn with frequencies spaced over that width, the rest pass through untouched.

Checked against the rotation written out pair by pair in float64 (not through rope_tables),
on the torch path and the Triton kernel (CUDA, or Triton's interpreter on CPU); 1.0 gives the
same model as before the flag existed; export refuses it and import refuses a
`partial_rotary_factor` (transformers' Llama rotates the whole head).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lite.arguments import parse_config
from megatron_lite.checkpoint.files import CheckpointError
from megatron_lite.config import ConfigError, ModelConfig, validate
from megatron_lite.export import check_exportable, model_config_from_hf
from megatron_lite.kernels.rope import apply_rotary, rope_tables
from megatron_lite.layers.context import LayerContext
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.parallel.state import single_process_state
from tests.numerics import EXACT


def _pairwise_rope(x: torch.Tensor, rot: int, base: float) -> torch.Tensor:
    """x [s, b, n, d] float64: channel j < rot/2 pairs with j + rot/2 and turns by position
    p times base^(-2j/rot); channels >= rot are copied."""
    out = x.clone()
    half = rot // 2
    for p in range(x.shape[0]):
        for j in range(half):
            angle = p * base ** (-2 * j / rot)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[p, ..., j], x[p, ..., j + half]
            out[p, ..., j], out[p, ..., j + half] = a * c - b * s, b * c + a * s
    return out


@pytest.mark.quick
@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_half_the_head_turns_as_the_formula_says(use_triton, device) -> None:
    gen = torch.Generator().manual_seed(3)
    s, b, d, base = 5, 2, 16, 500.0
    rot = ModelConfig(hidden_size=64, num_attention_heads=4, rotary_percent=0.5).rotary_dim
    assert rot == 8
    q = torch.randn(s, b, 4, d, generator=gen, dtype=torch.float64)
    k = torch.randn(s, b, 2, d, generator=gen, dtype=torch.float64)
    cos, sin = rope_tables(s, rot, base, device, dtype=torch.float64)
    dtype = torch.float32 if use_triton else torch.float64  # the kernel has no float64
    got_q, got_k = apply_rotary(q.to(device, dtype), k.to(device, dtype), cos.to(dtype),
                                sin.to(dtype), use_triton=use_triton)
    tol = 1e-6 if use_triton else EXACT
    for got, x in ((got_q, q), (got_k, k)):
        want = _pairwise_rope(x, rot, base)
        torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=tol)
        assert torch.equal(got[..., rot:].cpu(), x[..., rot:].to(dtype))  # untouched, bit for bit
        assert not torch.allclose(got[1:, ..., :rot].double().cpu(), x[1:, ..., :rot])


def test_full_percent_is_the_model_without_the_flag() -> None:
    """--rotary-percent 1.0 builds the same tables and losses as the default; 0.5 differs."""
    pstate = single_process_state(torch.device("cpu"))
    flags = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
             "--seq-length", "8", "--fp64"]
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    losses = {}
    for percent in (None, "1.0", "0.5"):
        cfg = parse_config([*flags, *(["--rotary-percent", percent] if percent else [])]).model
        torch.manual_seed(0)
        chunk = LlamaChunk(cfg, LayerContext.from_state(pstate, seed=0, dtype=torch.float64),
                           list(range(cfg.num_layers)), pre_process=True, post_process=True)
        losses[percent] = chunk(tokens, tokens.roll(-1, 1)).detach()
    assert torch.equal(losses[None], losses["1.0"])
    assert not torch.allclose(losses[None], losses["0.5"])


def test_odd_rotary_width_and_export_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"--rotary-percent 0.3 of head dim 10 rotates 3 "):
        validate(parse_config(["--hidden-size", "40", "--num-attention-heads", "4",
                               "--rotary-percent", "0.3"]), 1)
    with pytest.raises(ConfigError, match=r"--rotary-percent must be in \(0, 1\]"):
        ModelConfig(rotary_percent=0.0)
    with pytest.raises(ConfigError, match=r"--rotary-percent 0\.5: transformers' LlamaForCausalLM"):
        check_exportable(ModelConfig(rotary_percent=0.5))
    check_exportable(ModelConfig())
    hf = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
          "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 97,
          "partial_rotary_factor": 0.5}
    with pytest.raises(CheckpointError, match=r"partial_rotary_factor=0\.5"):
        model_config_from_hf(hf)
