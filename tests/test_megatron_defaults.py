"""A flag spelled as Megatron-LM spells it takes Megatron's default: every `ours` row of
megatron_flags.tsv against its megatron_default column (read from Megatron's parser), the
derived defaults written out as Megatron computes them, the start-up line for what this model
cannot take, the accepted no-op flags, and --deterministic-mode.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_lite.arguments import build_parser, megatron_flags, parse, parse_with_notes
from megatron_lite.config import (
    ConfigError,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    ddp_bucket_size,
    moe_layer_pattern,
)
from megatron_lite.parallel import determinism
from megatron_lite.training import _evaluation_due, run
from pretrain import main

REQUIRED = {
    "--num-layers": "validate_args: required_args (num_layers, or --encoder-num-layers)",
    "--hidden-size": "validate_args: required_args",
    "--num-attention-heads": "validate_args: required_args",
    "--seq-length": "validate_args asserts --encoder-seq-length is given when it is None",
    "--micro-batch-size": "validate_args: assert args.micro_batch_size is not None",
    "--lr": "OptimizerParamScheduler takes float(max_lr): None stops the run",
    "--vocab-size": "the tokenizer sets it (--tokenizer-type is required there; "
                    "NullTokenizer needs --vocab-size); a tokenizer sets it here too",
}
"""Megatron's parser default is None and Megatron does not run without a value: a development
default here changes no Megatron script that runs."""


def _distributed_backend(ours: object) -> bool:
    # auto is nccl whenever CUDA is there (Megatron's default, its only GPU backend); gloo on
    # CPU, where nccl cannot run.
    return ours == "auto"


def _sharding_strategy(ours: object) -> bool:
    # Megatron's optim_grads_params is read only under --use-megatron-fsdp; ours resolves
    # None to it there, and to the distributed optimizer's choice otherwise.
    return ours is None and ParallelConfig(
        use_megatron_fsdp=True).data_parallel_sharding_strategy == "optim_grads_params"


def _split(ours: object) -> bool:
    # validate_args turns a missing --split into '969, 30, 1' whenever --data-path is given.
    return ours is not None and [int(p) for p in str(ours).split(",")] == [969, 30, 1]


def _num_query_groups(ours: object) -> bool:
    # Megatron's 1 is read only under --group-query-attention (else every head has its own
    # K/V); ours resolves None to 1 there and to the head count without it.
    return ours is None and ModelConfig(num_attention_heads=8).num_query_groups == 8 and \
        ModelConfig(num_attention_heads=8, group_query_attention=True).num_query_groups == 1


def _moe_layer_freq(ours: object) -> bool:
    # Megatron's flag takes an int or a list expression, so ours is a string: "1" is its 1.
    return moe_layer_pattern(str(ours), 4) == [True] * 4


RESOLVED = {"--distributed-backend": _distributed_backend,
            "--data-parallel-sharding-strategy": _sharding_strategy, "--split": _split,
            "--num-query-groups": _num_query_groups, "--moe-layer-freq": _moe_layer_freq}
"""Megatron's parser value is only a placeholder that validate_args (or the flag it depends on)
resolves; each check shows ours resolves to the same."""


def _same(ours: object, megatron: object, nargs: str) -> bool:
    if nargs == "0" and megatron in (None, False) and ours in (None, False):
        return True  # a switch that is off: store_true with default None or False
    if megatron is None and ours == []:
        return True  # a list flag not given
    return ours == megatron


@pytest.mark.quick
def test_every_ours_flag_has_megatron_default() -> None:
    parser = build_parser()
    by_option = {s: a for a in parser._actions for s in a.option_strings}
    rows = {row.flag: row for row in megatron_flags() if row.kind == "ours"}
    wrong = []
    for flag, row in rows.items():
        ours = by_option[flag].default
        if flag in REQUIRED:
            assert row.default is None, f"{flag}: listed as required but Megatron has a default"
        elif flag in RESOLVED:
            if not RESOLVED[flag](ours):
                wrong.append(f"{flag}: ours {ours!r} does not resolve like Megatron's")
        elif not _same(ours, row.default, row.nargs):
            wrong.append(f"{flag}: ours {ours!r}, Megatron {row.megatron_default}")
    assert not wrong, "\n".join(wrong)
    assert set(REQUIRED) | set(RESOLVED) <= set(rows)


def test_swiglu_width_is_megatrons_floor_and_a_zero_width_is_refused() -> None:
    for h, want in ((4096, 10880), (64, 128), (2048, 5440), (48, 128), (24, 64)):
        assert (8 * h) // 3 // 64 * 64 == want  # 2/3 of 4h, down to a multiple of 64
        assert ModelConfig(hidden_size=h, num_attention_heads=4).ffn_hidden_size == want
    with pytest.raises(ConfigError, match=r"--hidden-size 16: .* pass --ffn-hidden-size"):
        ModelConfig(hidden_size=16)


def test_bucket_size_and_evaluation_follow_megatron() -> None:
    assert ddp_bucket_size(ParallelConfig(), 8) == 40_000_000
    assert ddp_bucket_size(ParallelConfig(), 64) == 64_000_000
    assert ddp_bucket_size(ParallelConfig(ddp_bucket_size=3000), 64) == 3000
    cfg = parse(["--train-iters", "2500"])[0]
    assert [i for i in range(1, 2501) if _evaluation_due(cfg, i)] == [2500]  # only at the end
    assert cfg.train.eval_iters == 100 and cfg.logging.log_interval == 100
    cfg.train.eval_interval = 1000
    assert [i for i in range(1, 2501) if _evaluation_due(cfg, i)] == [1000, 2000, 2500]
    assert TrainConfig().micro_batch_size == 2  # REQUIRED in Megatron: a development default


def test_startup_names_what_this_model_uses_instead(capsys) -> None:
    assert main(["--mock-data", "--dry-run", "--world-size", "1", "--normalization",
                 "RMSNorm", "--swiglu"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "defaults not taken" in ln]
    assert lines == ["Megatron-LM defaults not taken (this model's instead): "
                     "--position-embedding-type rope (Megatron: learned_absolute), "
                     "--disable-bias-linear (Megatron: linear biases), --hidden-dropout 0 "
                     "(Megatron: 0.1), --attention-dropout 0 (Megatron: 0.1), --rerun-mode: a "
                     "NaN/Inf loss or gradient skips the step on every rank (--on-nan skip), no "
                     "re-run (Megatron: validate_results)"]
    every = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
             "--disable-bias-linear", "--hidden-dropout", "0.0", "--attention-dropout", "0"]
    assert parse_with_notes([*every, "--rerun-mode", "disabled", "--on-nan", "stop"])[2] == []
    notes = parse_with_notes([*every, "--rerun-mode", "validate_results"])[2]
    assert len(notes) == 1 and notes[0].startswith("--rerun-mode validate_results: a NaN/Inf")
    notes = parse_with_notes([*every, "--rerun-mode", "disabled"])[2]
    assert len(notes) == 1 and "Megatron stops the run (--on-nan stop" in notes[0]


ACCEPTED = [["--timing-log-level", "0"], ["--timing-log-level", "2"],
            ["--rerun-mode", "disabled"], ["--rerun-mode", "validate_results"],
            ["--dist-ckpt-strictness", "log_all"], ["--use-persistent-ckpt-worker"],
            ["--ckpt-fully-parallel-save"], ["--no-ckpt-fully-parallel-save"],
            ["--ckpt-fully-parallel-load"], ["--auto-detect-ckpt-format"],
            ["--dist-ckpt-optim-fully-reshardable"]]
"""The no-op flags of Megatron's gpt3_mcore_reruns_* / *_swiglu functional-test configs."""


def test_megatron_noop_flags_are_taken_and_other_values_refused() -> None:
    for argv in ACCEPTED:
        assert parse(argv)[1] == [" ".join(argv)]
    for argv, named in ((["--rerun-mode", "report_determinism_stats"], "--rerun-mode"),
                        (["--timing-log-level", "3"], "--timing-log-level"),
                        (["--dist-ckpt-strictness", "strict"], "--dist-ckpt-strictness"),
                        (["--export-kd-teacher-model-config", "t"],
                         "--export-kd-teacher-model-config")):
        with pytest.raises(ConfigError, match=named):
            parse(argv)


def test_deterministic_mode_environment_is_checked_and_filled() -> None:
    env: dict[str, str] = {"NCCL_ALGO": "Ring,CollnetDirect"}
    assert determinism.env_errors(env) == []
    for name, value in (("NCCL_ALGO", "Tree"), ("NCCL_ALGO", "Ring,Tree"),
                        ("CUBLAS_WORKSPACE_CONFIG", ":0:0")):
        assert [e for e in determinism.env_errors({name: value}) if name in e]
    with pytest.raises(ConfigError, match="NCCL_ALGO made of Ring"):
        determinism.enable({"NCCL_ALGO": "Tree"})
    assert not torch.are_deterministic_algorithms_enabled()  # refused before switching


TINY = ["--mock-data", "--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "64",
        "--num-attention-heads", "2", "--seq-length", "16", "--vocab-size", "64",
        "--micro-batch-size", "2", "--train-iters", "3", "--eval-iters", "0", "--lr", "1e-2",
        "--peak-tflops", "1"]


def test_deterministic_mode_turns_deterministic_algorithms_on_and_repeats_bit_for_bit() -> None:
    saved = {k: os.environ.get(k) for k in determinism.ENV_DEFAULTS}
    for name in determinism.ENV_DEFAULTS:
        os.environ.pop(name, None)
    try:
        cfg = parse([*TINY, "--deterministic-mode"])[0]
        first = run(cfg).losses
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert os.environ["NCCL_ALGO"] == "Ring"
        second = run(parse([*TINY, "--deterministic-mode"])[0]).losses
        assert len(first) == 3 and first == second  # bit for bit
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, False
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
