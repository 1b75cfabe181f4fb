"""Hugging Face export and import of megatron_lite checkpoints (Llama, Qwen2, Qwen3, and the
Mixtral and Qwen3-MoE mixtures of experts).

    python -m megatron_lite.export --load CKPT_DIR --output HF_DIR [--tokenizer-model TOK.model]
        [--dtype bf16|fp32] [--ckpt-step N] [--max-shard-size 5GB]
    python -m megatron_lite.export --from-hf HF_DIR --save CKPT_DIR

Export gathers a checkpoint of any parallel layout into full tensors (no processes needed)
and writes `config.json`, `model.safetensors` (or shards + `model.safetensors.index.json`
above --max-shard-size) and the run's tokenizer: `tokenizer.model` (sentencepiece), or
`tokenizer.json` + `tokenizer_config.json` (HuggingFaceTokenizer, GPT2BPETokenizer, and
TikTokenizer converted to the same ids), which AutoTokenizer loads. Our RoPE is the
rotate-half convention that `transformers`' Llama uses, so the conversion is a rename plus
splitting the fused [Q; K; V] and [gate; up] weights; no row permutation. Import is the
reverse and writes a model-only checkpoint (TP=PP=1, iteration 0) that any layout loads,
with fresh Adam state. Only safetensors is read: pickled `pytorch_model.bin` files are
refused, never unpickled.

The architecture follows the variant flags: `LlamaForCausalLM` (with `rope_type: llama3`
under --use-rope-scaling), `Qwen2ForCausalLM` for --add-qkv-bias, `Qwen3ForCausalLM` for
--qk-layernorm (with --add-qkv-bias too: Qwen3's `attention_bias`, whose o_proj bias is
written as zeros and must be zero on import). `head_dim` is --kv-channels. With
--padded-vocab-size the vocabulary tensors keep all their rows (the padding ones zero) and
`vocab_size` is that row count, as Qwen2.5's configs have it; an import takes every row as
vocabulary (Hugging Face has no padding count). A --num-experts model is
`MixtralForCausalLM`, with --qk-layernorm `Qwen3MoeForCausalLM`, or with a gated shared expert
`Qwen2MoeForCausalLM` (export_moe.py says which router flags each one computes and refuses the
rest).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from megatron_lite import export_moe, structure
from megatron_lite.checkpoint import files as ckpt_files
from megatron_lite.checkpoint.reshard import CheckpointReader, local_slice
from megatron_lite.config import Config, ConfigError, ModelConfig, MoEConfig
from megatron_lite.errors import add_debug_flag, run_cli
from megatron_lite.kernels import rope as rope_kernels
from megatron_lite.layers import tags
from megatron_lite.layers.context import LayerContext
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.parallel.state import single_process_state

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# Our per-layer weight suffix -> Hugging Face's (the fused ones are split first).
_LAYER_NAMES = {"attention_norm.weight": "input_layernorm.weight",
                "attention.proj.weight": "self_attn.o_proj.weight",
                "mlp_norm.weight": "post_attention_layernorm.weight",
                "mlp.down.weight": "mlp.down_proj.weight"}
_TOP_NAMES = {"embedding.weight": "model.embed_tokens.weight",
              "final_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_QK_NORM_NAMES = {"attention.q_norm.weight": "self_attn.q_norm.weight",
                  "attention.k_norm.weight": "self_attn.k_norm.weight"}
_LLAMA3_ROPE = {"low_freq_factor": rope_kernels.LLAMA3_LOW_FREQ_FACTOR,
                "high_freq_factor": rope_kernels.LLAMA3_HIGH_FREQ_FACTOR,
                "original_max_position_embeddings": rope_kernels.LLAMA3_ORIGINAL_CONTEXT}
"""Llama 3.1's fixed scaling constants (only the factor is a flag, as in Megatron)."""


def tp_split(param: structure.Param) -> tags.TpSplit | None:
    """A structure entry's TP split as layers/tags.py writes it (and checkpoints store it)."""
    if param.split_dim is None:
        return None
    if param.vocab:
        return tags.vocab_split(param.shape[0])
    return tags.column_split(param.partitions) if param.split_dim == 0 else tags.row_split()


def canonical_tags(model_cfg: ModelConfig, moe: MoEConfig | None = None
                   ) -> dict[str, tags.TpSplit | None]:
    """Global weight name -> TP split of an unpadded, TP=1, EP=1 model
    (megatron_lite/structure.py)."""
    return {p.name: tp_split(p)
            for p in structure.model_parameters(model_cfg, model_cfg.vocab_size, moe)}


def hf_architecture(model_cfg: ModelConfig, moe: MoEConfig | None = None) -> tuple[str, str]:
    """(architecture, model_type) of the Hugging Face class that computes our variant."""
    if moe is not None:
        return export_moe.architecture(model_cfg, moe)
    if model_cfg.qk_layernorm:
        return "Qwen3ForCausalLM", "qwen3"
    if model_cfg.add_qkv_bias:
        return "Qwen2ForCausalLM", "qwen2"
    return "LlamaForCausalLM", "llama"


def _o_proj_bias(model_cfg: ModelConfig) -> bool:
    """Qwen3's (and Llama's) `attention_bias` also puts a bias on o_proj; ours is zero."""
    return model_cfg.add_qkv_bias and hf_architecture(model_cfg)[1] != "qwen2"


def to_hf(full: dict[str, Tensor], model_cfg: ModelConfig, moe: MoEConfig | None = None
          ) -> dict[str, Tensor]:
    """Our full (unsharded, unpadded) weights -> Hugging Face state dict (`hf_architecture`);
    vocabulary tensors padded to --padded-vocab-size rows when it is set."""
    out: dict[str, Tensor] = {}
    for name, w in full.items():
        layer = _LAYER.match(name)
        if layer is None:
            if name != "final_norm.weight" and model_cfg.padded_vocab is not None:
                w = torch.cat([w, w.new_zeros(model_cfg.padded_vocab - w.shape[0], w.shape[1])])
            out[_TOP_NAMES[name]] = w
            continue
        prefix, rest = f"model.layers.{layer.group(1)}.", layer.group(2)
        if rest in ("attention.qkv.weight", "attention.qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            q, k, v = w.split(structure.qkv_rows(model_cfg))
            out |= {prefix + f"self_attn.q_proj.{kind}": q,
                    prefix + f"self_attn.k_proj.{kind}": k,
                    prefix + f"self_attn.v_proj.{kind}": v}
            if kind == "bias" and _o_proj_bias(model_cfg):
                out[prefix + "self_attn.o_proj.bias"] = w.new_zeros(model_cfg.hidden_size)
        elif rest in _QK_NORM_NAMES:
            out[prefix + _QK_NORM_NAMES[rest]] = w
        elif moe is not None and rest in export_moe.MOE_WEIGHTS:
            out |= export_moe.to_hf(prefix, rest, w, model_cfg, moe)
        elif rest == "mlp.gate_up.weight":
            gate, up = w.chunk(2)
            out |= {prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up}
        else:
            out[prefix + _LAYER_NAMES[rest]] = w
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(hf: dict[str, Tensor], model_cfg: ModelConfig, moe: MoEConfig | None = None
            ) -> dict[str, Tensor]:
    """Inverse of `to_hf`: fuse q/k/v and gate/up (and stack the experts) back, rename."""
    out: dict[str, Tensor] = {}
    untied = model_cfg.untie_embeddings_and_output_weights
    for ours, theirs in _TOP_NAMES.items():
        if theirs in hf and (ours != "output.weight" or untied):
            out[ours] = hf[theirs]
    inverse = {v: k for k, v in _LAYER_NAMES.items()}
    if model_cfg.qk_layernorm:
        inverse |= {v: k for k, v in _QK_NORM_NAMES.items()}
    model_type = hf_architecture(model_cfg, moe)[1]
    for i, sparse in enumerate(export_moe.moe_layers(model_cfg, moe)):
        prefix = f"model.layers.{i}."
        out[f"layers.{i}.attention.qkv.weight"] = torch.cat(
            [hf[prefix + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        if model_cfg.add_qkv_bias:
            out[f"layers.{i}.attention.qkv.bias"] = torch.cat(
                [hf[prefix + f"self_attn.{x}_proj.bias"] for x in "qkv"])
        o_bias = hf.get(prefix + "self_attn.o_proj.bias")
        if o_bias is not None and bool(o_bias.any()):
            raise ckpt_files.CheckpointError(
                f"{prefix}self_attn.o_proj.bias is not zero: megatron_lite's attention output "
                "projection has no bias (--add-qkv-bias covers q, k and v only)")
        if sparse:
            out |= export_moe.from_hf(hf, prefix, f"layers.{i}.", model_type, moe.num_experts)
        else:
            out[f"layers.{i}.mlp.gate_up.weight"] = torch.cat(
                [hf[prefix + "mlp.gate_proj.weight"], hf[prefix + "mlp.up_proj.weight"]])
        for theirs, ours in inverse.items():
            if not (sparse and ours == "mlp.down.weight"):
                out[f"layers.{i}.{ours}"] = hf[prefix + theirs]
    missing = set(canonical_tags(model_cfg, moe)) - set(out)
    if missing:
        raise ckpt_files.CheckpointError(f"the Hugging Face weights lack {sorted(missing)[:5]}")
    return out


def hf_rope_parameters(model_cfg: ModelConfig) -> dict:
    """transformers 5's `rope_parameters`: the default type, or llama3 with Megatron's
    --use-rope-scaling constants."""
    rope = {"rope_type": "default", "rope_theta": model_cfg.rotary_base}
    if model_cfg.use_rope_scaling:
        rope |= {"rope_type": "llama3", "factor": model_cfg.rope_scaling_factor, **_LLAMA3_ROPE}
    return rope


def check_exportable(model_cfg: ModelConfig, moe: MoEConfig | None = None) -> None:
    """Refuses, before anything is written, a model no Hugging Face class computes."""
    architecture = hf_architecture(model_cfg, moe)[0]
    if model_cfg.rotary_percent < 1:
        # transformers reads `partial_rotary_factor` for the frequencies, but its Llama, Qwen2
        # and Qwen3 attention rotates every channel of the head with them (checked in 5.24)
        raise ConfigError(f"--rotary-percent {model_cfg.rotary_percent}: transformers' "
                          f"{architecture} rotates the whole head, so a partial-RoPE model has "
                          "no Hugging Face equivalent to export to; export needs "
                          "--rotary-percent 1.0")
    if moe is not None:
        export_moe.check_exportable(model_cfg, moe)


def hf_config(model_cfg: ModelConfig, dtype: torch.dtype, bos: int | None, eos: int | None,
              moe: MoEConfig | None = None) -> dict:
    architecture, model_type = hf_architecture(model_cfg, moe)
    rope = hf_rope_parameters(model_cfg)
    legacy_scaling = ({k: v for k, v in rope.items() if k != "rope_theta"}
                      if model_cfg.use_rope_scaling else None)  # what transformers 4 reads
    config = {"architectures": [architecture], "model_type": model_type,
              "vocab_size": model_cfg.padded_vocab or model_cfg.vocab_size,
              "hidden_size": model_cfg.hidden_size,
              "intermediate_size": model_cfg.ffn_hidden_size,
              "num_hidden_layers": model_cfg.num_layers,
              "num_attention_heads": model_cfg.num_attention_heads,
              "num_key_value_heads": model_cfg.num_query_groups, "head_dim": model_cfg.head_dim,
              "max_position_embeddings": model_cfg.max_position_embeddings,
              "rms_norm_eps": model_cfg.norm_epsilon, "rope_theta": model_cfg.rotary_base,
              "rope_parameters": rope, "rope_scaling": legacy_scaling,
              "tie_word_embeddings": not model_cfg.untie_embeddings_and_output_weights,
              "hidden_act": "silu", "attention_bias": _o_proj_bias(model_cfg), "mlp_bias": False,
              "use_sliding_window": False,
              "initializer_range": model_cfg.init_method_std, "bos_token_id": bos,
              "eos_token_id": eos,
              "torch_dtype": str(dtype).removeprefix("torch.")}
    return config | (export_moe.hf_config(model_cfg, moe) if moe is not None else {})


def _rope_scaling_from_hf(config: dict, unsupported: list[str]) -> float | None:
    """The --rope-scaling-factor of a llama3-type RoPE (None for the default type); other
    types, and llama3 constants Megatron's flags cannot express, go to `unsupported`."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    fixed = all(float(rope.get(k, -1)) == float(v) for k, v in _LLAMA3_ROPE.items())
    if kind != "llama3" or not fixed:
        unsupported.append(f"rope_type {kind} {rope} (only llama3 with "
                           f"{_LLAMA3_ROPE} imports, as --use-rope-scaling)")
        return None
    return float(rope["factor"])


_IMPORTED = ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe")


def model_config_from_hf(config: dict) -> tuple[ModelConfig, MoEConfig | None]:
    """Our ModelConfig (and MoEConfig for Mixtral and Qwen3-MoE) for a Hugging Face
    config.json; refuses what we cannot run."""
    model_type = config.get("model_type")
    if model_type not in _IMPORTED:
        raise ckpt_files.CheckpointError(
            f"model_type {model_type!r}: only {', '.join(map(repr, _IMPORTED))} import")
    moe_fields, moe = ({}, None)
    if model_type in ("mixtral", "qwen3_moe", "qwen2_moe"):
        moe_fields, moe = export_moe.model_fields_from_hf(config)
    rope = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    unsupported = ["mlp_bias"] if config.get("mlp_bias") else []
    if config.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={config['hidden_act']}")
    if config.get("use_sliding_window"):
        unsupported.append("use_sliding_window")
    factor = _rope_scaling_from_hf(config, unsupported)
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        unsupported.append(f"partial_rotary_factor={partial} (its {model_type} rotates the "
                           "whole head regardless)")
    if unsupported:
        raise ckpt_files.CheckpointError(f"this {model_type} config uses {unsupported}, which "
                                         "megatron_lite's model does not implement")
    heads = config["num_attention_heads"]
    model = ModelConfig(num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
                       kv_channels=config.get("head_dim") or config["hidden_size"] // heads,
                       add_qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias")),
                       qk_layernorm=model_type == "qwen3",
                       use_rope_scaling=factor is not None,
                       rope_scaling_factor=factor if factor is not None else 8.0,
                       ffn_hidden_size=config["intermediate_size"], num_attention_heads=heads,
                       num_query_groups=config.get("num_key_value_heads", heads),
                       seq_length=min(config.get("max_position_embeddings", 2048), 4096),
                       max_position_embeddings=config.get("max_position_embeddings", 2048),
                       vocab_size=config["vocab_size"],
                       untie_embeddings_and_output_weights=not config.get(
                           "tie_word_embeddings", False),
                       norm_epsilon=config.get("rms_norm_eps", 1e-6), rotary_base=theta)
    return dataclasses.replace(model, **moe_fields), moe


def parse_size(text: str) -> int:
    """'5GB' / '300MB' / '20KB' / '1000' -> bytes (decimal units, as transformers uses)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not match:
        raise ConfigError(f"--max-shard-size {text!r}: use e.g. 5GB, 500MB or a byte count")
    scale = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "K": 1e3, "M": 1e6, "G": 1e9}
    return int(float(match.group(1)) * scale[match.group(2)])


def write_safetensors_dir(out: Path, tensors: dict[str, Tensor], max_shard_bytes: int) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index above the limit."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def read_safetensors_dir(hf_dir: Path) -> dict[str, Tensor]:
    """All weights of a Hugging Face directory (single file or index); safetensors only."""
    from safetensors.torch import load_file

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        pickled = [p.name for p in hf_dir.glob("*.bin")] + [p.name for p in hf_dir.glob("*.pt")]
        raise ckpt_files.CheckpointError(
            f"{hf_dir} has no model.safetensors (or index); found {pickled or 'nothing'}. "
            "Pickled weights are never loaded (they can run code): convert them to "
            "safetensors with a tool you trust first")
    out: dict[str, Tensor] = {}
    for name in names:
        out |= load_file(str(hf_dir / name))
    return out


def verified_reader(ckpt_root: Path, step: int | None) -> CheckpointReader:
    """A reader of `latest` (or `step`) whose weight files match their recorded checksums."""
    ckpt_dir = ckpt_files.resolve_checkpoint_dir(Path(ckpt_root), step)
    if ckpt_dir is None:
        raise ckpt_files.CheckpointError(f"--load {ckpt_root}: no checkpoint there")
    meta = ckpt_files.read_metadata(ckpt_dir)
    ckpt_files.verify_checksums(ckpt_dir, meta,
                                [n for n in meta["files"] if n.startswith("model_")])
    return CheckpointReader(ckpt_dir)


def export(ckpt_root: Path, output: Path, *, step: int | None = None,
           tokenizer_model: str | None = None, dtype: str = "fp32",
           max_shard_size: str = "5GB") -> Path:
    """Write the Hugging Face directory for a checkpoint; returns the checkpoint dir used."""
    reader = verified_reader(ckpt_root, step)
    model_cfg = ModelConfig(**reader.model_cfg)
    moe = export_moe.moe_config(reader.meta["config"])
    check_exportable(model_cfg, moe)
    full = {name: reader.full_weight(name).to(DTYPES[dtype]) for name in reader.where}
    if moe is not None:
        export_moe.check_full_experts(full, model_cfg, moe, reader.dir)
    output.mkdir(parents=True, exist_ok=True)
    write_safetensors_dir(output, to_hf(full, model_cfg, moe), parse_size(max_shard_size))
    bos, eos = _write_tokenizer(output, reader.meta["config"]["data"], model_cfg.vocab_size,
                                tokenizer_model)
    config = hf_config(model_cfg, DTYPES[dtype], bos, eos, moe)
    (output / "config.json").write_text(json.dumps(config, indent=1))
    return reader.dir


def _write_tokenizer(output: Path, data: dict, vocab_size: int, override: str | None
                     ) -> tuple[int | None, int | None]:
    """Write the run's tokenizer (its --tokenizer-type; `override` replaces --tokenizer-model)
    as Hugging Face files; (BOS, EOS) ids for config.json. Files the run read that are gone
    now: no tokenizer (a warning), unless `override` was given."""
    from tokenizer.spec import TokenizerSpec, load_tokenizer
    from tokenizer.tokenizer import TokenizerError

    data = {**data, "tokenizer_model": override or data.get("tokenizer_model")}
    spec = TokenizerSpec.from_data_config(data, vocab_size)
    if spec is None:
        return None, None
    try:
        tok = load_tokenizer(spec)
    except TokenizerError as e:
        if override:
            raise ckpt_files.CheckpointError(f"--tokenizer-model {override}: {e}") from None
        print(f"warning: exported without tokenizer files: {e}", file=sys.stderr)
        return None, None
    tok.save_hf(output)
    return tok.bos_id, tok.eod_id


def import_hf(hf_dir: Path, save_dir: Path) -> Path:
    """Write a model-only megatron_lite checkpoint (iteration 0) from a Hugging Face dir."""
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise ckpt_files.CheckpointError(f"--from-hf {hf_dir}: no config.json there")
    model_cfg, moe = model_config_from_hf(json.loads(config_path.read_text()))
    weights = from_hf(read_safetensors_dir(hf_dir), model_cfg, moe)
    splits = canonical_tags(model_cfg, moe)
    cfg = Config(model=model_cfg, moe=moe or MoEConfig())
    tok = hf_dir / "tokenizer.model"
    hf_tok = [hf_dir / n for n in _HF_TOKENIZER_FILES if (hf_dir / n).is_file()]
    if tok.is_file():
        cfg.data.tokenizer_model = str(save_dir / "tokenizer.model")
    elif hf_tok and hf_tok[0].name == "tokenizer.json":  # a fast tokenizer: ours to load
        cfg.data.tokenizer_type = "HuggingFaceTokenizer"
        cfg.data.tokenizer_model = str(save_dir / "tokenizer")
    save_dir.mkdir(parents=True, exist_ok=True)
    ckpt_files.clear_stale(save_dir)
    tmp = Path(tempfile.mkdtemp(prefix=ckpt_files.iter_dir_name(0) + ".", suffix=".tmp",
                                dir=save_dir))
    name = ckpt_files.model_file(0, 0)
    size, digest = ckpt_files.write_tensors(
        tmp / name, {k: weights[k].contiguous() for k in splits},
        {"tp_split": splits, "tp_rank": 0, "pp_rank": 0})
    meta = {"consumed_samples": 0, "has_optimizer": False, "config": dataclasses.asdict(cfg),
            "layout": {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "virtual_chunks": 1,
                       "use_distributed_optimizer": False},
            "partition": [[list(range(model_cfg.num_layers))]], "seed": cfg.train.seed,
            "imported_from": str(hf_dir), "files": {name: size},
            "sha256": {name: digest}}
    final = ckpt_files.commit(save_dir, tmp, 0, meta, None)
    if tok.is_file():
        shutil.copyfile(tok, save_dir / "tokenizer.model")
    elif cfg.data.tokenizer_type == "HuggingFaceTokenizer":
        (save_dir / "tokenizer").mkdir(exist_ok=True)
        for file in hf_tok:
            shutil.copyfile(file, save_dir / "tokenizer" / file.name)
    return final


@torch.no_grad()
def load_model(ckpt_root: Path, step: int | None = None, device: torch.device | None = None
               ) -> tuple[ModelConfig, LlamaChunk]:
    """The whole model of a checkpoint (any layout) as one TP=PP=1 chunk, fp32, eval mode."""
    reader = verified_reader(ckpt_root, step)
    model_cfg = ModelConfig(**reader.model_cfg)
    pstate = single_process_state(device)
    ctx = LayerContext.from_state(pstate, seed=0,
                                  moe=export_moe.moe_config(reader.meta["config"]))
    chunk = LlamaChunk(model_cfg, ctx, range(model_cfg.num_layers), pre_process=True,
                       post_process=True)
    for name, param in chunk.named_parameters():
        param.copy_(local_slice(reader.full_weight(name).float(), param, pstate))
    return model_cfg, chunk.eval()


@torch.no_grad()
def model_logits(chunk: LlamaChunk, tokens: Tensor, vocab_size: int) -> Tensor:
    """Logits [b, s, vocab] of a whole-model chunk (TP=1) for token ids [b, s]."""
    logits = chunk.output.logits(chunk.final_hidden(tokens))
    return logits.transpose(0, 1)[..., :vocab_size]


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_lite.export",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", help="checkpoint directory to export (latest or --ckpt-step)")
    parser.add_argument("--output", help="Hugging Face directory to write")
    parser.add_argument("--ckpt-step", type=int, help="export this iteration instead of latest")
    parser.add_argument("--tokenizer-model", help="tokenizer file to ship instead of the "
                        "checkpoint's --tokenizer-model (same --tokenizer-type)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="split model.safetensors above this size (default: 5GB)")
    parser.add_argument("--from-hf", help="import this Hugging Face Llama, Qwen2, Qwen3, "
                        "Mixtral or Qwen3-MoE directory instead")
    parser.add_argument("--save", help="with --from-hf: checkpoint directory to write")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    if args.from_hf:
        if not args.save:
            parser.error("--from-hf needs --save CKPT_DIR")
        final = import_hf(Path(args.from_hf), Path(args.save))
        print(f"imported {args.from_hf} -> {final} (model only; fresh optimizer state)")
    else:
        if not (args.load and args.output):
            parser.error("export needs --load CKPT_DIR and --output HF_DIR")
        used = export(Path(args.load), Path(args.output), step=args.ckpt_step,
                      tokenizer_model=args.tokenizer_model, dtype=args.dtype,
                      max_shard_size=args.max_shard_size)
        print(f"exported {used} -> {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """A bad checkpoint, directory or flag value ends in one `error:` line and exit status 2."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
