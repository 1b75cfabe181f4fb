"""HF export/import of the dense variants: Llama-3.1 RoPE scaling (`LlamaForCausalLM`,
rope_type llama3), Qwen2.5 (`Qwen2ForCausalLM`, q/k/v bias) and Qwen3 (`Qwen3ForCausalLM`,
qk-norm and a head dim that is not hidden/heads).

Each case starts from a random transformers model (every weight redrawn, biases and norm
gains included, so a swapped or dropped tensor shows), imports it, compares our logits with
transformers' (fp32, max difference <= 1e-4), exports the import again and requires the
tensors transformers saved back bit for bit and a complete load. One trained checkpoint
with --padded-vocab-size covers the padded export (vocab_size = the padded rows).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_lite.checkpoint import CheckpointReader
from megatron_lite.export import load_model, main, model_logits, read_safetensors_dir
from megatron_lite.parallel.state import single_process_state
from tests.checkpoint.common import FP32_FLAGS, run_train

transformers = pytest.importorskip("transformers")

MAX_LOGIT_DIFF = 1e-4
SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
CASES = {
    # name: (transformers class, config class, extra config, the flags it imports as)
    "llama3.1": ("LlamaForCausalLM", "LlamaConfig", {"rope_parameters": LLAMA3_ROPE},
                 {"use_rope_scaling": True, "rope_scaling_factor": 8.0, "add_qkv_bias": False,
                  "qk_layernorm": False}),
    "qwen2.5": ("Qwen2ForCausalLM", "Qwen2Config", {"tie_word_embeddings": True},
                {"add_qkv_bias": True, "qk_layernorm": False, "use_rope_scaling": False}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {},
              {"qk_layernorm": True, "add_qkv_bias": False, "use_rope_scaling": False}),
    # qk-norm and q/k/v bias together: Qwen3's attention_bias, its o_proj bias zero
    "qwen3-bias": ("Qwen3ForCausalLM", "Qwen3Config", {"attention_bias": True},
                   {"qk_layernorm": True, "add_qkv_bias": True, "use_rope_scaling": False}),
}
TOKENS = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(0))


def _random_hf(tmp: Path, case: str, o_bias: float = 0.0) -> tuple[Path, torch.Tensor]:
    """A saved random transformers model of `case` and its fp32 logits on TOKENS; an o_proj
    bias (which ours does not have) is set to `o_bias`."""
    model_cls, config_cls, extra, _ = CASES[case]
    config = getattr(transformers, config_cls)(**{**SHAPE, **extra})
    torch.manual_seed(1)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # norm gains around 1, everything else (biases too) a plain normal
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
            if name.endswith("o_proj.bias"):
                p.fill_(o_bias)
        logits = model(TOKENS).logits
    out = tmp / "hf_in"
    model.save_pretrained(out)
    return out, logits


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def assert_exports_back(ckpt: Path, hf_in: Path, architecture: str, ours: torch.Tensor,
                        hf_out: Path) -> None:
    """Exporting `ckpt` to `hf_out` writes `architecture`, which transformers loads completely
    with `ours` logits on TOKENS, and writes `hf_in`'s tensors back bit for bit."""
    assert main(["--load", str(ckpt), "--output", str(hf_out)]) == 0
    config = json.loads((hf_out / "config.json").read_text())
    assert config["architectures"] == [architecture]
    model, info = getattr(transformers, architecture).from_pretrained(
        hf_out, output_loading_info=True, dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        assert _max_diff(model(TOKENS).logits, ours) <= MAX_LOGIT_DIFF
    original, exported = read_safetensors_dir(hf_in), read_safetensors_dir(hf_out)
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.quick) if c == "qwen3"
                                  else c for c in CASES])
def test_transformers_round_trip(tmp_path: Path, case: str) -> None:
    hf_in, theirs = _random_hf(tmp_path, case)
    ckpt = tmp_path / "ck"
    assert main(["--from-hf", str(hf_in), "--save", str(ckpt)]) == 0
    cfg, chunk = load_model(ckpt)
    for flag, value in CASES[case][3].items():
        assert getattr(cfg, flag) == value, flag
    assert cfg.kv_channels == 16 != cfg.hidden_size // cfg.num_attention_heads
    ours = model_logits(chunk, TOKENS, cfg.vocab_size)
    diff = _max_diff(ours, theirs)
    print(f"{case}: max |logit difference| ours vs transformers {diff:.1e}")
    assert diff <= MAX_LOGIT_DIFF

    assert_exports_back(ckpt, hf_in, CASES[case][0], ours, tmp_path / "hf_out")


def test_padded_vocab_export_keeps_the_rows(tmp_path: Path) -> None:
    """--padded-vocab-size 128 (Qwen2.5-style, with q/k/v bias, trained 2 steps at TP=1):
    the export has 128 vocabulary rows, 31 of them zero, loads in Qwen2ForCausalLM with our
    logits on the real 97, and imports back to the same (padded) tensors."""
    ckpt = tmp_path / "ck"
    run_train(single_process_state(), ["--num-layers", "2", "--train-iters", "2",
                                       "--add-qkv-bias", "--kv-channels", "16",
                                       "--padded-vocab-size", "128", "--lr", "0.05",
                                       "--save", str(ckpt)], FP32_FLAGS)
    hf = tmp_path / "hf"
    assert main(["--load", str(ckpt), "--output", str(hf)]) == 0
    cfg, chunk = load_model(ckpt)
    model, info = transformers.Qwen2ForCausalLM.from_pretrained(
        hf, output_loading_info=True, dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.config.vocab_size == 128
    bias = model.model.layers[0].self_attn.q_proj.bias
    assert bias.abs().max() > 1e-3  # trained away from its zero init, so the check means something
    with torch.no_grad():
        theirs = model(TOKENS[:, :16]).logits[..., :97]
    assert _max_diff(theirs, model_logits(chunk, TOKENS[:, :16], cfg.vocab_size)) <= MAX_LOGIT_DIFF
    exported = read_safetensors_dir(hf)
    assert exported["model.embed_tokens.weight"].shape == (128, 32)
    assert not exported["model.embed_tokens.weight"][97:].any()
    back = tmp_path / "back"
    assert main(["--from-hf", str(hf), "--save", str(back)]) == 0
    a, b = CheckpointReader(ckpt / "iter_0000002"), CheckpointReader(back / "iter_0000000")
    assert sorted(a.where) == sorted(b.where)
    for name in a.where:
        ours, imported = a.full_weight(name), b.full_weight(name)
        if ours.shape != imported.shape:  # the vocabulary tensors: our pad rows are zero
            ours = torch.cat([ours, ours.new_zeros(128 - 97, ours.shape[1])])
        assert torch.equal(ours, imported), name


def test_an_output_projection_bias_is_refused(tmp_path: Path, capsys) -> None:
    hf_in, _ = _random_hf(tmp_path, "qwen3-bias", o_bias=0.1)
    assert main(["--from-hf", str(hf_in), "--save", str(tmp_path / "ck")]) == 2
    assert "o_proj.bias is not zero" in capsys.readouterr().err
