"""FP8 GEMMs (layers/fp8.py): the CPU emulation is torch._scaled_mm bit for bit, each format's
error stays within what rounding to it implies, training with --fp8-format hybrid tracks bf16,
and TP=2 + SP scales every operand as one process does."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.config import ConfigError, validate
from megatron_lite.layers import fp8
from megatron_lite.layers.fp8 import fp8_matmul, quantize, scaled_mm
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.training import StepRunner, build_model, global_token_count
from tests.distributed import run_ranks
from tests.numerics import assert_all_close
from tests.optim.common import full_params, make_config, step_batches, train_ours

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(16, 32, 24), (8, 48, 16), (32, 64, 32)]


@pytest.mark.quick
@pytest.mark.parametrize("a_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_emulation_is_scaled_mm_bit_for_bit(a_dtype: torch.dtype, out_dtype: torch.dtype
                                            ) -> None:
    """Tensorwise (0-dim) and rowwise ([m, 1] x [1, n]) inverse scales: the emulation that
    trains on the CPU equals torch._scaled_mm, the op the CUDA path calls, exactly."""
    g = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        a8, a_inv = quantize(torch.randn(m, k, generator=g) * 3, a_dtype)
        b8, b_inv = quantize(torch.randn(n, k, generator=g), E4M3)
        rows, cols = torch.rand(m, 1, generator=g) + 0.5, torch.rand(1, n, generator=g) + 0.5
        for sa, sb in ((a_inv, b_inv), (rows, cols)):
            want = torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
            got = scaled_mm(a8, b8.t(), sa, sb, out_dtype)
            assert torch.equal(got, want), (m, k, n, sa.shape)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_gemm_error_within_what_fp8_implies(fmt: torch.dtype) -> None:
    """fp8_matmul of bf16 operands (a in `fmt`, b in e4m3: the forward's and hybrid's
    gradient GEMMs) against their exact float64 product. Rounding an element of a tensor
    scaled to the format's max moves it by at most u|x| (u = 2^-4 for e4m3's 3 mantissa bits,
    2^-3 for e5m2's 2) or, in the subnormal range, half a subnormal step over the scale; so
    elementwise |C8 - C| <= Ea|B| + |A|Eb + Ea Eb, plus the bf16 output's 2^-8|C| and the fp32
    sums' k 2^-23 |A||B|. Measured worst element / bound: e4m3 0.16, e5m2 0.14, while the bf16
    GEMM's own error is 0.012 / 0.006 of it: the test sees FP8's error, not bf16's."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    b = torch.randn(96, 48, generator=g).to(torch.bfloat16)
    exact = a.double() @ b.double()

    def element_bound(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        fi, mantissa = torch.finfo(dtype), 3 if dtype == E4M3 else 2
        subnormal_step = fi.smallest_normal * 2.0 ** -mantissa
        xd = x.double().abs()
        return 2.0 ** -(mantissa + 1) * xd + 0.5 * subnormal_step * xd.max() / fi.max

    ea, eb = element_bound(a, fmt), element_bound(b, E4M3)
    ad, bd = a.double().abs(), b.double().abs()
    bound = (ea @ bd + ad @ eb + ea @ eb + 2.0 ** -8 * exact.abs()
             + 96 * 2.0 ** -23 * (ad @ bd))
    got = fp8_matmul(a, b, fmt, E4M3).double()
    assert ((got - exact).abs() <= bound).all()
    fp8_ratio = ((got - exact).abs() / bound).max().item()
    bf16_ratio = (((a @ b).double() - exact).abs() / bound).max().item()
    assert fp8_ratio > 5 * bf16_ratio, (fp8_ratio, bf16_ratio)


def _train_fixed_batch(fp8_format: str | None, steps: int, recipe: str = "tensorwise"
                       ) -> list[float]:
    """`steps` AdamW steps of the tiny bf16 model on one batch (so the loss falls fast)."""
    cfg = make_config(bf16=True, lr=3e-3)
    cfg.optim.clip_grad = 1.0
    cfg.train.fp8_format, cfg.train.fp8_recipe = fp8_format, recipe
    cfg.train.fp8_amax_history_len, cfg.train.fp8_amax_compute_algo = 4, "max"
    pstate = single_process_state()
    chunks = build_model(cfg, pstate)
    opt = Optimizer(cfg, chunks, pstate)
    runner = StepRunner(cfg, pstate, chunks)
    batches = step_batches(0, 0, 1, micro=1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(runner(batches, global_token_count(batches, pstate)).item())
        opt.finalize_grads()
        opt.step(cfg.optim.lr)
    return losses


def test_hybrid_training_tracks_bf16() -> None:
    """30 steps on one batch: the hybrid run's loss falls like the bf16 run's and ends within
    2% of it, with current (tensorwise) and with delayed scaling (history 4, max). Measured:
    bf16 4.648 -> 1.749, hybrid 4.649 -> 1.758 (+0.5%), e4m3 1.756; delayed hybrid 1.757."""
    bf16 = _train_fixed_batch(None, 30)
    hybrid = _train_fixed_batch("hybrid", 30)
    delayed = _train_fixed_batch("hybrid", 30, "delayed")
    for run in (hybrid, delayed):
        assert run[-1] < 0.8 * run[0]
        assert abs(run[-1] - bf16[-1]) <= 0.02 * bf16[-1], (run[-1], bf16[-1])
    assert hybrid != bf16 and delayed != hybrid  # the FP8 paths ran, and differ


def _fp8_config(tp: int, recipe: str = "tensorwise"):
    """fp32 + FP8 hybrid under `recipe`, with SP at TP > 1."""
    cfg = make_config(tp=tp, fp64=False, sequence_parallel=tp > 1)
    cfg.train.fp8_format, cfg.train.fp8_recipe = "hybrid", recipe
    return cfg


def _tp2(pstate: ParallelState) -> dict:
    return train_ours(pstate, _fp8_config(2), 3)


def test_tp2_sp_fp8_equals_one_process(tmp_path) -> None:
    """fp32 + FP8 hybrid, 3 steps: TP=2 with SP lands on one FP8 process's weights within
    5e-3 relative per weight. Measured: 1e-7 for most weights, 8.5e-4 for one (TP's split
    fp32 sums move a value across an fp8 rounding boundary now and then, and Adam turns the
    flip into an lr-sized step); plain fp32 TP=2 vs one process: 3e-5. With each rank scaling
    its own shards (no amax reduction over TP) the weights differ by 0.1-0.23: 40x the
    tolerance."""
    ranks = run_ranks(_tp2, 2, tmp_path, tp=2)
    ref = train_ours(single_process_state(), _fp8_config(1), 3)
    assert_all_close(full_params(ranks, tp=2), ref["params"], 5e-3)


@pytest.mark.parametrize("name", ["mxfp8", "blockwise"])
def test_refused_recipes_name_the_flag(name: str) -> None:
    cfg = make_config(fp64=False)
    cfg.train.fp8_format, cfg.train.fp8_recipe = "hybrid", name
    with pytest.raises(ConfigError, match=f"--fp8-recipe {name}"):
        validate(cfg, 1)


def test_fp8_format_alone_validates_with_megatrons_delayed_default() -> None:
    cfg = make_config(fp64=False)
    cfg.train.fp8_format = "hybrid"  # recipe left at Megatron's default, delayed
    validate(cfg, 1)
    assert cfg.train.fp8_recipe == "delayed"


def test_first_last_layers_stay_out_of_fp8() -> None:
    """--first-last-layers-bf16 with 1 at the start and 2 at the end of 4 layers: layers 0, 2
    and 3 build plain linears, layer 1 FP8 ones; the output layer is never FP8."""
    cfg = make_config(fp64=False)
    cfg.model.num_layers = 4
    cfg.train.fp8_format, cfg.train.fp8_recipe = "e4m3", "tensorwise"
    cfg.train.first_last_layers_bf16, cfg.train.num_layers_at_end_in_bf16 = True, 2
    chunk = build_model(cfg, single_process_state())[0]
    in_fp8 = [layer.attention.qkv.fp8 is not None and layer.mlp.down.fp8 is not None
              for layer in chunk.layers]
    assert in_fp8 == [False, True, False, False]


def _sp_gather_both_ways(pstate: ParallelState) -> dict:
    """One column-parallel FP8 GEMM on this rank's sequence shard, both ways: the fp8
    all-gather (quantize the shard with the whole input's scale, gather the bytes) and the
    bf16 gather followed by quantizing the whole input."""
    from megatron_lite.layers.fp8 import Fp8Groups, Fp8Linear, Fp8Recipe
    from megatron_lite.parallel import comms
    group, rank = pstate.tp_group, pstate.tp_rank
    g = torch.Generator().manual_seed(7)
    x_full = (torch.randn(8, 2, 32, generator=g) * torch.linspace(0.1, 4, 8)[:, None, None]
              ).to(torch.bfloat16)
    weight = torch.randn(2, 12, 32, generator=g)[rank].to(torch.bfloat16)
    grad = torch.randn(2, 8, 2, 12, generator=g)[rank].to(torch.bfloat16)
    recipe = Fp8Recipe("hybrid")
    out = {}
    for way in ("fp8_gather", "gather_first"):
        x = x_full.chunk(2)[rank].clone().requires_grad_()
        w = weight.clone().requires_grad_()
        if way == "fp8_gather":
            y = Fp8Linear.apply(x, w, recipe, Fp8Groups(weight=group, grad=group,
                                                        sequence=group))
        else:
            y = Fp8Linear.apply(comms.gather_from_sequence_region(x, group, kind="tp"), w, recipe,
                                Fp8Groups(weight=group, grad=group))
        y.backward(grad)
        out[way] = (y.detach(), x.grad, w.grad)
    return out


def test_sp_input_gathered_in_fp8_is_bit_identical(tmp_path) -> None:
    """TP=2 + SP: gathering the input's fp8 bytes (scale from the amax MAX-reduced over TP,
    the shards' amaxes differ by 10x here) gives the same output, input gradient and weight
    gradient as gathering bf16 and quantizing after, torch.equal on each rank. Planted bug:
    quantizing each shard with its own amax makes every one of the three differ."""
    ranks = run_ranks(_sp_gather_both_ways, 2, tmp_path, tp=2)
    for rank in ranks:
        for got, want in zip(rank["fp8_gather"], rank["gather_first"]):
            assert torch.equal(got, want)


@pytest.mark.quick
def test_meta_tensors_take_the_cuda_calls() -> None:
    """The rank dry run's meta tensors go through torch._scaled_mm and
    torch._scaled_grouped_mm (their meta kernels refuse the layouts CUDA refuses, e.g. a
    row-major second operand), with the output shapes the CPU emulation gives."""
    meta = torch.device("meta")
    a8 = torch.empty(32, 64, device=meta, dtype=torch.float8_e4m3fn)
    b8 = torch.empty(64, 48, device=meta, dtype=torch.float8_e4m3fn)  # row-major: transposed
    one = torch.empty((), device=meta)
    out = fp8.scaled_mm(a8, b8, one, one, torch.bfloat16)
    assert out.shape == (32, 48) and out.dtype == torch.bfloat16 and out.is_meta
    with pytest.raises(RuntimeError, match="col_major"):
        torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    offs = torch.tensor([16, 32], dtype=torch.int32, device=meta)
    w8 = torch.empty(2, 64, 48, device=meta, dtype=torch.float8_e4m3fn)
    grouped = fp8.scaled_grouped_mm(a8, w8, torch.empty(32, device=meta),
                                    torch.empty(2, 48, device=meta), offs, torch.bfloat16)
    assert grouped.shape == (32, 48)
    wgrad = fp8.scaled_grouped_mm(a8.t(), torch.empty(32, 48, device=meta,
                                                      dtype=torch.float8_e4m3fn),
                                  torch.empty(2 * 64, device=meta),
                                  torch.empty(2 * 48, device=meta), offs, torch.float32)
    assert wgrad.shape == (2, 64, 48) and wgrad.dtype == torch.float32  # bf16 op, widened
