"""MoE in the training loop: TP2, TP2+SP and PP2 (1F1B, zb-h1, zbv) equal one process
(float64), the expert-bias update against its formula, a checkpoint round trip with the biases,
a run whose loss falls, the FLOP count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_lite.arguments import parse_config
from megatron_lite.checkpoint.checkpointer import apply_checkpoint_args
from megatron_lite.config import Config, ConfigError, MoEConfig, ParallelConfig, validate
from megatron_lite.export import export
from megatron_lite.layers.moe import MoEStep
from megatron_lite.layers.router import RouterStats
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.planner import ModelShape, matmul_params
from megatron_lite.training import build_model, train
from tests.distributed import relayout, run_ranks
from tests.numerics import EXACT, assert_close

# Layer 0 dense, layers 1-3 MoE; sigmoid routing with a fast-moving expert bias (so that it
# changes routing within the run), aux and z losses, a gated shared expert, 4 experts of
# width 16.
FLAGS = ["--mock-data", "--num-layers", "4", "--hidden-size", "16", "--num-attention-heads",
         "2", "--ffn-hidden-size", "32", "--seq-length", "8", "--vocab-size", "61",
         "--make-vocab-size-divisible-by", "4", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-2", "--train-iters", "4", "--eval-iters", "0",
         "--peak-tflops", "1", "--fp64", "--log-interval", "1", "--num-experts", "4",
         "--moe-layer-freq", "([0]+[1]*3)", "--moe-ffn-hidden-size", "16",
         "--moe-shared-expert-intermediate-size", "8", "--moe-shared-expert-gate",
         "--moe-router-score-function",
         "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05",
         "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]
TERMS = ("loss", "grad_norm", "load_balancing_loss", "z_loss", "moe_load_imbalance")


def _run(pstate: ParallelState, flags: list[str], log: Path,
         terms: tuple[str, ...] = TERMS) -> dict[str, list[float]]:
    cfg = parse_config([*flags, "--log-jsonl", str(log)])
    apply_checkpoint_args(cfg, pstate.world_size)  # as training.run does
    train(cfg, pstate)
    if pstate.rank:
        return {}
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return {k: [r[k] for r in records if "grad_norm" in r] for k in terms}


def _layouts(world: ParallelState, tmp: str) -> dict[str, dict[str, list[float]]]:
    """TP2 with and without SP, then PP2 (layer 0 and 1 on the first stage)."""
    pstate = relayout(world, Config(parallel=ParallelConfig(tensor_model_parallel_size=2)))
    tp = ["--tensor-model-parallel-size", "2"]
    runs = {"tp2": _run(pstate, [*FLAGS, *tp], Path(tmp) / f"tp2-{world.rank}.jsonl"),
            "tp2-sp": _run(pstate, [*FLAGS, *tp, "--sequence-parallel"],
                           Path(tmp) / f"sp-{world.rank}.jsonl")}
    pstate = relayout(world, Config(parallel=ParallelConfig(pipeline_model_parallel_size=2)))
    pp = ["--pipeline-model-parallel-size", "2"]
    runs["pp2"] = _run(pstate, [*FLAGS, *pp], Path(tmp) / f"pp2-{world.rank}.jsonl")
    for schedule in ("zb-h1", "zbv"):  # the experts' weight gradients are not deferred
        runs[f"pp2-{schedule}"] = _run(pstate, [*FLAGS, *pp, "--pipeline-schedule", schedule],
                                       Path(tmp) / f"{schedule}-{world.rank}.jsonl")
    return runs


def test_tp2_sp_and_pp2_equal_one_process(tmp_path: Path) -> None:
    ref = _run(single_process_state(), FLAGS, tmp_path / "ref.jsonl")
    assert ref["moe_load_imbalance"][0] > 1 and ref["load_balancing_loss"][0] > 0
    got = run_ranks(_layouts, 2, tmp_path, tp=1, tmp=str(tmp_path))[0]
    for layout, run in got.items():
        for term in TERMS:
            for i, (a, b) in enumerate(zip(run[term], ref[term], strict=True)):
                assert_close(a, b, EXACT, f"{layout} {term} at {i + 1}")


def test_expert_bias_update_formula() -> None:
    """bias_e += rate x sign(mean_e' n_e' - n_e), per MoE layer, from the step's counts."""
    cfg = parse_config(FLAGS)
    chunks = build_model(cfg, single_process_state())
    step = MoEStep(cfg.moe, 4, single_process_state(), chunks)
    counts = {1: [5.0, 1.0, 3.0, 3.0], 2: [0.0, 8.0, 2.0, 2.0], 3: [2.0, 2.0, 2.0, 2.0]}
    step.begin(1)
    for layer, router in step.routers.items():
        router.stats = RouterStats(torch.tensor(counts[layer], dtype=torch.float64),
                                   torch.zeros((), dtype=torch.float64),
                                   torch.zeros((), dtype=torch.float64))
    out = step.end(update_bias=True)
    rate = torch.tensor(0.05, dtype=torch.float32)  # the bias is fp32, as in Megatron
    assert torch.equal(step.bias[1:], torch.stack([torch.tensor([-1, 1, 0, 0]) * rate,
                                                   torch.tensor([1, -1, 1, 1]) * rate,
                                                   torch.zeros(4)]))
    assert step.routers[1].expert_bias.data_ptr() == step.bias[1].data_ptr()
    assert abs(out["moe_load_imbalance"] - (5 / 3 + 8 / 3 + 1) / 3) < 1e-12
    assert MoEConfig().num_experts is None  # dense by default


def test_checkpoint_round_trip_keeps_expert_bias(tmp_path: Path) -> None:
    """4 steps straight equal 2 steps, save, load, 2 more: weights and the expert biases
    (which move routing at this update rate) come back, and --use-checkpoint-args restores
    the MoE flags with the model's shape."""
    pstate = single_process_state()
    straight = _run(pstate, FLAGS, tmp_path / "straight.jsonl")
    ckpt = ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    _run(pstate, [*FLAGS, *ckpt, "--exit-interval", "2"], tmp_path / "first.jsonl")
    dense_flags = FLAGS[:FLAGS.index("--num-experts")]  # --use-checkpoint-args brings the rest
    resumed = _run(pstate, [*dense_flags, *ckpt, "--load", str(tmp_path / "ckpt"),
                            "--use-checkpoint-args"], tmp_path / "second.jsonl")
    assert len(resumed["loss"]) == 2
    for a, b in zip(resumed["loss"], straight["loss"][2:], strict=True):
        assert_close(a, b, EXACT, "loss after resume")
    with pytest.raises(ConfigError, match="--moe-router-score-function sigmoid: transformers'"):
        export(tmp_path / "ckpt", tmp_path / "hf")


def test_expert_parallel_sizes_that_do_not_divide_are_refused_by_name() -> None:
    ep = ["--expert-model-parallel-size", "3"]
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 3 does not divide "
                                          "--num-experts 4"):
        validate(parse_config([*FLAGS, *ep]), 3)
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 3 x "
                                          "--expert-tensor-parallel-size 1 does not divide "
                                          "the 2 ranks of a pipeline stage"):
        validate(parse_config([*FLAGS, "--num-experts", "6", *ep]), 2)
    tp4 = ["--tensor-model-parallel-size", "4", "--num-attention-heads", "4"]
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size 3 does not divide "
                                          "--tensor-model-parallel-size 4"):
        validate(parse_config([*FLAGS, *tp4, "--sequence-parallel",
                               "--expert-tensor-parallel-size", "3"]), 4)
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size 2 below "
                                          "--tensor-model-parallel-size 4 needs "
                                          "--sequence-parallel"):
        validate(parse_config([*FLAGS, *tp4, "--expert-tensor-parallel-size", "2"]), 4)
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 4 x "
                                          "--expert-tensor-parallel-size 2 does not divide "
                                          "the 4 ranks"):
        validate(parse_config([*FLAGS, *tp4, "--sequence-parallel", "--expert-model-parallel-"
                               "size", "4", "--expert-tensor-parallel-size", "2"]), 4)
    dense = FLAGS[:FLAGS.index("--num-experts")]
    with pytest.raises(ConfigError, match="needs --num-experts"):
        validate(parse_config([*dense, "--expert-model-parallel-size", "2"]), 2)


def test_moe_pretrain_loss_falls(tmp_path: Path) -> None:
    """A tiny MoE model (top-2 of 4 softmax experts in every layer) learns the mock data's
    unigram and copy structure: the last 5 losses average well under the first."""
    flags = [f for f in FLAGS if f != "--fp64"]
    i = flags.index("--train-iters")
    flags[i + 1] = "40"
    for flag in ("--moe-router-score-function", "--moe-layer-freq"):
        j = flags.index(flag)
        del flags[j:j + 2]
    flags.remove("--moe-router-enable-expert-bias")
    losses = _run(single_process_state(), [*flags, "--num-layers", "2"],
                  tmp_path / "log.jsonl")["loss"]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses


def test_flops_count_active_parameters() -> None:
    """6N counts, in each MoE layer, the router and top-k experts + the shared expert instead
    of the dense MLP: here N by hand for FLAGS (layer 0 dense, 1-3 MoE)."""
    cfg = parse_config(FLAGS)
    shape = ModelShape.from_config(cfg.model, 1, cfg.moe)
    h, attention = 16, 16 * (16 + 2 * 16) + 16 * 16  # qkv + output projection
    dense_mlp, moe_mlp = 3 * h * 32, 4 * h + 3 * h * (2 * 16 + 8)
    n = 4 * attention + dense_mlp + 3 * moe_mlp + 64 * h  # vocab 61 padded to 64
    assert matmul_params(shape) == n
    assert matmul_params(ModelShape.from_config(cfg.model, 1)) == n - 3 * (moe_mlp - dense_mlp)
