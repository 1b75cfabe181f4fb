"""Plan a parallel layout: predicted memory, step time, tokens/s and days for a model on a cluster.

    python scripts/plan.py --preset 8B --gpus 8
    python scripts/plan.py --preset 70B --gpus 1024 --tp 8 --pp 8     # check one layout family
    python scripts/plan.py --preset 8B --seq-length 131072 --gpus 64  # long context: CP
    python scripts/plan.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
        --seq-length 4096 --vocab-size 32000 --gpus 64 --gpu-memory-gib 40 --peak-tflops 312
    python scripts/plan.py --preset 8B --gpus 32 --pp 4 --timeline schedules.png \
        --timeline-microbatches 8                    # draw #1's pipeline schedules
    python scripts/plan.py --preset 8B --gpus 64 --hardware a100-80gb --explain  # #1's step
    python scripts/plan.py --preset 1B --gpus 8 --json                 # ranked plans as JSON
    python scripts/plan.py --preset 8B --gpus 64 --num-experts 8 --moe-router-topk 2 \
        --moe-ffn-hidden-size 14336                   # Mixtral-like MoE: EP searched
    python scripts/plan.py --block gpt --attention unfused --num-layers 24 --hidden-size 2304 \
        --num-attention-heads 24 --seq-length 2048 --vocab-size 51200 --global-batch-size 512 \
        --gpus 32 --hardware a100-80gb --tp 1 --recompute full     # a published 2021 GPT run

Memory lives in megatron_lite/planner.py, the step-time model in megatron_lite/plan_time.py
(assumptions in their docstrings; --hardware presets, flags override them; --calibration reads
what scripts/gpu_check.sh measured on a GPU). --hardware cpu measures this machine first (its
matmul rate, copy bandwidth, op dispatch, and SDPA at the model's heads and sequence).
Prints the best fitting layouts, the fastest ones that do not fit (with why), the pipeline
schedules ranked on the best plan's TP x CP x PP x DP x micro-batch (1F1B, interleaved, ZB-H1, ZBV:
step time, bubble, memory), and the pretrain.py flags of the best plan. --timeline draws those
schedules (stages x time, every F, B and W) as played by the schedule simulator
(tests/pipeline/simulator.py) on the real action lists, with F : B : W from the model's FLOPs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite import plan_time, schedules
from megatron_lite.config import ConfigError, ModelConfig, MoEConfig, TrainConfig
from megatron_lite.errors import add_debug_flag, run_cli
from megatron_lite.pipeline.schedule import build_schedule
from megatron_lite.planner import (
    BLOCKS,
    GIB,
    PRESETS,
    SHARDING,
    Cluster,
    Plan,
    RunOptions,
    efficiency_bound,
    model_shape,
    moe_total_params,
    pipeline_op_costs,
    pretrain_flags,
    search,
    total_params,
)
from megatron_lite.reliability.spikes import young_daly_interval_s
from megatron_lite.unattended import read_records

DEFAULT_HELP = {"peak_tflops": "dense bf16 TFLOP/s", "gemm_efficiency": "e_max of the GEMM curve",
                "gemm_half_dim": "its d_half", "hbm_gbps": "achieved GB/s",
                "intra_node_gbps": "NVLink bus GB/s", "inter_node_gbps": "network GB/s per GPU",
                "op_us": "fixed us per kernel",
                "attention_tflops": "attention kernel TFLOP/s, 0: the GEMM curve"}

_MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_query_groups", "seq_length", "vocab_size")


def _add_run_and_search_flags(ap: argparse.ArgumentParser) -> None:
    """How the planned run computes, and which layouts the search may return."""
    run = ap.add_argument_group("how the run computes")
    run.add_argument("--block", choices=BLOCKS, default="llama",
                     help="llama (ours) or gpt (LayerNorm, GeLU MLP of --ffn-hidden-size, "
                          "default 4h, learned positions; planning only)")
    run.add_argument("--attention", choices=["flash", "unfused"], default="flash",
                     help="unfused: materialised softmax + dropout (GPT as run in 2021)")
    run.add_argument("--grad-reduce-in-bf16", action="store_true",
                     help="store and reduce gradients over DP in 16 bits (memory and time, "
                          "as pretrain.py's flag)")
    run.add_argument("--fp32", action="store_true",
                     help="time fp32 activations (the CPU runs); memory stays bf16")
    fp8 = ap.add_argument_group("FP8 (pretrain.py's flags): memory only, the step time keeps "
                                "bf16 GEMMs")
    fp8.add_argument("--fp8-format", choices=["e4m3", "hybrid"],
                     help="FP8 linears: they save their inputs in 1 byte")
    fp8.add_argument("--fp8-recipe", choices=["tensorwise", "delayed", "rowwise"],
                     default="delayed")
    fp8.add_argument("--fp8-amax-history-len", type=int, default=1,
                     help="delayed recipe: the amax histories every rank keeps")
    fp8.add_argument("--fp8-param-gather", action="store_true",
                     help="the FP8 weights' e4m3 copy (and ZeRO's gathers in it)")
    moe = ap.add_argument_group("mixture of experts (pretrain.py's flags, Megatron's defaults)")
    moe.add_argument("--num-experts", type=int, help="routed experts per MoE layer")
    moe.add_argument("--moe-router-topk", type=int, default=2, help="experts per token")
    moe.add_argument("--moe-ffn-hidden-size", type=int,
                     help="one expert's SwiGLU width (default --ffn-hidden-size)")
    moe.add_argument("--moe-shared-expert-intermediate-size", type=int)
    moe.add_argument("--moe-layer-freq", default="1", help="which layers are MoE")
    moe.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"],
                     default="allgather")
    moe.add_argument("--expert-model-parallel-size", type=int,
                     help="EP size (default: searched over the divisors of the experts)")
    flt = ap.add_argument_group("restrict the search")
    for flag in ("tp", "cp", "pp", "dp", "vpp", "micro-batch-size"):
        flt.add_argument("--" + flag, type=int)
    flt.add_argument("--schedule", choices=list(schedules.NAMES))
    flt.add_argument("--sharding", choices=list(SHARDING),
                     help="--data-parallel-sharding-strategy (column ZeRO: its stage 0-3)")
    flt.add_argument("--recompute", choices=["none", "selective", "full"])
    ap.add_argument("--top", type=int, default=10, help="fitting layouts to print")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = ap.add_argument_group("model (a preset, or flags; flags override the preset)")
    model.add_argument("--preset", choices=sorted(PRESETS, key=lambda k: PRESETS[k][1].num_layers
                                                  * PRESETS[k][1].hidden_size))
    for name in _MODEL_FLAGS:
        model.add_argument("--" + name.replace("_", "-"), type=int)
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    model.add_argument("--global-batch-size", type=int, help="sequences per step")
    model.add_argument("--train-tokens", type=float, help="token budget (default 20 x params)")
    cl = ap.add_argument_group("cluster (a --hardware preset in nodes of 8; flags override it)")
    cl.add_argument("--gpus", type=int, required=True)
    cl.add_argument("--hardware", choices=sorted(plan_time.PRESETS), default="h100-sxm",
                    help="device preset (default h100-sxm; cpu: measured on this machine)")
    cl.add_argument("--calibration", metavar="FILE",
                    help="GEMM, bandwidth and collective timings written by scripts/gpu_check.sh"
                         " (its calibrate part): replace the preset's curve and bandwidths")
    for f in dataclasses.fields(Cluster):
        if f.name == "gpus" or isinstance(f.default, bool):
            continue
        cl.add_argument("--" + f.name.replace("_", "-"), type=type(f.default),
                        help=f"(default: the preset's; {DEFAULT_HELP.get(f.name, '')})")
    cl.add_argument("--no-dp-overlap", action="store_true",
                    help="DP collectives fully exposed (no --overlap-grad-reduce)")
    cl.add_argument("--tp-comm-overlap", action="store_true",
                    help="TP collectives hidden behind the layers' GEMMs (Megatron's flag)")
    _add_run_and_search_flags(ap)
    ckpt = ap.add_argument_group("checkpoint interval (Young/Daly)")
    ckpt.add_argument("--save-seconds", type=_save_seconds, metavar="S|RUN.jsonl",
                      help="measured time a save blocks training: seconds, or a run's "
                      "--log-jsonl file (the median of its checkpoint_save_s)")
    ckpt.add_argument("--mtbf-hours", type=float, help="job-level mean time between failures")
    out = ap.add_argument_group("output")
    out.add_argument("--json", action="store_true",
                     help="print the ranked layouts as a JSON list instead of the report")
    out.add_argument("--explain", type=int, nargs="?", const=1, metavar="N",
                     help="break plan #N's step time down (default #1)")
    pic = ap.add_argument_group("picture")
    pic.add_argument("--timeline", metavar="OUT.png",
                     help="draw #1's pipeline schedules (stages x time) into this PNG")
    pic.add_argument("--timeline-microbatches", type=int, metavar="M",
                     help="micro-batches to draw (default #1's; fewer keep the boxes readable)")
    add_debug_flag(ap)
    return ap


def model_from_args(args: argparse.Namespace) -> tuple[ModelConfig, int]:
    """The preset (if any) with flag overrides, and the global batch."""
    base, gbs = (PRESETS[args.preset][1], PRESETS[args.preset][2]) if args.preset else (None, None)
    fields = dataclasses.asdict(base) if base else {}
    for name in (*_MODEL_FLAGS, "untie_embeddings_and_output_weights"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if base:
        fields["max_position_embeddings"] = fields["seq_length"]
    missing = [n for n in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                           "vocab_size") if n not in fields]
    if missing:
        raise ConfigError("give --preset or " +
                          ", ".join("--" + n.replace("_", "-") for n in missing))
    if args.block == "gpt" and fields.get("ffn_hidden_size") is None:
        fields["ffn_hidden_size"] = 4 * fields["hidden_size"]  # GPT's GeLU MLP
    if not base:
        fields.setdefault("ffn_hidden_size", None)
        fields.setdefault("num_query_groups", None)
    gbs = args.global_batch_size or gbs
    if gbs is None:
        raise ConfigError("give --global-batch-size (sequences per step)")
    return ModelConfig(**fields), gbs


def cluster_from_args(args: argparse.Namespace, model: ModelConfig) -> Cluster:
    """The --hardware preset (cpu: measured now, attention at `model`'s heads and sequence),
    the --calibration file over it, then the flags over both."""
    hw = plan_time.PRESETS[args.hardware]
    if args.hardware == "cpu":
        hw = plan_time.cpu_hardware(model_shape(model, 1, args.block), model.seq_length,
                                    4 if args.fp32 else 2)
    if args.calibration:
        hw = plan_time.load_calibration(args.calibration, hw)
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(Cluster)
             if f.name != "gpus" and not isinstance(f.default, bool)
             and getattr(args, f.name) is not None}
    bad = [k for k, v in flags.items() if k != "allowance_gib" and v <= 0]
    if bad:
        raise ConfigError(f"--{bad[0].replace('_', '-')} {flags[bad[0]]}: give a positive "
                          "number")
    return Cluster.from_hardware(args.gpus, hw, dp_overlap=not args.no_dp_overlap,
                                 tp_overlap=args.tp_comm_overlap, **flags)


def moe_from_args(args: argparse.Namespace, model: ModelConfig) -> MoEConfig | None:
    """The MoE flags as pretrain.py's MoEConfig (None without --num-experts)."""
    ep = args.expert_model_parallel_size
    if args.num_experts is None:
        if ep is not None:
            raise ConfigError(f"--expert-model-parallel-size {ep} needs --num-experts (a "
                              "dense model has no experts to split)")
        return None
    experts, topk = args.num_experts, args.moe_router_topk
    if experts < 1 or not 1 <= topk <= experts:
        raise ConfigError(f"--num-experts {experts} --moe-router-topk {topk}: give "
                          "1 <= top-k <= experts")
    if ep is not None and (ep < 1 or experts % ep):
        raise ConfigError(f"--expert-model-parallel-size {ep} does not divide --num-experts "
                          f"{experts}; pick a divisor of the experts")
    moe = MoEConfig(num_experts=experts, moe_router_topk=topk,
                    moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                    moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                    moe_layer_freq=args.moe_layer_freq,
                    moe_token_dispatcher_type=args.moe_token_dispatcher_type,
                    expert_model_parallel_size=ep or 1)
    moe_total_params(model, moe)  # a --moe-layer-freq that does not fit the layers fails here
    return moe


def options_from_args(args: argparse.Namespace, model: ModelConfig) -> RunOptions:
    return RunOptions(args.block, args.attention, 2 if args.grad_reduce_in_bf16 else 4,
                      dtype_bytes=4 if args.fp32 else 2, moe=moe_from_args(args, model),
                      fp8=fp8_from_args(args))


def fp8_from_args(args: argparse.Namespace) -> TrainConfig | None:
    """The FP8 flags as pretrain.py's TrainConfig holds them (None without --fp8-format)."""
    if args.fp8_format is None:
        if args.fp8_param_gather:
            raise ConfigError("--fp8-param-gather needs FP8 linears: add --fp8-format hybrid "
                              "(or e4m3)")
        return None
    if args.fp8_recipe == "rowwise" and args.fp8_param_gather:
        raise ConfigError("--fp8-param-gather needs one tensorwise scale per weight: drop it "
                          "or use --fp8-recipe delayed or tensorwise with it")
    if args.fp8_amax_history_len < 1:
        raise ConfigError(f"--fp8-amax-history-len {args.fp8_amax_history_len}: give 1 or more")
    return TrainConfig(bf16=True, fp8_format=args.fp8_format, fp8_recipe=args.fp8_recipe,
                       fp8_amax_history_len=args.fp8_amax_history_len,
                       fp8_param_gather=args.fp8_param_gather)


def fp8_flags(fp8: TrainConfig | None) -> list[str]:
    """pretrain.py's FP8 flags for a plan."""
    if fp8 is None:
        return []
    flags = ["--fp8-format", fp8.fp8_format, "--fp8-recipe", fp8.fp8_recipe]
    if fp8.fp8_recipe == "delayed":
        flags += ["--fp8-amax-history-len", str(fp8.fp8_amax_history_len)]
    return flags + (["--fp8-param-gather"] if fp8.fp8_param_gather else [])


def moe_flags(moe: MoEConfig | None, plan: Plan) -> list[str]:
    """pretrain.py's MoE flags for a plan (with its EP size)."""
    if moe is None:
        return []
    flags = ["--num-experts", moe.num_experts, "--moe-router-topk", moe.moe_router_topk]
    for flag, value in (("--moe-ffn-hidden-size", moe.moe_ffn_hidden_size),
                        ("--moe-shared-expert-intermediate-size",
                         moe.moe_shared_expert_intermediate_size)):
        if value:
            flags += [flag, value]
    if moe.moe_layer_freq != "1":
        flags += ["--moe-layer-freq", f"'{moe.moe_layer_freq}'"]
    flags += ["--moe-token-dispatcher-type", moe.moe_token_dispatcher_type,
              "--expert-model-parallel-size", plan.layout.ep]
    return [str(f) for f in flags]


def _keep(args: argparse.Namespace):
    def keep(lay) -> bool:
        checks = ((args.tp, lay.tp), (args.cp, lay.cp), (args.pp, lay.pp), (args.dp, lay.dp),
                  (args.vpp, lay.chunks), (args.micro_batch_size, lay.micro_batch))
        if any(want is not None and want != have for want, have in checks):
            return False
        if args.schedule is not None and args.schedule != lay.schedule_name:
            return False
        if args.sharding is not None and args.sharding != lay.sharding:
            return False
        return args.recompute is None or args.recompute == lay.recompute.granularity
    return keep


HEADER = (f"{'#':>3} {'TP':>3} {'CP':>3} {'PP':>3} {'schedule':>11} {'v':>3} {'DP':>5} {'mbs':>4} "
          f"{'m':>5} {'EP':>3} {'ZeRO':>5} {'recompute':>10} {'states':>7} {'acts':>6} "
          f"{'total':>6} "
          f"{'step s':>7} {'bubble':>6} {'tok/s/GPU':>10} {'MFU':>5} {'days':>7} {'MFUnc':>5} "
          f"{'HFU':>5}")


def row(i: int, plan: Plan, gpus: int) -> str:
    lay, mem = plan.layout, plan.memory
    return (f"{i:>3} {lay.tp:>3} {lay.cp:>3} {lay.pp:>3} {lay.schedule_name:>11} {lay.chunks:>3} "
            f"{lay.dp:>5} {lay.micro_batch:>4} "
            f"{plan.microbatches:>5} {lay.ep:>3} {lay.zero_stage:>5} "
            f"{lay.recompute.label():>10} {mem.state_bytes / GIB:>7.1f} "
            f"{mem.activation_bytes / GIB:>6.1f} {plan.need_gib:>6.1f} {plan.step_s:>7.2f} "
            f"{plan.bubble_s / plan.step_s:>6.1%} {plan.tokens_per_s / gpus:>10,.0f} "
            f"{plan.mfu:>5.1%} {plan.days:>7.1f} {plan.mfu_noncausal:>5.1%} "
            f"{plan.hfu:>5.1%}")


def report(model: ModelConfig, cluster: Cluster, gbs: int, tokens: float, plans: list[Plan],
           top: int, moe: MoEConfig | None = None, fp8: TrainConfig | None = None,
           grad_bf16: bool = False) -> str:
    n, active = moe_total_params(model, moe) if moe else (total_params(model), 0)
    experts = (f" ({active / 1e9:.2f}B active: {moe.num_experts} experts, top-"
               f"{moe.moe_router_topk}, {moe.moe_token_dispatcher_type} dispatch)" if moe else "")
    lines = [f"model: {n / 1e9:.2f}B params{experts}, {model.num_layers} layers, "
             f"h {model.hidden_size}, "
             f"ffn {model.ffn_hidden_size}, heads {model.num_attention_heads}/"
             f"{model.num_query_groups} KV, seq {model.seq_length}, vocab {model.vocab_size}",
             f"cluster: {cluster.gpus} GPUs ({cluster.gpus_per_node}/node), "
             f"{cluster.gpu_memory_gib:g} GiB, {cluster.peak_tflops:g} TFLOP/s, GEMMs at "
             f"{cluster.gemm_efficiency:.0%} x d/(d + {cluster.gemm_half_dim:g}), HBM "
             f"{cluster.hbm_gbps:g} GB/s, NVLink {cluster.intra_node_gbps:g} GB/s, "
             f"network {cluster.inter_node_gbps:g} GB/s per GPU, "
             + (f"attention kernel {cluster.attention_tflops:.3g} TFLOP/s, "
                if cluster.attention_tflops else "") + "allowance "
             f"{cluster.allowance_gib:g} GiB",
             f"batch {gbs} x {model.seq_length} = {gbs * model.seq_length / 1e6:.2f}M tokens; "
             f"budget {tokens / 1e9:,.0f}B tokens",
             "memory in GiB on the fullest rank; bubble = share of the step; MFU counts "
             "6N + 6·l·q·s per token, causal attention (the training log's `mfu_causal`; not "
             "recompute); MFUnc counts attention as if not causal (12·l·q·s, the log's `mfu`); "
             "HFU adds to MFU what recomputation reruns",
             ""]
    if fp8 is not None:
        lines[-1:-1] = [f"FP8 ({fp8.fp8_format}, {fp8.fp8_recipe}): memory counts what the FP8 "
                        "linears save in 1 byte, the e4m3 weight copies (--fp8-param-gather) "
                        "and the amax histories; step time, MFU and HFU keep bf16 GEMMs and "
                        "the bf16 peak (FP8's speed is measured by scripts/gpu_check.sh, not "
                        "assumed)"]
    fitting = [p for p in plans if p.fits]
    bound = efficiency_bound(cluster)
    if any(p.mfu_noncausal > bound for p in fitting[:top]):
        lines += [f"note: MFUnc above the {bound:.0%} the time model allows counts the masked "
                  f"half of attention at seq {model.seq_length}, which is never computed; "
                  "MFU and HFU are what runs", ""]
    lines += ["fitting layouts, fastest first:", HEADER]
    lines += [row(i + 1, p, cluster.gpus) for i, p in enumerate(fitting[:top])] or ["  (none)"]
    best = fitting[0].tokens_per_s if fitting else 0.0
    faster = [p for p in plans if not p.fits and p.tokens_per_s > best][:5]
    if faster:
        lines += ["", "faster layouts that do NOT fit:", HEADER]
        for i, plan in enumerate(faster):
            lines += [row(i + 1, plan, cluster.gpus), f"      {plan.reason}"]
    if not fitting and plans:
        lines += ["", "closest to fitting:", HEADER, row(1, plans[0], cluster.gpus),
                  f"      {plans[0].reason}"]
    if fitting and fitting[0].layout.pp > 1:
        lines += ["", "pipeline schedules on #1's TP x CP x PP x DP x micro-batch (each with its "
                  "fastest fitting recompute and, interleaved, v), fastest first:", HEADER]
        lines += [row(i + 1, p, cluster.gpus) + ("" if p.fits else f"  (does not fit: "
                                                  f"{p.reason})")
                  for i, p in enumerate(schedule_ranking(plans, fitting[0]))]
    if fitting:
        lines += ["", "pretrain.py flags for #1:", " ".join(
            pretrain_flags(model, fitting[0], gbs) + moe_flags(moe, fitting[0])
            + fp8_flags(fp8) + (["--grad-reduce-in-bf16"] if grad_bf16 else []))]
    return "\n".join(lines)


def plan_record(plan: Plan, gpus: int) -> dict:
    """One plan for --json: the layout, its times (s) and utilisations (fractions)."""
    lay = plan.layout
    return {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp,
            "schedule": lay.schedule_name, "vpp": lay.chunks, "ep": lay.ep,
            "micro_batch_size": lay.micro_batch,
            "microbatches": plan.microbatches, "sharding": lay.sharding,
            "sequence_parallel": lay.sequence_parallel, "recompute": lay.recompute.label(),
            "step_s": plan.step_s, "mfu": plan.mfu, "mfu_noncausal": plan.mfu_noncausal,
            "hfu": plan.hfu, "hfu_noncausal": plan.hfu_noncausal,
            "tokens_per_s_per_gpu": plan.tokens_per_s / gpus, "days": plan.days,
            "memory_gib": plan.need_gib, "fits": plan.fits, "reason": plan.reason,
            "breakdown_s": dict(breakdown(plan))}


def breakdown(plan: Plan) -> list[tuple[str, float]]:
    """The step's parts (they add up to step_s)."""
    return [("GEMM compute", plan.compute_s), ("memory-bound work", plan.memory_s),
            ("kernel overhead", plan.overhead_s), ("exposed TP communication", plan.tp_comm_s),
            ("PP p2p + exposed CP ring", plan.p2p_s), ("pipeline bubble", plan.bubble_s),
            ("exposed DP communication", plan.dp_exposed_s), ("optimizer step", plan.optimizer_s),
            ("MoE token dispatch over EP", plan.ep_comm_s)]


def explain(plan: Plan, index: int, gpus: int) -> str:
    """--explain: plan #index's step time by part, in ms and % of the step."""
    lay = plan.layout
    lines = [f"step time of #{index}: TP {lay.tp} CP {lay.cp} PP {lay.pp} ({lay.schedule_name}"
             f", v {lay.chunks}) DP {lay.dp}, micro-batch {lay.micro_batch} x "
             f"{plan.microbatches}, ZeRO {lay.zero_stage}, recompute {lay.recompute.label()}"]
    lines += [f"  {name:<26} {1e3 * s:>11,.1f} ms {s / plan.step_s:>6.1%}"
              for name, s in breakdown(plan)]
    lines += [f"  {'step':<26} {1e3 * plan.step_s:>11,.1f} ms",
              f"  tokens/s/GPU {plan.tokens_per_s / gpus:,.0f}; MFU {plan.mfu:.1%} (attention "
              f"counted non-causal {plan.mfu_noncausal:.1%}), HFU {plan.hfu:.1%} (non-causal "
              f"{plan.hfu_noncausal:.1%})"]
    return "\n".join(lines)


def schedule_ranking(plans: list[Plan], best: Plan) -> list[Plan]:
    """The best plan of each pipeline schedule among `plans` with `best`'s TP, PP, DP, micro-
    batch and sharding (plans come sorted, fitting and fastest first)."""
    same = ("tp", "cp", "pp", "dp", "micro_batch", "sharding")
    ranked: dict[str, Plan] = {}
    for plan in plans:
        if all(getattr(plan.layout, k) == getattr(best.layout, k) for k in same):
            ranked.setdefault(plan.layout.schedule_name, plan)
    return list(ranked.values())


@dataclasses.dataclass(frozen=True)
class Timeline:
    """One schedule as the simulator played it."""

    name: str
    chunks: int
    slots: list  # per stage: zero_bubble.Slot's
    makespan: float
    bubble: float


def play(name: str, pp: int, chunks: int, microbatches: int,
         op_costs: tuple[float, float, float]) -> Timeline:
    """The action lists of schedule `name` played by the simulator, with F, B and W scaled so
    that one stage's micro-batch (F + B + W) takes 1."""
    from tests.pipeline.simulator import simulate  # the checker of every action list

    sched = schedules.get(name)
    if sched.microbatches_multiple_of_pp and microbatches % pp:
        raise ConfigError(f"--timeline-microbatches {microbatches}: the {name} schedule "
                          f"needs a multiple of PP = {pp}")
    f, b, w = (x / sum(op_costs) for x in op_costs)
    chunks = sched.stage_chunks(chunks)
    schedule = build_schedule(pp, microbatches, chunks, kind=name, costs=(f, b, w))
    result = simulate(schedule, microbatches, chunks, f, b + w,
                      weight_time=w if sched.split_backward else None, v_shape=sched.v_shape)
    return Timeline(name, chunks, result.slots, result.makespan, result.bubble)


def draw_timeline(path: Path, lines: list[Timeline], pp: int, microbatches: int) -> None:
    """One panel per schedule, a row per stage, a box per compute: micro-batch = colour,
    F light, B dark, W hatched; white gaps are the bubble."""
    try:
        import matplotlib
    except ImportError as err:
        raise ConfigError("--timeline needs matplotlib: pip install matplotlib (it is in "
                          "requirements-dev.txt)") from err
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colours = plt.get_cmap("tab10" if microbatches <= 10 else "tab20")
    shade = {"F": 0.45, "B": 1.0, "W": 0.8}
    fig, axes = plt.subplots(len(lines), 1, figsize=(12, 0.45 * pp * len(lines) + 1.2),
                             sharex=True, squeeze=False)
    for ax, line in zip(axes[:, 0], lines):
        for stage, slots in enumerate(line.slots):
            for s in slots:
                colour = colours(s.microbatch % colours.N)
                ax.barh(stage, s.end - s.start, left=s.start, height=0.85, color=colour,
                        alpha=shade[s.kind], hatch="//" if s.kind == "W" else None,
                        edgecolor="black", linewidth=0.3)
                if microbatches <= 16 and (s.end - s.start) * 60 >= line.makespan:
                    label = f"{s.microbatch}" + (f".{s.chunk}" if line.chunks > 1 else "")
                    ax.text((s.start + s.end) / 2, stage, label, ha="center", va="center",
                            fontsize=6)
        ax.set_yticks(range(pp), [f"stage {r}" for r in range(pp)], fontsize=8)
        ax.set_ylim(pp - 0.5, -0.5)
        v = f", v = {line.chunks}" if line.chunks > 1 else ""
        ax.set_title(f"{line.name}{v}: step {line.makespan:.2f}, bubble {line.bubble:.1%}",
                     fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time (one stage's F + B + W of a micro-batch = 1)")
    fig.legend(handles=[Patch(facecolor="grey", alpha=0.45, label="F"),
                        Patch(facecolor="grey", label="B (input grad where W is split off)"),
                        Patch(facecolor="grey", alpha=0.8, hatch="//", label="W")],
               loc="upper right", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"PP = {pp}, {microbatches} micro-batches (colour = micro-batch; "
                 "label micro-batch.chunk)", fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


def _save_seconds(text: str) -> float:
    """A number, or the median checkpoint_save_s of a --log-jsonl file."""
    try:
        return float(text)
    except ValueError:
        pass
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: neither seconds nor a JSONL file")
    saves = sorted(r["checkpoint_save_s"] for r in read_records(path) if "checkpoint_save_s" in r)
    if not saves:
        raise argparse.ArgumentTypeError(f"{text}: no checkpoint_save_s records (no save yet)")
    return saves[len(saves) // 2]


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.timeline_microbatches is not None and (args.timeline is None
                                                   or args.timeline_microbatches < 1):
        raise ConfigError(f"--timeline-microbatches {args.timeline_microbatches}: give a "
                          "positive number, with --timeline OUT.png")
    model, gbs = model_from_args(args)
    cluster, opts = cluster_from_args(args, model), options_from_args(args, model)
    if args.tp and args.tp > cluster.gpus_per_node:
        raise ConfigError(f"--tp {args.tp}: TP wider than a node ({cluster.gpus_per_node} GPUs, "
                          "--gpus-per-node): its all-reduces in every layer need NVLink; use "
                          f"--tp {cluster.gpus_per_node} or less and PP/DP across nodes")
    tokens = args.train_tokens or 20 * (moe_total_params(model, opts.moe)[1] if opts.moe
                                        else total_params(model))
    plans = search(model, cluster, gbs, tokens, keep=_keep(args), opts=opts)
    if not plans:
        raise ConfigError("no valid layout (check that --global-batch-size is divisible by "
                          "dp x micro-batch and the filters agree with the GPU count)")
    if args.json:
        print(json.dumps([plan_record(p, cluster.gpus) for p in plans[:args.top]], indent=1))
        return 0
    print(report(model, cluster, gbs, tokens, plans, args.top, opts.moe, opts.fp8,
                 args.grad_reduce_in_bf16))
    fitting = [p for p in plans if p.fits]
    if args.save_seconds and args.mtbf_hours and fitting:
        best = young_daly_interval_s(args.save_seconds, 3600 * args.mtbf_hours)
        print(f"checkpoint interval (Young/Daly, a save blocks {args.save_seconds:.3g} s, MTBF "
              f"{args.mtbf_hours:g} h): every {best / 60:.1f} min = --save-interval "
              f"{max(1, round(best / fitting[0].step_s))} at #1's {fitting[0].step_s:.3g} s/step")
    if args.explain is not None:
        if not 1 <= args.explain <= len(plans):
            raise ConfigError(f"--explain {args.explain}: give 1 to {len(plans)} (the plans "
                              "ranked above, fitting first)")
        print("\n" + explain(plans[args.explain - 1], args.explain, cluster.gpus))
    if args.timeline:
        fitting = [p for p in plans if p.fits]
        if not fitting or fitting[0].layout.pp == 1:
            raise ConfigError("--timeline: " + ("the best fitting plan has no pipeline "
                                                "(PP = 1); ask for one with --pp N" if fitting
                                                else "no layout fits, nothing to draw"))
        ranked = schedule_ranking(plans, fitting[0])
        m = args.timeline_microbatches or fitting[0].microbatches  # validated >= 1 above
        costs = pipeline_op_costs(model, fitting[0].layout.tp)
        lines = [play(p.layout.schedule_name, p.layout.pp, p.layout.chunks, m, costs)
                 for p in ranked]
        draw_timeline(Path(args.timeline), lines, fitting[0].layout.pp, m)
        print(f"wrote {args.timeline}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Impossible model flags or filters end in one `error:` line and exit status 2."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
