"""The Triton kernels run the dense variants unchanged: the qk-norm is the RMSNorm kernel on
each head's d channels (a strided q/k view), RoPE scaling only changes the frequency table,
the q/k/v bias sits outside every kernel. One layer's loss and every gradient with the
kernels on (interpreter on CPU) equal the torch reference within fp32 rounding."""

from __future__ import annotations

import torch

from megatron_lite.config import ModelConfig
from megatron_lite.layers.context import LayerContext
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.parallel.state import single_process_state
from tests.numerics import assert_close

CFG = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=1,
                  kv_channels=12, add_qkv_bias=True, qk_layernorm=True, use_rope_scaling=True,
                  vocab_size=40, padded_vocab=48, ffn_hidden_size=32, seq_length=8)


def _run(device: torch.device, use_triton: bool) -> tuple[torch.Tensor, dict]:
    ctx = LayerContext.from_state(single_process_state(device), seed=1, use_triton=use_triton)
    model = LlamaChunk(CFG, ctx, range(1), pre_process=True, post_process=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # biases and norm gains away from their 0 / 1 init
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + ("norm" in name))
    tokens = torch.randint(0, 40, (2, 9), generator=gen).to(device)
    losses = model(tokens[:, :-1], tokens[:, 1:])
    losses.sum().backward()
    return losses.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


def test_kernels_equal_reference_with_every_variant(device: torch.device) -> None:
    ref_loss, ref_grads = _run(device, use_triton=False)
    loss, grads = _run(device, use_triton=True)
    assert_close(loss, ref_loss, 1e-5, "losses")
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], 1e-4, name)
