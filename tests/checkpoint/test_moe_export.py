"""HF export/import of mixture-of-experts models: `MixtralForCausalLM`, `Qwen3MoeForCausalLM`
and `Qwen2MoeForCausalLM` (megatron_lite/export_moe.py).

Each import case starts from a random transformers model (every weight redrawn, the router
included), imports it, compares our logits with transformers' (fp32, max difference <= 1e-4, as
tests/checkpoint/test_export_variants.py), exports the import again and requires the tensors
transformers saved back bit for bit and a complete load. A checkpoint our trainer saved at TP=2
(float64, the experts' gate/up cut per expert over TP) exports to Mixtral with transformers'
float64 logits within `MOE_FLOOR`; refused routings name their flag.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megatron_lite import export_moe
from megatron_lite.checkpoint import files as ckpt_files
from megatron_lite.config import Config, ConfigError, ModelConfig, MoEConfig, ParallelConfig
from megatron_lite.export import load_model, main, model_logits, read_safetensors_dir
from tests.checkpoint.common import HF_FLOOR, run_train
from tests.checkpoint.test_export_variants import assert_exports_back
from tests.distributed import relayout, run_ranks
from tests.numerics import assert_close

transformers = pytest.importorskip("transformers")

MAX_LOGIT_DIFF = 1e-4
MOE_FLOOR = 5 * HF_FLOOR
"""Relative logits difference allowed, float64 both, as for the dense export: transformers
computes RMSNorm, the RoPE tables and (in its MoE routers) the softmax in fp32 in a float64
model; measured 5.6e-8 here."""
SHAPE = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
             tie_word_embeddings=False, num_experts_per_tok=2)
CASES = {
    # name: (transformers class, config class, extra config, the MoE flags it imports as)
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                {"intermediate_size": 16, "num_local_experts": 4},
                {"moe_router_pre_softmax": False, "moe_layer_freq": "1",
                 "moe_ffn_hidden_size": 16}),
    # renormalised top-k = our default routing; layer 1 dense (mlp_only_layers)
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  {"intermediate_size": 48, "moe_intermediate_size": 16, "num_experts": 4,
                   "norm_topk_prob": True, "mlp_only_layers": [1]},
                  {"moe_router_pre_softmax": False, "moe_layer_freq": "[1,0]",
                   "moe_ffn_hidden_size": 16}),
    # top-k of the full softmax, not renormalised = --moe-router-pre-softmax; layer 0 dense
    "qwen3-moe-pre-softmax": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                              {"intermediate_size": 48, "moe_intermediate_size": 16,
                               "num_experts": 4, "norm_topk_prob": False,
                               "decoder_sparse_step": 2},
                              {"moe_router_pre_softmax": True, "moe_layer_freq": "[0,1]"}),
    # a sigmoid-gated shared expert = --moe-shared-expert-gate; q/k/v biases; layer 1 dense
    "qwen2-moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  {"intermediate_size": 48, "moe_intermediate_size": 16, "num_experts": 4,
                   "shared_expert_intermediate_size": 24, "norm_topk_prob": True,
                   "qkv_bias": True, "mlp_only_layers": [1]},
                  {"moe_shared_expert_intermediate_size": 24, "moe_shared_expert_gate": True,
                   "moe_router_pre_softmax": False, "moe_layer_freq": "[1,0]"}),
}
TOKENS = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(0))


def _random_hf(tmp: Path, case: str) -> tuple[Path, torch.Tensor, dict[str, torch.Tensor]]:
    """A saved random transformers model of `case`, its fp32 logits on TOKENS and its
    in-memory state dict (transformers 5's fused expert names)."""
    model_cls, config_cls, extra, _ = CASES[case]
    config = getattr(transformers, config_cls)(**{**SHAPE, **extra})
    torch.manual_seed(1)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
        logits = model(TOKENS).logits
    out = tmp / "hf_in"
    model.save_pretrained(out)
    return out, logits, model.state_dict()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.quick) if c == "qwen3-moe"
                                  else c for c in CASES])
def test_transformers_round_trip(tmp_path: Path, case: str) -> None:
    hf_in, theirs, fused = _random_hf(tmp_path, case)
    ckpt = tmp_path / "ck"
    assert main(["--from-hf", str(hf_in), "--save", str(ckpt)]) == 0
    saved = json.loads(next(ckpt.glob("iter_*/metadata.json")).read_text())["config"]
    moe = export_moe.moe_config(saved)
    for flag, value in CASES[case][3].items():
        assert getattr(moe, flag) == value, flag
    cfg, chunk = load_model(ckpt)
    assert cfg.qk_layernorm == case.startswith("qwen3")
    assert cfg.add_qkv_bias == (case == "qwen2-moe")
    ours = model_logits(chunk, TOKENS, cfg.vocab_size)
    diff = _max_diff(ours, theirs)
    print(f"{case}: max |logit difference| ours vs transformers {diff:.1e}")
    assert diff <= MAX_LOGIT_DIFF

    # transformers 5's fused layout (its state dict) reads as the same experts
    for i, sparse in enumerate(export_moe.moe_layers(cfg, moe)):
        if sparse:
            prefix, ours_prefix = f"model.layers.{i}.", f"layers.{i}."
            model_type = export_moe.architecture(cfg, moe)[1]
            a = export_moe.from_hf(fused, prefix, ours_prefix, model_type, 4)
            b = export_moe.from_hf(read_safetensors_dir(hf_in), prefix, ours_prefix,
                                   model_type, 4)
            assert all(torch.equal(a[k], b[k]) for k in a)

    assert_exports_back(ckpt, hf_in, CASES[case][0], ours, tmp_path / "hf_out")


TRAIN = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
         "4", "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "16",
         "--vocab-size", "97", "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "1",
         "--global-batch-size", "1", "--lr", "2e-2", "--train-iters", "1", "--eval-iters", "0",
         "--peak-tflops", "1", "--log-interval", "100", "--fp64", "--num-experts", "4",
         "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
         "--tensor-model-parallel-size", "2"]


def _train_tp2(pstate, save: str, expert_tp: int | None) -> None:
    if expert_tp is None:
        run_train(pstate, ["--save", save], TRAIN)
        return
    pstate = relayout(pstate, Config(parallel=ParallelConfig(tensor_model_parallel_size=2),
                                     moe=MoEConfig(num_experts=4,
                                                   expert_tensor_parallel_size=expert_tp)))
    run_train(pstate, ["--save", save, "--sequence-parallel", "--expert-tensor-parallel-size",
                       str(expert_tp)], TRAIN)


@pytest.mark.parametrize("expert_tp", [None, 1])
def test_a_tp2_checkpoint_exports_to_mixtral(tmp_path: Path, expert_tp: int | None) -> None:
    """Trained and saved at TP=2 (each expert's gate and up rows split on their own over TP,
    or whole, in their own files, under --expert-tensor-parallel-size 1): the export loads
    completely into MixtralForCausalLM, whose float64 logits are ours."""
    ckpt = tmp_path / "ck"
    run_ranks(_train_tp2, 2, tmp_path, tp=2, save=str(ckpt), expert_tp=expert_tp)
    saved = {f.name for f in next(ckpt.glob("iter_*")).iterdir()}
    assert (ckpt_files.expert_model_file(0, 0, 0) in saved) == (expert_tp == 1)
    hf = tmp_path / "hf"
    assert main(["--load", str(ckpt), "--output", str(hf)]) == 0
    cfg, chunk = load_model(ckpt)
    ours = model_logits(chunk.double(), TOKENS[:, :16], cfg.vocab_size)
    # eager experts: transformers' default grouped GEMM takes no float64
    model, info = transformers.MixtralForCausalLM.from_pretrained(
        hf, output_loading_info=True, dtype=torch.float64, experts_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        theirs = model(TOKENS[:, :16]).logits
    assert theirs.dtype == torch.float64
    err = assert_close(theirs, ours, MOE_FLOOR, "transformers' Mixtral logits")
    print(f"TP=2 checkpoint: relative logits difference ours vs Mixtral (float64) {err:.1e}")


BASE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                   seq_length=8, vocab_size=97)
REFUSED = {
    "--moe-router-score-function sigmoid": (BASE, {"moe_router_score_function": "sigmoid"}),
    "--moe-router-enable-expert-bias": (BASE, {"moe_router_enable_expert_bias": True}),
    "--moe-router-group-topk 1": (BASE, {"moe_router_num_groups": 2,
                                         "moe_router_group_topk": 1}),
    "--moe-router-topk-scaling-factor 2.5": (BASE, {"moe_router_topk_scaling_factor": 2.5}),
    "--moe-expert-capacity-factor 1.0": (BASE, {"moe_expert_capacity_factor": 1.0}),
    "--moe-router-pre-softmax": (BASE, {"moe_router_pre_softmax": True}),
    "--add-qkv-bias": (replace(BASE, add_qkv_bias=True), {}),
    "--moe-layer-freq 2": (BASE, {"moe_layer_freq": "2"}),
}


def test_refused_routings_name_their_flag() -> None:
    """Each routing no Hugging Face class computes is refused naming the flag; with
    --qk-layernorm (Qwen3-MoE) pre-softmax and dense layers are fine."""
    for flag, (model, fields) in REFUSED.items():
        moe = MoEConfig(num_experts=4, **fields)
        with pytest.raises(ConfigError, match=f"^{re.escape(flag)}.*MixtralForCausalLM"):
            export_moe.check_exportable(model, moe)
    ungated = MoEConfig(num_experts=4, moe_shared_expert_intermediate_size=8)
    with pytest.raises(ConfigError, match=r"^--moe-shared-expert-intermediate-size 8 without "
                                          r"--moe-shared-expert-gate.*Qwen2MoeForCausalLM"):
        export_moe.check_exportable(BASE, ungated)
    qwen3 = replace(BASE, qk_layernorm=True)
    export_moe.check_exportable(qwen3, MoEConfig(num_experts=4, moe_router_pre_softmax=True,
                                                 moe_layer_freq="2"))
    half = {"layers.0.mlp.gate_up": torch.zeros(2 * 2 * 48, 32)}
    with pytest.raises(ConfigError, match=r"2 of --num-experts 4 experts.*"
                                          r"--expert-model-parallel-size 1 runs \(this one: 2\)"):
        export_moe.check_full_experts(half, BASE, MoEConfig(
            num_experts=4, expert_model_parallel_size=2), "ck")
