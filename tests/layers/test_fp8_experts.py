"""FP8 in the MoE experts' grouped GEMMs (layers/fp8.py `scaled_grouped_mm`,
`Fp8GroupedLinear`): the CPU emulation equals a per-expert loop of torch._scaled_mm bit for
bit, the FP8 MoE layer stays within FP8's error of the plain one, and EP2 with FP8 experts
layer equals one process."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_lite.arguments import parse_config
from megatron_lite.config import Config, MoEConfig, ParallelConfig
from megatron_lite.layers.context import LayerContext
from megatron_lite.layers.fp8 import (
    Fp8GroupedLinear,
    Fp8Recipe,
    pad_groups,
    quantize_per_group,
    quantize_rowwise,
    scaled_grouped_mm,
)
from megatron_lite.layers.moe import MoE
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.training import build_model
from tests.distributed import relayout, run_ranks
from tests.layers.test_moe import MODEL as BF16_MODEL
from tests.layers.test_moe_training import FLAGS
from tests.numerics import assert_close

MODEL = dataclasses.replace(BF16_MODEL, ffn_hidden_size=32)
"""Expert widths CUDA's FP8 grouped GEMMs take (16-byte rows, also per TP2 shard)."""
COUNTS = torch.tensor([5, 3, 9, 7])
"""Uneven groups (every group non-empty: torch._scaled_mm refuses an empty operand)."""


@pytest.mark.quick
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_grouped_emulation_is_per_expert_scaled_mm(out_dtype: torch.dtype) -> None:
    """Both forms the experts use, rowwise scales: x [M, K] @ w [G, K, N] (forward, input
    gradient) and x^T [K, M] @ g [M, N] with the groups along M (weight gradient)."""
    gen = torch.Generator().manual_seed(0)
    rows, (k, n) = int(COUNTS.sum()), (32, 48)
    offs = COUNTS.cumsum(0).to(torch.int32)
    x8, x_inv = quantize_rowwise(torch.randn(rows, k, generator=gen) * 3, 1)
    w8, w_inv = quantize_rowwise(torch.randn(4, k, n, generator=gen), 1)
    got = scaled_grouped_mm(x8, w8, x_inv.view(-1), w_inv.squeeze(1), offs, out_dtype)
    starts = [0, *offs.tolist()[:-1]]
    for g, (lo, hi) in enumerate(zip(starts, offs.tolist(), strict=True)):
        want = torch._scaled_mm(x8[lo:hi], w8[g], scale_a=x_inv[lo:hi],
                                scale_b=w_inv[g], out_dtype=out_dtype)
        assert torch.equal(got[lo:hi], want), g
    xp, padded = pad_groups(torch.randn(rows, k, generator=gen), COUNTS)  # CUDA-aligned
    xg8, xg_inv = quantize_per_group(xp, padded)
    gg8, gg_inv = quantize_per_group(pad_groups(torch.randn(rows, n, generator=gen) * 1e-3,
                                                COUNTS)[0], padded)
    offs = padded.cumsum(0).to(torch.int32)
    starts = [0, *offs.tolist()[:-1]]
    got = scaled_grouped_mm(xg8.t(), gg8, xg_inv.view(-1), gg_inv.view(-1), offs, out_dtype)
    for g, (lo, hi) in enumerate(zip(starts, offs.tolist(), strict=True)):
        want = torch._scaled_mm(xg8[lo:hi].t(), gg8[lo:hi], scale_a=xg_inv[g][:, None],
                                scale_b=gg_inv[g][None], out_dtype=out_dtype)
        assert torch.equal(got[g], want), g


def _wgrad_operands(counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, 32] and grad [M, 48] for groups of `counts` rows, and the counts."""
    gen = torch.Generator().manual_seed(2)
    rows = sum(counts)
    return (torch.randn(rows, 32, generator=gen), torch.randn(rows, 48, generator=gen),
            torch.tensor(counts))


@pytest.mark.quick
@pytest.mark.parametrize("counts", [[40, 0, 33, 27], [1500, 0, 1, 2596], [48, 0, 16, 32]])
def test_cpu_weight_gradient_refuses_what_cuda_refuses(counts: list[int]) -> None:
    """100 and 4,097 rows (and groups not at multiples of 16) are what CUDA's weight-gradient
    grouped GEMM refuses; 96 rows in groups of 16s pass. The CPU emulation says the same."""
    x, g, c = _wgrad_operands(counts)
    xg8, xg_inv = quantize_per_group(x, c)
    gg8, gg_inv = quantize_per_group(g, c)
    offs = c.cumsum(0).to(torch.int32)

    def wgrad() -> torch.Tensor:
        return scaled_grouped_mm(xg8.t(), gg8, xg_inv.view(-1), gg_inv.view(-1), offs,
                                 torch.float32)

    if sum(counts) == 96:
        assert wgrad().shape == (4, 32, 48)
    else:
        with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
            wgrad()


@pytest.mark.quick
@pytest.mark.parametrize("counts", [[40, 0, 33, 27], [1500, 0, 1, 2596]])
def test_padded_grouped_linear_equals_unpadded_reference(counts: list[int]) -> None:
    """`Fp8GroupedLinear` at 100 and 4,097 rows with an empty expert: its weight gradient
    (zero rows padded to CUDA's alignment) equals the unpadded per-expert GEMMs of the same
    e4m3 operands (zero rows change neither a group's scale nor its sums); the empty
    expert's gradient is zero."""
    x, g, c = _wgrad_operands(counts)
    w = torch.randn(4, 32, 48, generator=torch.Generator().manual_seed(3)).requires_grad_()
    out = Fp8GroupedLinear.apply(x, w, c, 0, None, None)
    out.backward(g)
    xg8, xg_inv = quantize_per_group(x, c)
    gg8, gg_inv = quantize_per_group(g, c)
    for e, (xs, gs) in enumerate(zip(xg8.split(counts), gg8.split(counts), strict=True)):
        want = (xs.float() * xg_inv[e]).t() @ (gs.float() * gg_inv[e])
        assert_close(w.grad[e], want, 1e-6, f"expert {e}")
    assert out.shape == (sum(counts), 48) and not w.grad[1].any()


def _layer_grads(fp8: Fp8Recipe | None) -> list[torch.Tensor]:
    """A bf16 MoE layer (8 experts, top-2) on fixed input: its output, dx and the experts'
    weight gradients."""
    ctx = LayerContext.from_state(single_process_state(), seed=3, dtype=torch.bfloat16,
                                  fp8=fp8)
    layer = MoE(MODEL, MoEConfig(num_experts=8), ctx, 0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 2, MODEL.hidden_size, generator=gen).bfloat16().requires_grad_()
    out = layer(x)
    out.backward(torch.randn(out.shape, generator=gen).bfloat16())
    return [out, x.grad, layer.gate_up.grad, layer.down.grad]


def test_fp8_moe_layer_within_fp8_error_of_bf16() -> None:
    """The FP8 layer's output and gradients against the bf16 layer's, relative Frobenius error.
    Each e4m3 operand is off by at most 2^-4 relative (3 mantissa bits, rowwise scaled so no
    row falls far into the subnormals), so one GEMM is off by <= 2^-3 and a chain of two
    (gate/up then down, or their backward) by ~2^-2 in the worst case; random rounding errors
    add in quadrature, so the norm error is a fraction of that. Tolerance 0.1. Measured: out
    0.052, dx 0.060, d gate_up 0.053, d down 0.046 (ffn 32); the bf16 layer against an fp32 one is
    0.006, so the lower bound 0.02 says the FP8 path ran and the check sees its rounding."""
    ref, got = _layer_grads(None), _layer_grads(Fp8Recipe("hybrid"))
    errors = [((a.float() - b.float()).norm() / b.float().norm()).item()
              for a, b in zip(got, ref, strict=True)]
    assert all(0.02 < e < 0.1 for e in errors), errors


def _moe_run(pstate: ParallelState, seqs: slice, dispatcher: str = "alltoall"
             ) -> list[torch.Tensor]:
    """An fp32 FP8 MoE layer (4 experts) on sequences `seqs` of a fixed batch, with a fixed
    output gradient: output, dx, the experts' weight gradients."""
    moe = MoEConfig(num_experts=4, expert_model_parallel_size=pstate.ep_size,
                    moe_token_dispatcher_type=dispatcher, moe_router_load_balancing_type="none")
    ctx = LayerContext.from_state(pstate, seed=3, fp8=Fp8Recipe("hybrid"), moe=moe)
    layer = MoE(MODEL, moe, ctx, 0)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 4, MODEL.hidden_size, generator=gen)[:, seqs].requires_grad_()
    out = layer(x)
    out.backward(torch.randn(8, 4, MODEL.hidden_size, generator=gen)[:, seqs])
    return [out.detach(), x.grad, layer.gate_up.grad, layer.down.grad]


ALL = slice(None)


def _layouts(world: ParallelState) -> dict[str, list[torch.Tensor]]:
    """EP2 (each rank two of the four sequences, as DP splits them; both dispatchers), TP2."""
    pstate = relayout(world, Config(moe=MoEConfig(num_experts=4, expert_model_parallel_size=2)))
    mine = slice(2 * pstate.rank, 2 * pstate.rank + 2)
    runs = {d: _moe_run(pstate, mine, d) for d in ("alltoall", "allgather")}
    pstate = relayout(world, Config(parallel=ParallelConfig(tensor_model_parallel_size=2)))
    runs["tp2"] = _moe_run(pstate, ALL)[:2]
    return runs


def test_ep2_and_tp2_fp8_experts_equal_one_process(tmp_path: Path) -> None:
    """fp32 + FP8 experts: EP2 (alltoall, allgather) and TP2 against one process on all the
    tokens, output, dx and the experts' weight gradients within 1e-5 relative. Each scale is
    per token row (amax over the row, reduced over TP where the row is sharded) or per expert
    (over all of that expert's tokens, which EP brings to one rank), so no layout changes a
    scale; what is left is the fp32 sums' order. Measured: EP2 output and dx bit-identical,
    weight gradients 7.6e-8; TP2 9e-8 / 1.4e-7. Planted: without the TP amax reductions TP2's
    output is off by 2.4e-2; one scale per micro-batch for the weight gradient (instead of per
    expert) puts EP2's gate/up gradient off by 3.1e-2."""
    ref = _moe_run(single_process_state(), ALL)
    ranks = run_ranks(_layouts, 2, tmp_path)
    for d in ("alltoall", "allgather"):
        out = torch.cat([r[d][0] for r in ranks], dim=1)
        dx = torch.cat([r[d][1] for r in ranks], dim=1)
        gate_up = torch.cat([r[d][2] for r in ranks])
        down = torch.cat([r[d][3] for r in ranks])
        for name, a, b in zip(("out", "dx", "gate_up", "down"), (out, dx, gate_up, down), ref,
                              strict=True):
            assert_close(a, b, 1e-5, f"{d} {name}")
    for name, a, b in zip(("out", "dx"), ranks[0]["tp2"], ref[:2], strict=True):
        assert_close(a, b, 1e-5, f"tp2 {name}")


def test_first_last_bf16_layers_keep_their_experts_out_of_fp8() -> None:
    """--first-last-layers-bf16 (1 + 1 of 4 MoE layers): only layers 1 and 2 run FP8 experts."""
    flags = [a for a in FLAGS if a != "--fp64"]
    cfg = parse_config([*flags, "--moe-layer-freq", "1", "--fp8-format", "e4m3",
                        "--fp8-recipe", "tensorwise", "--first-last-layers-bf16"])
    chunk = build_model(cfg, single_process_state())[0]
    assert [layer.mlp.fp8 is not None for layer in chunk.layers] == [False, True, True, False]
