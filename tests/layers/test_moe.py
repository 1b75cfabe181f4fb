"""The MoE layer and its router against references written here a different way.

The layer (sorted tokens, grouped GEMMs, index_add) is checked in float64 against a loop over
tokens and their chosen experts, for each routing variant; the losses against the formulas as
the papers write them (fractions f_i and mean probabilities P_i); the grouped-GEMM path against
the padded-bmm path in fp32 and bf16.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config import ModelConfig, MoEConfig
from megatron_lite.layers.context import LayerContext
from megatron_lite.layers.moe import MoE, grouped_matmul, grouped_mm_fits, padded_bmm
from megatron_lite.layers.router import Router, stand_in_counts
from megatron_lite.parallel.state import single_process_state
from tests.numerics import EXACT, assert_close

H, F_MOE, E = 16, 12, 8
MODEL = ModelConfig(num_layers=2, hidden_size=H, ffn_hidden_size=F_MOE, num_attention_heads=2)
VARIANTS = {
    "softmax": dict(),
    "pre-softmax-top1": dict(moe_router_topk=1, moe_router_pre_softmax=True),
    "sigmoid-groups-scaled": dict(moe_router_score_function="sigmoid", moe_router_num_groups=4,
                                  moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                                  moe_router_enable_expert_bias=True),
    "shared": dict(moe_shared_expert_intermediate_size=8),
    "shared-gated": dict(moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True),
    "capacity-probs": dict(moe_expert_capacity_factor=0.5),
    "capacity-position-padded": dict(moe_expert_capacity_factor=0.75,
                                     moe_token_drop_policy="position",
                                     moe_pad_expert_input_to_capacity=True),
}


def _choose(logits: list[float], moe: MoEConfig, bias: list[float]) -> list[tuple[int, float]]:
    """One token's (expert, weight) pairs, from its logits, by the rules in plain Python."""
    k = moe.moe_router_topk
    if moe.moe_router_score_function == "sigmoid":
        scores = [1 / (1 + math.exp(-v)) for v in logits]
    elif moe.moe_router_pre_softmax:
        total = sum(math.exp(v) for v in logits)
        scores = [math.exp(v) / total for v in logits]
    else:
        scores = list(logits)
    ranked = [s + b for s, b in zip(scores, bias, strict=True)]
    allowed = range(len(logits))
    if moe.moe_router_group_topk:
        size = len(logits) // moe.moe_router_num_groups
        per = k // moe.moe_router_group_topk
        group_score = [sum(sorted(ranked[g * size:(g + 1) * size])[-per:])
                       for g in range(moe.moe_router_num_groups)]
        best = sorted(range(len(group_score)), key=lambda g: -group_score[g])
        allowed = [e for g in best[:moe.moe_router_group_topk] for e in range(g * size,
                                                                              (g + 1) * size)]
    chosen = sorted(allowed, key=lambda e: -ranked[e])[:k]
    if moe.moe_router_score_function == "softmax" and not moe.moe_router_pre_softmax:
        total = sum(math.exp(logits[e]) for e in chosen)
        weights = [math.exp(logits[e]) / total for e in chosen]
    else:
        weights = [scores[e] for e in chosen]
        if moe.moe_router_score_function == "sigmoid" and k > 1:
            weights = [w / sum(weights) for w in weights]
    factor = moe.moe_router_topk_scaling_factor or 1.0
    return [(e, w * factor) for e, w in zip(chosen, weights, strict=True)]


def _apply_capacity(pairs: list[list[tuple[int, float]]], moe: MoEConfig
                    ) -> list[list[tuple[int, float]]]:
    """Per expert, keep `capacity` of its tokens (by weight or by position); padding adds
    weight-zero tokens, which change nothing in the output."""
    if moe.moe_expert_capacity_factor is None:
        return pairs
    tokens = len(pairs)
    capacity = math.ceil(tokens * moe.moe_router_topk * moe.moe_expert_capacity_factor / E)
    kept: list[list[tuple[int, float]]] = [[] for _ in pairs]
    for e in range(E):
        users = [(t, w) for t, row in enumerate(pairs) for x, w in row if x == e]
        if moe.moe_token_drop_policy == "probs":
            users = sorted(users, key=lambda tw: -tw[1])
        for t, w in users[:capacity]:
            kept[t].append((e, w))
    return kept


def _reference(layer: MoE, x: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """Loop over tokens and their experts: sum_e w_e x down_e(silu(gate_e x) * up_e x)."""
    flat = x.reshape(-1, H)
    logits = flat @ layer.router.weight.t()
    bias = (layer.router.expert_bias.tolist() if layer.router.expert_bias is not None
            else [0.0] * E)
    pairs = _apply_capacity([_choose(row.tolist(), moe, bias) for row in logits], moe)
    out = torch.zeros_like(flat)
    f = F_MOE
    for t, row in enumerate(pairs):
        for e, w in row:
            gate = layer.gate_up[2 * f * e:2 * f * e + f] @ flat[t]
            up = layer.gate_up[2 * f * e + f:2 * f * (e + 1)] @ flat[t]
            out[t] += w * (layer.down[H * e:H * (e + 1)] @ (F.silu(gate) * up))
    if layer.shared is not None:
        gate, up = (layer.shared.gate_up.weight @ flat.t()).chunk(2, dim=0)
        shared = (layer.shared.down.weight @ (F.silu(gate) * up)).t()
        if moe.moe_shared_expert_gate:  # sigmoid(x . g), one scalar per token
            shared = shared / (1 + torch.exp(-(flat * layer.shared_gate[0]).sum(-1, True)))
        out += shared
    return out.view_as(x)


@pytest.mark.quick
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layer_equals_per_token_loop_float64(variant: str) -> None:
    moe = MoEConfig(num_experts=E, **VARIANTS[variant])
    layer = MoE(MODEL, moe, LayerContext.from_state(single_process_state(), seed=3,
                                                    dtype=torch.float64), 0)
    if layer.router.expert_bias is not None:  # a bias that changes the choice of some tokens
        layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, E))
    x = torch.randn(6, 2, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(layer(x), _reference(layer, x, moe), EXACT, variant)


def test_grouped_mm_equals_padded_bmm() -> None:
    """The grouped GEMM path (fp32, bf16) against the padded bmm (uneven and empty groups),
    forward and both gradients. fp32: 1e-6 relative (summation order only); bf16: 1e-2 (one
    bf16 rounding of each output, ~4e-3)."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 9, 2])
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = torch.randn(16, 32, generator=gen).to(dtype).requires_grad_()
        w = torch.randn(4, 24, 32, generator=gen).to(dtype).transpose(1, 2).requires_grad_()
        assert grouped_mm_fits(x, w)
        got = grouped_matmul(x, w, counts)
        got.sum().backward()  # an expanded gradient: the path must make it contiguous
        grads = x.grad.clone(), w.grad.clone()
        x.grad = w.grad = None
        ref = padded_bmm(x, w, counts)
        ref.sum().backward()
        assert_close(got, ref, tol, f"{dtype} output")
        assert_close(grads[0], x.grad, tol, f"{dtype} dx")
        assert_close(grads[1], w.grad, tol, f"{dtype} dw")


def _switch(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Switch loss as the paper writes it: E x sum_i f_i P_i, f_i the fraction of the T x k
    choices (plain top-k of the scores) that go to i, P_i the mean score of i."""
    tokens, experts = scores.shape
    chosen = scores.argsort(dim=-1, descending=True)[:, :k]
    f = torch.stack([(chosen == i).sum() for i in range(experts)]).to(scores.dtype) / (tokens * k)
    return experts * (f * scores.mean(0)).sum()


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_router_losses_and_their_gradient_scale(kind: str) -> None:
    """The aux and z losses' values, and the router gradient they add: `loss_scale` x d(coeff
    x loss)/dW, from an independent autograd of the formulas."""
    seq, batch, k = 5, 3, 2
    moe = MoEConfig(num_experts=E, moe_router_topk=k, moe_router_load_balancing_type=kind,
                    moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01,
                    moe_router_score_function="sigmoid")
    router = Router(H, moe, LayerContext.from_state(single_process_state(), seed=2,
                                                    dtype=torch.float64), std=0.5, name="r")
    router.loss_scale = 0.25
    x = torch.randn(seq * batch, H, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(4))
    probs, _ = router(x, seq)
    (probs * 0).sum().backward()
    w = router.weight.detach().clone().requires_grad_()
    logits = x @ w.t()
    scores = torch.sigmoid(logits)
    scores = scores / scores.sum(-1, keepdim=True)
    if kind == "aux_loss":
        aux = _switch(scores, k)
    else:  # tokens are sequence-major: sequence b is every batch-th row from b
        aux = sum(_switch(scores[b::batch], k) for b in range(batch)) / batch
    z = (torch.log(torch.exp(logits).sum(-1)) ** 2).mean()
    assert_close(router.stats.aux_loss, aux, EXACT, "aux loss")
    assert_close(router.stats.z_loss, z, EXACT, "z loss")
    (0.25 * (0.1 * aux + 0.01 * z)).backward()
    assert_close(router.weight.grad, w.grad, EXACT, "router gradient")


@pytest.mark.quick
def test_dry_run_stand_in_counts_are_skewed_seeded_and_capped() -> None:
    """The meta stand-in's counts: top-k pairs per token over distinct experts, one expert
    empty, counts not all multiples of 16 and far from even; the same per seed, another
    seed another draw; capacity caps them (or, padded, fills every expert to it)."""
    moe = MoEConfig(num_experts=8, moe_router_topk=2)
    counts = stand_in_counts(4097, moe, 5)
    assert sum(counts) == 4097 * 2 and max(counts) <= 4097 and 0 in counts
    assert any(c % 16 for c in counts) and max(counts) > 1.5 * 4097 * 2 / 8
    assert counts == stand_in_counts(4097, moe, 5) != stand_in_counts(4097, moe, 6)
    capped = MoEConfig(num_experts=8, moe_router_topk=2, moe_expert_capacity_factor=1.0)
    capacity = math.ceil(4097 * 2 / 8)
    assert stand_in_counts(4097, capped, 5) == tuple(min(c, capacity) for c in counts)
    padded = replace(capped, moe_pad_expert_input_to_capacity=True)
    assert stand_in_counts(4097, padded, 5) == (capacity,) * 8
