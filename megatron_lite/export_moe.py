"""Hugging Face export/import of mixture-of-experts models: Mixtral, Qwen3-MoE, Qwen2-MoE.

export.py calls these for a checkpoint with --num-experts. Which class computes our MoE layer
follows from the router's flags (layers/router.py), checked against transformers 5.24:

- Our default routing, softmax over the k largest logits, equals a softmax over all experts
  whose top k are renormalised (softmax is monotone, and the common denominator cancels).
  Without --qk-layernorm that is `MixtralForCausalLM`, every layer MoE.
- With --qk-layernorm it is `Qwen3MoeForCausalLM` with `norm_topk_prob: true` (Qwen3-30B-A3B's
  setting); --moe-router-pre-softmax (top k of the full softmax, not renormalised) is
  `norm_topk_prob: false`. Dense layers of --moe-layer-freq are its `mlp_only_layers`
  (with `decoder_sparse_step` 1), their width `intermediate_size`; the experts' width is
  `moe_intermediate_size`.
- With a gated shared expert (--moe-shared-expert-intermediate-size with
  --moe-shared-expert-gate) and no --qk-layernorm it is `Qwen2MoeForCausalLM`: its
  `shared_expert` (`shared_expert_intermediate_size`) scaled per token by
  sigmoid(`shared_expert_gate` x), q/k/v biases as `qkv_bias` (--add-qkv-bias), the routing,
  `norm_topk_prob` and `mlp_only_layers` read as for Qwen3-MoE.

None of the classes has sigmoid scores, an expert bias, group-limited routing, a top-k
scaling factor, a capacity (tokens dropped) or an ungated shared expert: those are refused,
naming the flag. The experts are written in the per-expert layout the published checkpoints use
(`experts.{e}.w1/w3/w2` under `block_sparse_moe` for Mixtral, `experts.{e}.gate_proj/up_proj/
down_proj` under `mlp` for Qwen3-MoE), which transformers 5 fuses on load; import reads that
layout or transformers 5's fused `experts.gate_up_proj` [E, 2f, h] / `experts.down_proj`
[E, h, f]. Our stacked gate/up is [E x 2f, h] (each expert's gate rows, then its up rows) and
down [E x h, f], so both directions are reshapes, no permutation.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from megatron_lite.checkpoint.files import CheckpointError
from megatron_lite.config import ConfigError, ModelConfig, MoEConfig, moe_layer_pattern

MOE_WEIGHTS = ("mlp.gate_up", "mlp.down", "mlp.router.weight", "mlp.shared_gate",
               "mlp.shared.gate_up.weight", "mlp.shared.down.weight")
"""Our per-layer suffixes of a MoE layer's weights (megatron_lite/structure.py)."""
_EXPERT_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                 "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                 "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}
"""model_type -> (MoE block, gate, up, down) in the published per-expert layout."""
_SHARED_NAMES = {"mlp.shared_gate": "mlp.shared_expert_gate.weight",
                 "mlp.shared.down.weight": "mlp.shared_expert.down_proj.weight"}
"""Our gated shared expert's weights -> Qwen2-MoE's (gate|up is split in two)."""


def moe_config(saved: dict) -> MoEConfig | None:
    """The MoE flags of a checkpoint's saved config; None for a dense model."""
    moe = saved.get("moe") or {}
    return MoEConfig(**moe) if moe.get("num_experts") else None


def moe_layers(model_cfg: ModelConfig, moe: MoEConfig | None) -> list[bool]:
    """One flag per layer: True where the MLP is MoE."""
    if moe is None:
        return [False] * model_cfg.num_layers
    return moe_layer_pattern(moe.moe_layer_freq, model_cfg.num_layers)


def architecture(model_cfg: ModelConfig, moe: MoEConfig) -> tuple[str, str]:
    """(architecture, model_type) of a MoE model: qk-norm is Qwen3-MoE's, a shared expert
    Qwen2-MoE's, the rest Mixtral's."""
    if model_cfg.qk_layernorm:
        return "Qwen3MoeForCausalLM", "qwen3_moe"
    if moe.moe_shared_expert_intermediate_size:
        return "Qwen2MoeForCausalLM", "qwen2_moe"
    return "MixtralForCausalLM", "mixtral"


def check_exportable(model_cfg: ModelConfig, moe: MoEConfig) -> None:
    """Refuses, naming the first flag, a MoE model that neither class computes."""
    name = architecture(model_cfg, moe)[0]
    scaling = moe.moe_router_topk_scaling_factor
    refused = [
        (moe.moe_router_score_function != "softmax",
         f"--moe-router-score-function {moe.moe_router_score_function}"),
        (moe.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias"),
        (bool(moe.moe_router_group_topk),  # what makes routing group-limited (router.py)
         f"--moe-router-group-topk {moe.moe_router_group_topk} (group-limited routing)"),
        (scaling not in (None, 1.0), f"--moe-router-topk-scaling-factor {scaling}"),
        (moe.moe_expert_capacity_factor is not None,
         f"--moe-expert-capacity-factor {moe.moe_expert_capacity_factor}"),
        (bool(moe.moe_shared_expert_intermediate_size) and not moe.moe_shared_expert_gate,
         f"--moe-shared-expert-intermediate-size {moe.moe_shared_expert_intermediate_size} "
         "without --moe-shared-expert-gate (Qwen2-MoE's shared expert is sigmoid-gated)"),
        (bool(moe.moe_shared_expert_intermediate_size) and model_cfg.qk_layernorm,
         "--moe-shared-expert-intermediate-size with --qk-layernorm (Qwen3-MoE has no shared "
         "expert; Qwen2-MoE, which has, no qk-norm)"),
    ]
    if name == "MixtralForCausalLM":
        refused += [
            (moe.moe_router_pre_softmax, "--moe-router-pre-softmax (Mixtral renormalises its "
             "top k; Qwen3-MoE, with --qk-layernorm, has norm_topk_prob false for it)"),
            (model_cfg.add_qkv_bias, "--add-qkv-bias"),
            (not all(moe_layers(model_cfg, moe)),
             f"--moe-layer-freq {moe.moe_layer_freq} (every Mixtral layer is MoE; dense "
             "layers need Qwen3-MoE's mlp_only_layers, i.e. --qk-layernorm)")]
    for on, flag in refused:
        if on:
            raise ConfigError(f"{flag}: transformers' {name} has no such option, so this "
                              "mixture-of-experts model has no Hugging Face equivalent to "
                              "export to")


def check_full_experts(full: dict[str, Tensor], model_cfg: ModelConfig, moe: MoEConfig,
                       ckpt: object) -> None:
    """The gathered experts hold all E (an EP>1 checkpoint's files hold only their share)."""
    ffn = moe.moe_ffn_hidden_size or model_cfg.ffn_hidden_size
    for name, w in full.items():
        if name.endswith(".mlp.gate_up") and w.shape[0] != moe.num_experts * 2 * ffn:
            raise ConfigError(
                f"{ckpt}: {name} has {w.shape[0] // (2 * ffn)} of --num-experts "
                f"{moe.num_experts} experts; export reads checkpoints of "
                f"--expert-model-parallel-size 1 runs (this one: "
                f"{moe.expert_model_parallel_size}), whose files hold every expert")


def hf_config(model_cfg: ModelConfig, moe: MoEConfig) -> dict:
    """config.json keys of the MoE class (on top of the dense ones export writes)."""
    ffn = moe.moe_ffn_hidden_size or model_cfg.ffn_hidden_size
    common = {"num_experts_per_tok": moe.moe_router_topk, "output_router_logits": False,
              "router_aux_loss_coef": moe.moe_aux_loss_coeff}
    model_type = architecture(model_cfg, moe)[1]
    if model_type == "mixtral":
        return {**common, "num_local_experts": moe.num_experts, "intermediate_size": ffn,
                "sliding_window": None, "router_jitter_noise": 0.0}
    dense = [i for i, on in enumerate(moe_layers(model_cfg, moe)) if not on]
    out = {**common, "num_experts": moe.num_experts, "moe_intermediate_size": ffn,
           "intermediate_size": model_cfg.ffn_hidden_size, "decoder_sparse_step": 1,
           "mlp_only_layers": dense, "norm_topk_prob": not moe.moe_router_pre_softmax}
    if model_type == "qwen2_moe":
        out |= {"shared_expert_intermediate_size": moe.moe_shared_expert_intermediate_size,
                "qkv_bias": model_cfg.add_qkv_bias}
    return out


def to_hf(prefix: str, rest: str, w: Tensor, model_cfg: ModelConfig, moe: MoEConfig
          ) -> dict[str, Tensor]:
    """One of our MoE weights (`rest` in MOE_WEIGHTS) of layer `prefix` as per-expert
    Hugging Face tensors."""
    block, gate_name, up_name, down_name = _EXPERT_NAMES[architecture(model_cfg, moe)[1]]
    base = f"{prefix}{block}."
    if rest == "mlp.router.weight":
        return {base + "gate.weight": w}
    if rest in _SHARED_NAMES:
        return {prefix + _SHARED_NAMES[rest]: w}
    if rest == "mlp.shared.gate_up.weight":
        gate, up = w.chunk(2)
        return {prefix + "mlp.shared_expert.gate_proj.weight": gate,
                prefix + "mlp.shared_expert.up_proj.weight": up}
    experts, h = moe.num_experts, model_cfg.hidden_size
    if rest == "mlp.down":
        return {base + f"experts.{e}.{down_name}.weight": d
                for e, d in enumerate(w.view(experts, h, -1))}
    out = {}
    for e, stacked in enumerate(w.view(experts, -1, h)):
        gate, up = stacked.chunk(2)
        out |= {base + f"experts.{e}.{gate_name}.weight": gate,
                base + f"experts.{e}.{up_name}.weight": up}
    return out


def from_hf(hf: dict[str, Tensor], prefix: str, ours: str, model_type: str, experts: int
            ) -> dict[str, Tensor]:
    """Layer `prefix`'s MoE weights under our names (`ours` = "layers.{i}."), from the
    per-expert layout or transformers 5's fused one."""
    block, gate_name, up_name, down_name = _EXPERT_NAMES[model_type]
    base = f"{prefix}{block}."
    fused = hf.get(f"{prefix}mlp.experts.gate_up_proj")
    if fused is not None:  # transformers 5's own names, always under `mlp`
        gate_up = fused.flatten(0, 1)
        down = hf[f"{prefix}mlp.experts.down_proj"].flatten(0, 1)
        router = hf[f"{prefix}mlp.gate.weight"]
    else:
        try:
            gate_up = torch.cat([torch.cat([hf[base + f"experts.{e}.{gate_name}.weight"],
                                            hf[base + f"experts.{e}.{up_name}.weight"]])
                                 for e in range(experts)])
            down = torch.cat([hf[base + f"experts.{e}.{down_name}.weight"]
                              for e in range(experts)])
            router = hf[base + "gate.weight"]
        except KeyError as e:
            raise CheckpointError(f"the Hugging Face weights lack {e.args[0]} (a {model_type} "
                                  f"MoE layer with {experts} experts)") from None
    out = {ours + "mlp.gate_up": gate_up, ours + "mlp.down": down,
           ours + "mlp.router.weight": router}
    if model_type == "qwen2_moe":
        try:
            out |= {ours + name: hf[prefix + theirs] for name, theirs in _SHARED_NAMES.items()}
            out[ours + "mlp.shared.gate_up.weight"] = torch.cat(
                [hf[prefix + f"mlp.shared_expert.{x}_proj.weight"] for x in ("gate", "up")])
        except KeyError as e:
            raise CheckpointError(f"the Hugging Face weights lack {e.args[0]} (a qwen2_moe "
                                  "layer's shared expert)") from None
    return out


def model_fields_from_hf(config: dict) -> tuple[dict, MoEConfig]:
    """(ModelConfig fields that differ from the dense reading, our MoEConfig) of a Mixtral,
    Qwen3-MoE or Qwen2-MoE config.json."""
    model_type, layers = config["model_type"], config["num_hidden_layers"]
    # the published configs' names; transformers 5 saves both classes' as num_local_experts
    experts = config.get("num_local_experts", config.get("num_experts"))
    if model_type == "mixtral":
        if config.get("sliding_window"):
            raise CheckpointError(f"sliding_window {config['sliding_window']}: megatron_lite's "
                                  "attention is full causal; only Mixtral configs with "
                                  "sliding_window null import")
        moe = MoEConfig(num_experts=experts,
                        moe_router_topk=config.get("num_experts_per_tok", 2),
                        moe_ffn_hidden_size=config["intermediate_size"],
                        moe_aux_loss_coeff=config.get("router_aux_loss_coef", 0.0))
        return {"qk_layernorm": False, "add_qkv_bias": False}, moe
    step = config.get("decoder_sparse_step", 1)
    dense = set(config.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    freq = "1" if all(pattern) else "[" + ",".join(map(str, pattern)) + "]"
    moe = MoEConfig(num_experts=experts,
                    moe_router_topk=config.get("num_experts_per_tok", 8),
                    moe_ffn_hidden_size=config["moe_intermediate_size"],
                    moe_layer_freq=freq,
                    moe_router_pre_softmax=not config.get("norm_topk_prob", False),
                    moe_aux_loss_coeff=config.get("router_aux_loss_coef", 0.0))
    if model_type == "qwen2_moe":  # its shared expert is always there, always gated
        moe = replace(moe, moe_shared_expert_intermediate_size=config[
            "shared_expert_intermediate_size"], moe_shared_expert_gate=True)
        return {"qk_layernorm": False, "add_qkv_bias": config.get("qkv_bias", True)}, moe
    return {"qk_layernorm": True}, moe
