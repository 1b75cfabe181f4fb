"""The dense variants (--kv-channels, --add-qkv-bias, --qk-layernorm, --use-rope-scaling,
--rotary-percent, --padded-vocab-size, --group-query-attention) all on at once: TP=2 with SP,
PP=2 (ZB-H1, whose W steps defer the weight gradients but not the biases') and CP=2 train to
the same losses and grad norms as one process (float64, EXACT); the planner's parameter counts equal
the built model's and the meta-device dry run's; the Llama 3.1 frequency table equals
Megatron's piecewise rule written out here; bad combinations are refused naming the flags.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_lite.arguments import parse_config
from megatron_lite.config import Config, ConfigError, ModelConfig, ParallelConfig, validate
from megatron_lite.dry_run import run_rank
from megatron_lite.kernels.rope import llama3_scaled_frequencies, rope_tables
from megatron_lite.layers.context import LayerContext
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.parallel.audit import match
from megatron_lite.parallel.state import ParallelState
from megatron_lite.planner import (
    ModelShape,
    layer_params,
    stage_params,
    total_params,
    training_flops_per_token,
    variant_flags,
)
from tests.distributed import relayout, run_ranks
from tests.test_pretrain import FLAGS, Run, _train_logged, assert_same_run, single_process_run

# hidden 32 / 4 heads would give d = 8: --kv-channels 12 makes q 48 wide, kv 24.
VARIANTS = ["--kv-channels", "12", "--group-query-attention", "--num-query-groups", "2",
            "--add-qkv-bias", "--qk-layernorm", "--use-rope-scaling", "--rope-scaling-factor",
            "32", "--padded-vocab-size", "112", "--rotary-base", "100", "--rotary-percent",
            "0.5"]
RUN = [*FLAGS, *VARIANTS, "--train-iters", "2"]
# name: (layout flags, tp, pp, cp) on 2 ranks
LAYOUTS = {"tp2-sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, 1, 1),
           "pp2-zb-h1": (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"],
                         1, 2, 1),
           "cp2": (["--context-parallel-size", "2"], 1, 1, 2)}


def _layouts(world: ParallelState, log_dir: Path) -> dict[str, Run]:
    out = {}
    for name, (flags, tp, pp, cp) in LAYOUTS.items():
        pstate = relayout(world, Config(parallel=ParallelConfig(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            context_parallel_size=cp)))
        out[name] = _train_logged(pstate, [*RUN, *flags], log_dir / f"{name}.jsonl")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Run]]:
    tmp = tmp_path_factory.mktemp("variants")
    per_rank = run_ranks(_layouts, 2, tmp, timeout=280, log_dir=tmp)
    return {name: [rank[name] for rank in per_rank] for name in LAYOUTS}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_trains_as_one_process(runs: dict, layout: str) -> None:
    single = single_process_run(tuple(RUN))
    for run in runs[layout]:
        if run.losses:  # the last stage's ranks report losses
            assert_same_run(run, single, steps=2, evals=0)
    assert single.losses[-1] < single.losses[0]


def _model(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=12,
                group_query_attention=True, num_query_groups=2, add_qkv_bias=True,
                qk_layernorm=True, use_rope_scaling=True, vocab_size=97, padded_vocab=112,
                ffn_hidden_size=48, seq_length=16)
    return ModelConfig(**{**base, **kw})


def _pstate(tp: int, tp_rank: int = 0) -> ParallelState:
    return ParallelState(rank=tp_rank, world_size=tp, local_rank=tp_rank, tp_size=tp,
                         tp_rank=tp_rank, pp_size=1, pp_rank=0, dp_size=1, dp_rank=0,
                         device=torch.device("cpu"), backend=None)


@pytest.mark.quick
@pytest.mark.parametrize("tp", [1, 2])
def test_planner_counts_the_built_parameters(tp: int) -> None:
    """Biases ((4 + 2·2)·12 = 96 per layer, split over TP), q/k norms (2·12, whole on every
    rank) and the 12-wide heads, against the parameters the model really builds."""
    cfg = _model()
    chunk = LlamaChunk(cfg, LayerContext.from_state(_pstate(tp), seed=0), range(2),
                       pre_process=True, post_process=True)
    built = sum(p.numel() for p in {id(p): p for p in chunk.parameters()}.values())
    assert stage_params(cfg, tp, 1, 0, 2) == built
    per_layer = 32 * (48 + 2 * 24) + 48 * 32 + 3 * 32 * 48  # qkv, proj, gate/up/down
    assert layer_params(cfg, tp) == 2 * 32 + 2 * 12 + (per_layer + 96) // tp
    if tp == 1:
        assert total_params(cfg) == built - (112 - 97) * 32  # pad rows are not parameters
        # FLOPs: 6 x matmul weights (the output layer over the 112 rows) + 12·l·(heads·d)·s
        assert training_flops_per_token(ModelShape.from_config(cfg), 16) == (
            6 * (2 * per_layer + 112 * 32) + 12 * 2 * 48 * 16)


def test_dry_run_ranks_match_and_hold_what_the_planner_says() -> None:
    """TP=2 with SP on the meta device: both ranks' collectives line up and their parameter
    bytes are the planner's, up to the gradient buffer's alignment padding (the exact count
    is the test above)."""
    fp32 = [f for f in FLAGS if f != "--fp64"]  # the planner prices fp32 or bf16 runs
    cfg = parse_config([*fp32, *VARIANTS, "--dry-run", "--tensor-model-parallel-size", "2",
                        "--sequence-parallel"])
    results = {r: run_rank(cfg, 2, r, time_host=False) for r in range(2)}
    assert match({r: res.ops for r, res in results.items()}) is None
    for res in results.values():
        assert 0 <= res.params_bytes - res.planner_params_bytes < 0.05 * res.params_bytes


def _megatron_llama3(freqs: torch.Tensor, factor: float) -> torch.Tensor:
    """Megatron's rule as written there: three bands by wavelength, linear in between."""
    low, high, context = 1.0, 4.0, 8192
    wavelen = 2 * math.pi / freqs
    out = torch.where(wavelen > context / low, freqs / factor, freqs)
    smooth = (context / wavelen - low) / (high - low)
    mixed = (1 - smooth) * out / factor + smooth * out
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, mixed, out)


def test_llama3_frequencies_follow_megatron_rule() -> None:
    freqs = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    scaled = llama3_scaled_frequencies(freqs, 8.0)
    assert torch.allclose(scaled, _megatron_llama3(freqs, 8.0), rtol=1e-14, atol=0)
    wavelen = 2 * math.pi / freqs
    assert torch.equal(scaled[wavelen < 2048], freqs[wavelen < 2048])  # all three bands occur
    assert torch.equal(scaled[wavelen > 8192], freqs[wavelen > 8192] / 8)
    assert ((wavelen > 2048) & (wavelen < 8192)).any()
    cos, _ = rope_tables(4, 128, 500000.0, "cpu", torch.float64, scaling_factor=8.0)
    assert torch.allclose(cos[3, :64], torch.cos(3 * scaled), rtol=0, atol=1e-15)


def _errors(argv: list[str], world: int = 2) -> str:
    cfg = parse_config(argv)
    with pytest.raises(ConfigError) as err:
        validate(cfg, world)
    return str(err.value)


def test_megatron_meaning_and_refusals() -> None:
    # Megatron: --group-query-attention alone means one KV group (its default), not MHA
    assert parse_config(["--group-query-attention"]).model.num_query_groups == 1
    assert parse_config(["--num-attention-heads", "8"]).model.num_query_groups == 8
    # a head dim that is not hidden/heads, even where heads do not divide the width
    cfg = parse_config(["--hidden-size", "60", "--num-attention-heads", "8", "--kv-channels",
                        "16"])
    validate(cfg, 1)
    assert cfg.model.head_dim == 16
    assert "--kv-channels" in _errors(["--hidden-size", "60", "--num-attention-heads", "8"], 1)
    assert "--kv-channels" in _errors(["--kv-channels", "7"], 1)
    assert "--padded-vocab-size 100 is not divisible by --tensor-model-parallel-size 8" in (
        _errors(["--vocab-size", "97", "--padded-vocab-size", "100",
                 "--tensor-model-parallel-size", "8", "--num-attention-heads", "8",
                 "--num-query-groups", "8"], 8))
    assert "--padded-vocab-size 64 is smaller than the vocabulary (97" in _errors(
        ["--vocab-size", "97", "--padded-vocab-size", "64"], 1)
    with pytest.raises(ConfigError, match="--rope-scaling-factor"):
        parse_config(["--use-rope-scaling", "--rope-scaling-factor", "0"])
    # --padded-vocab-size replaces the rounding: the rows are exactly the given count
    rows = parse_config(["--vocab-size", "97", "--padded-vocab-size", "112"]).model
    assert rows.padded_vocab_size(1) == rows.padded_vocab_size(2) == 112  # not 128 or 256


def test_planner_flags_give_back_the_variants() -> None:
    """What `scripts/plan.py` prints for a Qwen3-4B-like model builds that model again."""
    model = ModelConfig(num_layers=36, hidden_size=2560, num_attention_heads=32,
                        group_query_attention=True, num_query_groups=8, kv_channels=128,
                        qk_layernorm=True, ffn_hidden_size=9728, seq_length=4096,
                        vocab_size=151643, padded_vocab=151936, use_rope_scaling=True,
                        rope_scaling_factor=32.0, add_qkv_bias=True)
    shape = ["--num-layers", "36", "--hidden-size", "2560", "--num-attention-heads", "32",
             "--num-query-groups", "8", "--ffn-hidden-size", "9728", "--seq-length", "4096",
             "--vocab-size", "151643", "--group-query-attention"]
    again = parse_config([*shape, *map(str, variant_flags(model))]).model
    assert again == model


QWEN3_8B = ["--num-layers", "36", "--hidden-size", "4096", "--ffn-hidden-size", "12288",
            "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
            "--kv-channels", "128", "--qk-layernorm", "--make-vocab-size-divisible-by", "1187",
            "--vocab-size", "151643", "--untie-embeddings-and-output-weights"]
QWEN25_7B = ["--num-layers", "28", "--hidden-size", "3584", "--ffn-hidden-size", "18944",
             "--num-attention-heads", "28", "--group-query-attention", "--num-query-groups", "4",
             "--kv-channels", "128", "--add-qkv-bias", "--padded-vocab-size", "152064",
             "--vocab-size", "151665", "--untie-embeddings-and-output-weights"]
LLAMA31_8B = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
              "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
              "--use-rope-scaling", "--make-vocab-size-divisible-by", "1", "--vocab-size",
              "128256", "--untie-embeddings-and-output-weights"]


@pytest.mark.parametrize(("flags", "published"), [(QWEN3_8B, 8_190_735_360),
                                                  (QWEN25_7B, 7_615_616_512),
                                                  (LLAMA31_8B, 8_030_261_248)],
                         ids=["qwen3-8b", "qwen2.5-7b", "llama3.1-8b"])
def test_megatron_model_flags_give_the_published_parameter_count(flags, published) -> None:
    """Megatron's own flag sets for these models (examples/post_training/modelopt/conf):
    one rank's parameters at TP=1 are the Hugging Face checkpoints' totals."""
    model = parse_config(flags).model
    assert stage_params(model, 1, 1, 0, model.num_layers) == published
