"""Planner: textbook ZeRO numbers, parameter counts against the real model, activation bytes
against what autograd actually saves, pipeline in-flight counts, and the layout search."""

from __future__ import annotations

import dataclasses
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.arguments import parse_config
from megatron_lite.config import Config, ModelConfig, ParallelConfig, TrainConfig
from megatron_lite.layers import linear
from megatron_lite.layers.context import LayerContext
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState
from megatron_lite.planner import (
    GIB,
    PRESETS,
    SHARDING,
    ActivationSetup,
    Cluster,
    Layout,
    ModelShape,
    Recompute,
    RunOptions,
    chunk_activation_bytes,
    estimate_memory,
    evaluate,
    in_flight,
    largest_unit_params,
    layer_activation_bytes,
    layer_params,
    pretrain_flags,
    search,
    sharding_formula,
    stage_layer_counts,
    stage_params,
    state_bytes,
    total_params,
    training_flops_per_token,
    zero_state_bytes,
)
from tests.distributed import run_ranks


def _pstate(tp: int = 1, pp: int = 1, pp_rank: int = 0) -> ParallelState:
    return ParallelState(rank=0, world_size=tp * pp, local_rank=0, tp_size=tp, tp_rank=0,
                         pp_size=pp, pp_rank=pp_rank, dp_size=1, dp_rank=0,
                         device=torch.device("cpu"), backend=None)


def _tiny(**kw) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                vocab_size=200)
    return ModelConfig(**{**base, **kw})


def test_textbook_zero_stages_7b_on_8():
    """Rajbhandari et al.: 16 bytes/param, stages shard optimizer, then grads, then params."""
    got = [round(zero_state_bytes(7e9, 8, stage) / GIB, 1) for stage in range(4)]
    assert got == [104.3, 35.9, 24.4, 13.0]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_stage_params_match_the_model(tp, pp, tied):
    cfg = _tiny(num_query_groups=2, untie_embeddings_and_output_weights=not tied)
    counts = stage_layer_counts(cfg.num_layers, pp)
    first = 0
    for stage, n_layers in enumerate(counts):
        chunk = LlamaChunk(cfg, LayerContext.from_state(_pstate(tp, pp, stage), seed=0),
                           range(first, first + n_layers),
                           pre_process=stage == 0, post_process=stage == pp - 1)
        first += n_layers
        real = sum(p.numel() for p in {id(p): p for p in chunk.parameters()}.values())
        assert stage_params(cfg, tp, pp, stage, n_layers) == real
    if tp == 1 and pp == 1:
        assert total_params(cfg) == real - (cfg.padded_vocab_size(1) - cfg.vocab_size) * 64 * (
            1 if tied else 2)


def _saved_bytes(module: torch.nn.Module, fn) -> int:
    """Bytes of distinct storages autograd keeps for backward, parameters and buffers excluded."""
    skip = {x.untyped_storage().data_ptr() for x in [*module.parameters(), *module.buffers()]}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    del out
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [4, 2])
def test_activation_formula_matches_saved_tensors(dtype, groups):
    """Reference kernels on CPU: the per-micro-batch estimate equals what autograd saves."""
    model = _tiny(num_query_groups=groups, num_layers=2)
    b = 3
    chunk = LlamaChunk(model, LayerContext.from_state(_pstate(), seed=0, dtype=dtype), range(2),
                       pre_process=True, post_process=True)
    tokens = torch.randint(0, model.vocab_size, (b, model.seq_length))
    measured = _saved_bytes(chunk, lambda: chunk(tokens, tokens).sum())
    cfg = Config(model=model, train=TrainConfig(micro_batch_size=b,
                                                bf16=dtype == torch.bfloat16))
    est = estimate_memory(cfg, 1, fused_kernels=False, device_type="cpu")
    assert est.activation_bytes_per_microbatch == pytest.approx(measured, rel=0.01)


def _gather_then_linear(x: torch.Tensor, weight: torch.Tensor, group: comms.Group,
                        sequence_parallel: bool, weight_grads: object = None) -> torch.Tensor:
    """The column linear before it saved its input shard: autograd keeps the gathered input."""
    assert sequence_parallel and weight_grads is None
    return F.linear(comms.gather_from_sequence_region(x, group, kind="tp"), weight)


def _tp2_sp_saved_as(pstate: ParallelState, b: int, dtype: torch.dtype) -> tuple[int, ...]:
    """Saved bytes at TP=2 with SP: one layer as built, the same layer with the old
    gather-then-F.linear column linears, and a whole chunk with embedding and head."""
    model = _tiny(num_query_groups=2, num_layers=1)
    ctx = LayerContext.from_state(pstate, seed=0, dtype=dtype, sequence_parallel=True)
    layer = LlamaChunk(model, ctx, range(1), pre_process=False, post_process=False)
    x = torch.randn(model.seq_length // pstate.tp_size, b, model.hidden_size, dtype=dtype,
                    requires_grad=True)
    shard = _saved_bytes(layer, lambda: layer(x))
    with mock.patch.object(linear, "column_parallel_linear", _gather_then_linear):
        gathered = _saved_bytes(layer, lambda: layer(x))
    chunk = LlamaChunk(model, ctx, range(1), pre_process=True, post_process=True)
    tokens = torch.randint(0, model.vocab_size, (b, model.seq_length),
                           generator=torch.Generator().manual_seed(0))
    return shard, gathered, _saved_bytes(chunk, lambda: chunk(tokens, tokens).sum())


def _tp2_sp_saved(pstate: ParallelState, b: int) -> dict:
    return {dtype: _tp2_sp_saved_as(pstate, b, dtype) for dtype in (torch.float32, torch.bfloat16)}


def test_tp2_sp_linears_save_the_input_shard(tmp_path):
    """Under SP each column-parallel linear saves its [s/t, b, h] input, not the gathered one:
    2·(t-1)/t·e·sbh less per layer (qkv and gate_up), and the planner says exactly that."""
    model, b, t = _tiny(num_query_groups=2, num_layers=1), 3, 2
    for rank, out in enumerate(run_ranks(_tp2_sp_saved, t, tmp_path, tp=t, b=b)):
        for dtype, (shard, gathered, whole) in out.items():
            bf16 = dtype == torch.bfloat16
            e = 2 if bf16 else 4
            sbh = model.seq_length * b * model.hidden_size
            assert gathered - shard == 2 * (t - 1) * e * sbh // t, (rank, dtype)
            a = ActivationSetup(b, t, sequence_parallel=True, bf16=bf16, fused_kernels=False,
                                fp32_attention_core=bf16)
            assert layer_activation_bytes(model, a) == pytest.approx(shard, rel=1e-9)
            cfg = Config(model=model,
                         parallel=ParallelConfig(tensor_model_parallel_size=t,
                                                 sequence_parallel=True),
                         train=TrainConfig(micro_batch_size=b, bf16=bf16))
            est = estimate_memory(cfg, t, fused_kernels=False, device_type="cpu")
            assert est.activation_bytes_per_microbatch == pytest.approx(whole, rel=1e-9)


def test_70b_tp8_sequence_parallel_layer_bytes():
    """Korthikanti et al.: SP shards everything outside the TP region, so a 70B layer at TP8
    saves ~0.4x what it saves without SP (it was ~0.7x while the linears saved the gathered
    input)."""
    m = dataclasses.replace(PRESETS["70B"][1], seq_length=4096)
    sp, no_sp = (layer_activation_bytes(m, ActivationSetup(1, 8, sequence_parallel=on))
                 for on in (True, False))
    assert sp / no_sp == pytest.approx(0.39, abs=0.01)


def test_selective_and_full_recompute_bytes():
    m = _tiny(num_layers=8, seq_length=256)
    a = ActivationSetup(micro_batch=2, bf16=True)
    none, _ = chunk_activation_bytes(m, a, 8, Recompute())
    sel, _ = chunk_activation_bytes(m, a, 8, Recompute("selective"))
    e, sbh = 2, 256 * 2 * 64
    # selective drops rotated q, k (MHA: 2 sbh) and the fp32 log-sum-exp per head and row
    assert none - sel == pytest.approx(8 * (2 * e * sbh + 4 * 4 * 256 * 2))
    for n in (1, 3, 8):
        full, peak = chunk_activation_bytes(m, a, 8, Recompute("full", "uniform", n))
        assert full == math.ceil(8 / n) * e * sbh
        assert peak == n * layer_activation_bytes(m, a)
    block, _ = chunk_activation_bytes(m, a, 8, Recompute("full", "block", 3))
    assert block == 3 * e * sbh + 5 * layer_activation_bytes(m, a)


def test_in_flight_counts_and_interleaving_penalty():
    assert [in_flight(4, s, 1, 8) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight(4, 0, 1, 2) == 2
    # Megatron's theoretical memory: first stage holds L/p layers x p micro-batches x
    # (1 + (p - 1) / (p v)) when interleaved
    for p, v in [(2, 2), (4, 2), (4, 3), (8, 5)]:
        layers_per_chunk = 1
        held = in_flight(p, 0, v, 64) * layers_per_chunk
        assert held == pytest.approx(v * p * (1 + (p - 1) / (p * v)))


def test_estimate_memory_follows_the_config_layout():
    """bf16 is 2 + 4 + 12 bytes/param; ZeRO-1 shards master + m + v over dp, ZeRO-2 also the
    fp32 gradient (and the full-buffer accumulation adds a bf16 full-size gradient)."""
    model = _tiny(num_layers=8)
    for sharding, accumulation in (("no_shard", None), ("optim", None), ("optim_grads", None),
                                   ("optim_grads", "full-buffer")):
        cfg = Config(model=model,
                     parallel=ParallelConfig(tensor_model_parallel_size=2,
                                             pipeline_model_parallel_size=2,
                                             data_parallel_sharding_strategy=sharding,
                                             sharded_grad_accumulation=accumulation
                                             or "reduce-scatter"),
                     train=TrainConfig(micro_batch_size=2, global_batch_size=16, bf16=True))
        est = estimate_memory(cfg, 16, stage=0)
        n, owned = stage_params(model, 2, 2, 0, 4), math.ceil(stage_params(model, 2, 2, 0, 4) / 4)
        assert est.params == n
        grads = {"no_shard": 4 * n, "optim": 4 * n, "optim_grads": 4 * owned}[sharding]
        grads += 2 * n if accumulation else 0
        assert est.state_bytes == 2 * n + grads + 12 * (owned if sharding != "no_shard" else n)
        assert est.in_flight == 2


def test_zero3_holds_18_over_d_plus_gathered_units():
    """Between steps 2 + 4 + 12 bytes over d; during the step, on top of the activations,
    the gathered units in bf16 (tied: at least the embedding and the head's norm) and fp32
    gradient buckets, counted at the step's moments: less than all of them at once
    (tests/optim/test_zero3_memory.py, test_zero3_peak_moments.py)."""
    model = _tiny(num_layers=8)

    def estimate(sharding: str):
        cfg = Config(model=model, parallel=ParallelConfig(
            tensor_model_parallel_size=2, data_parallel_sharding_strategy=sharding),
            train=TrainConfig(micro_batch_size=2, global_batch_size=16, bf16=True))
        return estimate_memory(cfg, 16)

    est, zero2 = estimate("optim_grads_params"), estimate("optim_grads")
    owned = math.ceil(stage_params(model, 2, 1, 0, 8) / 8)
    unit = largest_unit_params(model, 2)
    assert unit == max(layer_params(model, 2), model.padded_vocab_size(2) * 32 // 2 + 32)
    assert (est.param_bytes, est.grad_bytes, est.optimizer_bytes) == (
        2 * owned, 4 * owned, 12 * owned)
    vocab, layer = model.padded_vocab_size(2) * 64 // 2, layer_params(model, 2)
    zero3_more = est.activation_bytes - zero2.activation_bytes
    assert 2 * (vocab + 64) <= zero3_more < 2 * (vocab + 64 + 2 * layer) + 3 * 4 * max(vocab, layer)


def test_8b_on_256_gpus_sharding_arithmetic():
    """The issue's example: 8B parameters, textbook 2 + 2 + 8 bytes = 16 + 16 + 64 = 96 GB,
    0.37 GB per GPU fully sharded over 256; ours at DP=64 (bf16 params, fp32 grads, fp32
    master + Adam): ZeRO-1 2 + 4 + 12/64 = 6.19 B/param ~ 50 GB, ZeRO-2 2 + 16/64 = 2.25,
    ZeRO-3 18/64 = 0.28 (plus one gathered unit)."""
    n = 8_000_000_000
    assert zero_state_bytes(n, 1, 0, 2, 2, 8) / 1e9 == 96
    assert round(zero_state_bytes(n, 256, 3, 2, 2, 8) / 1e9, 2) == 0.38  # 0.375
    per_param = {s: sum(state_bytes(n, 64, s, bf16=True)) / n for s in SHARDING}
    assert per_param == pytest.approx({"no_shard": 18, "optim": 6.1875, "optim_grads": 2.25,
                                       "optim_grads_params": 0.28125})
    assert sum(state_bytes(n, 64, "optim", bf16=True)) / 1e9 == pytest.approx(49.5)
    for s in SHARDING:
        assert sharding_formula(s, 64)[1] == pytest.approx(per_param[s])
    assert sharding_formula("optim_grads", 64)[0] == "2 + 16/d"
    assert sharding_formula("optim", 64)[0] == "2 + 4 + 12/d"
    assert sharding_formula("optim_grads_params", 64)[0] == "18/d + unit"


def test_search_considers_every_sharding_strategy():
    """8B at 8 x 40 GB: only ZeRO-2/3 leave room for activations at TP=1 (no sharding would
    need 18 B/param = 144 GB); ZeRO-3 is never offered with PP."""
    model = PRESETS["8B"][1]
    plans = search(model, Cluster(gpus=8, gpu_memory_gib=40), 64, 1e9,
                   keep=lambda lay: lay.tp == 1)
    fitting = {p.layout.sharding for p in plans if p.fits and p.layout.pp == 1}
    assert fitting and fitting <= {"optim_grads", "optim_grads_params"}
    assert all(p.layout.sharding != "optim_grads_params" for p in plans if p.layout.pp > 1)
    flags = pretrain_flags(model, next(p for p in plans if p.fits), 64)
    assert parse_config(flags).parallel.data_parallel_sharding_strategy in fitting


@pytest.mark.quick
def test_70b_on_1024_h100_tp8_pp8_dp16():
    model = PRESETS["70B"][1]
    lay = Layout(tp=8, pp=8, dp=16, chunks=1, micro_batch=1, sharding="optim",
                 recompute=Recompute(), sequence_parallel=True)
    plan = evaluate(model, lay, Cluster(gpus=1024), 512, 15e12)
    assert plan.fits, plan.reason
    n = plan.memory.params
    assert n == stage_params(model, 8, 8, plan.memory.stage, 10)
    assert plan.memory.state_bytes == 2 * n + 4 * n + 12 * math.ceil(n / 16)
    microbatches = 512 // 16
    assert plan.bubble_s / (plan.step_s - plan.dp_exposed_s - plan.optimizer_s) == \
        pytest.approx(7 / (microbatches + 7))
    best = search(model, Cluster(gpus=1024), 512, 15e12,
                  keep=lambda lay: (lay.tp, lay.pp, lay.dp) == (8, 8, 16))[0]
    assert best.fits and best.tokens_per_s >= plan.tokens_per_s


def test_plan_flops_are_the_shared_count_at_the_layout_tp():
    """The output layer computes logits over the vocabulary padded for TP, in the planner's
    FLOPs as in the log's; MFU is tokens/s x those FLOPs over the cluster's peak."""
    model = PRESETS["8B"][1]
    cluster = Cluster(gpus=8)
    for tp in (1, 8):
        lay = Layout(tp=tp, pp=1, dp=8 // tp, chunks=1, micro_batch=1, sharding="optim",
                     recompute=Recompute(), sequence_parallel=tp > 1)
        plan = evaluate(model, lay, cluster, 64, 1e9)
        shape = ModelShape.from_config(model, tp)
        assert plan.flops_per_token == training_flops_per_token(shape, model.seq_length,
                                                                causal=True)
        assert plan.mfu == pytest.approx(plan.tokens_per_s * plan.flops_per_token
                                         / (8 * cluster.peak_tflops * 1e12))
    assert ModelShape.from_config(model, 8).vocab == 129024 > model.vocab_size


def test_search_marks_oom_and_emits_parseable_flags():
    model = PRESETS["8B"][1]
    tiny_gpu = Cluster(gpus=8, gpu_memory_gib=16)
    plans = search(model, tiny_gpu, 64, 1e9)
    assert not any(p.fits for p in plans)
    assert "needs" in plans[0].reason
    plans = search(model, Cluster(gpus=8), 64, 1e9)
    best = plans[0]
    assert best.fits and all(p.tokens_per_s <= best.tokens_per_s for p in plans if p.fits)
    flags = pretrain_flags(model, best, 64)
    cfg = parse_config(flags)
    assert cfg.parallel.tensor_model_parallel_size == best.layout.tp
    assert cfg.train.global_batch_size == 64
    est = estimate_memory(dataclasses.replace(cfg), 8)
    assert est.state_bytes == best.memory.state_bytes


def test_cli_prints_a_table(capsys):
    import scripts.plan as plan_cli

    assert plan_cli.main(["--preset", "1B", "--gpus", "16", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "fitting layouts" in out and "--tensor-model-parallel-size" in out


def test_search_with_fp8_counts_what_pretrain_would() -> None:
    """The layout search under FP8 flags (scripts/plan.py --fp8-format ...): its best plan's
    memory is `estimate_memory` of the pretrain.py flags it prints (FP8 saved bytes, the e4m3
    weight copies, the amax histories: 16 layers x 6 x 3 x (1024 + 1) x 4 bytes), and the FP8
    plan of the same layout saves fewer activation bytes than the bf16 one."""
    import scripts.plan as plan_cli

    model = PRESETS["1B"][1]
    fp8 = TrainConfig(bf16=True, fp8_format="hybrid", fp8_amax_history_len=1024,
                      fp8_param_gather=True)
    cluster = Cluster(gpus=8)
    best = search(model, cluster, 64, 1e9, opts=RunOptions(fp8=fp8))[0]
    cfg = parse_config(pretrain_flags(model, best, 64) + plan_cli.fp8_flags(fp8))
    est = estimate_memory(cfg, 8)
    assert est.fp8_state_bytes == best.memory.fp8_state_bytes == 16 * 6 * 3 * 1025 * 4
    assert est.total_bytes == best.memory.total_bytes
    plain = evaluate(model, best.layout, cluster, 64, 1e9)
    assert best.memory.activation_bytes < plain.memory.activation_bytes
    assert best.step_s == plain.step_s  # the time model keeps bf16 GEMMs
