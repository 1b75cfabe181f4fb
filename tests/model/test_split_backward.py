"""B/W split in the model (one process): a chunk built with `split_backward` gives plain
autograd's input and weight gradients (float64, within EXACT: the same products, summed the
same way, observed 0), with the weight part only in the W step."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.config import ModelConfig
from megatron_lite.layers.context import LayerContext
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.parallel.state import single_process_state
from tests.numerics import assert_all_close, assert_close

MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=48, seq_length=8, vocab_size=61, make_vocab_size_divisible_by=4)


def _chunks(pre: bool, post: bool, **opts) -> tuple[LlamaChunk, LlamaChunk]:
    cfg, pstate = ModelConfig(**MODEL), single_process_state()
    return tuple(LlamaChunk(cfg, LayerContext.from_state(pstate, seed=3, split_backward=split,
                                                         dtype=torch.float64, **opts),
                            range(2), pre_process=pre, post_process=post)
                 for split in (False, True))


def _inputs(pre: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, MODEL["vocab_size"], (2, 8), generator=g)
    if pre:
        return torch.randint(0, MODEL["vocab_size"], (2, 8), generator=g), labels
    return torch.randn(8, 2, 32, generator=g, dtype=torch.float64).requires_grad_(), labels


@pytest.mark.parametrize(("pre", "post"), [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_b_then_w_equals_one_backward(pre: bool, post: bool, recompute: str | None) -> None:
    plain, split = _chunks(pre, post, recompute_granularity=recompute)
    arrivals: dict[str, int] = {}
    for name, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: arrivals.__setitem__(name, arrivals.get(name, 0) + 1))
    x, labels = _inputs(pre)
    grads = []
    for chunk in (plain, split):
        xi = x.detach().clone().requires_grad_(x.requires_grad)
        out = chunk(xi, labels if post else None)
        seed = (torch.ones_like(out) if post
                else torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                              dtype=out.dtype))
        if chunk is split:
            with split.weight_grads.recording(0):
                out.backward(seed)
            deferred = set(map(id, split.weight_grads.params.values()))
            # B: the input gradient and the norms' gradients only
            assert {n for n, p in split.named_parameters() if p.grad is not None} == {
                n for n, p in split.named_parameters() if id(p) not in deferred}
            params, weight_grads = zip(*split.weight_grads.pop(0))
            torch.autograd.backward(params, weight_grads)
            assert split.weight_grads.pending() == []
        else:
            out.backward(seed)
        grads.append(({n: p.grad for n, p in chunk.named_parameters()}, xi.grad))
    (ref, ref_x), (got, got_x) = grads
    assert sorted(ref) == sorted(got)
    assert_all_close(got, ref)
    if not pre:
        assert_close(got_x, ref_x, what="input gradient")
    # one gradient arrival per weight and micro-batch (a tied embedding and head: still one)
    assert set(arrivals.values()) == {1} and len(arrivals) == len(ref)


def test_backward_outside_a_b_step_is_refused() -> None:
    _, split = _chunks(True, True)
    x, labels = _inputs(True)
    with pytest.raises(RuntimeError, match="outside the pipeline engine's B step"):
        split(x, labels).sum().backward()


def test_plain_chunk_has_no_queue() -> None:
    plain, _ = _chunks(True, True)
    assert plain.weight_grads is None
