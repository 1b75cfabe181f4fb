"""Megatron's checkpoint flags: --finetune, --no-load-optim, --no-load-rng,
--use-checkpoint-args, --use-checkpoint-opt_param-scheduler."""

from __future__ import annotations

from megatron_lite.arguments import parse_config
from megatron_lite.training import run

TINY = ["--mock-data", "--seed", "3", "--lr", "3e-3", "--eval-iters", "0", "--peak-tflops", "1",
        "--log-interval", "1"]


def test_finetune_loads_weights_only_and_starts_at_iteration_0(tmp_path) -> None:
    first = ["--save", str(tmp_path / "a")]
    run(parse_config([*TINY, "--train-iters", "4", *first]))
    fresh = run(parse_config([*TINY, "--train-iters", "2"]))
    tuned = run(parse_config([*TINY, "--train-iters", "2", "--load", str(tmp_path / "a"),
                              "--finetune", "--save", str(tmp_path / "b")]))
    assert tuned.iteration == 2 and len(tuned.losses) == 2
    assert tuned.losses[0] < fresh.losses[0]  # the same first batch, on trained weights
    assert (tmp_path / "b" / "latest").read_text().strip() == "iter_0000002"


def test_no_load_optim_resumes_with_a_fresh_optimizer(tmp_path) -> None:
    save = ["--save", str(tmp_path / "ckpt")]
    decay = ["--lr-decay-iters", "5"]  # one schedule for both halves, or the resume is refused
    run(parse_config([*TINY, *decay, "--train-iters", "3", *save]))
    exact = run(parse_config([*TINY, *decay, "--train-iters", "5", "--load",
                              str(tmp_path / "ckpt")]))
    fresh_adam = run(parse_config([*TINY, "--train-iters", "5", "--load",
                                   str(tmp_path / "ckpt"), "--no-load-optim", "--no-load-rng"]))
    assert len(exact.losses) == len(fresh_adam.losses) == 2
    assert fresh_adam.losses[0] == exact.losses[0]  # same weights and batch
    assert fresh_adam.losses[1] != exact.losses[1]  # Adam restarted from zero moments


def test_model_shape_and_schedule_from_the_checkpoint(tmp_path) -> None:
    save = ["--save", str(tmp_path / "ckpt")]
    run(parse_config([*TINY, "--train-iters", "2", "--num-layers", "3", "--lr-warmup-iters",
                      "1", *save]))
    cfg = parse_config([*TINY, "--train-iters", "3", "--lr", "1.0", *save,
                        "--use-checkpoint-args", "--use-checkpoint-opt_param-scheduler"])
    result = run(cfg)
    assert cfg.model.num_layers == 3 and cfg.optim.lr == 3e-3 and cfg.optim.lr_warmup_iters == 1
    assert result.iteration == 3 and len(result.losses) == 1
