"""Megatron-LM's flags, as its own launch scripts use them, against our parser and its table.

LLAMA3_8B_* are the arrays of Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh as they
stand, bf16 path: mock data, paths under tmp, and the fp8 array kept apart.
"""

from __future__ import annotations

import pytest

from megatron_lite.arguments import (
    all_flags,
    build_parser,
    check_megatron_flags,
    megatron_flags,
    parse,
)
from megatron_lite.config import ConfigError
from pretrain import main

LLAMA3_8B_MODEL = [
    "--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096",
    "--ffn-hidden-size", "14336", "--num-attention-heads", "32", "--group-query-attention",
    "--num-query-groups", "8", "--kv-channels", "128", "--seq-length", "8192",
    "--max-position-embeddings", "8192", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0", "--swiglu", "--normalization", "RMSNorm",
    "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
]
LLAMA3_8B_TRAINING = [
    "--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples", "1953125000",
    "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252", "--lr", "0.00015",
    "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
    "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
    "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
    "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
]
LLAMA3_8B_FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
                 "--fp8-amax-compute-algo", "max", "--fp8-param-gather"]
LLAMA3_8B_PARALLEL = ["--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
                      "--sequence-parallel"]


def llama3_8b_data_and_logging(tmp: str) -> list[str]:
    return [
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256",
        "--data-cache-path", f"{tmp}/cache", "--tiktoken-pattern", "v2", "--split", "99,1,0",
        "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
        "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100",
        "--save-interval", "1000", "--log-throughput", "--profile", "--profile-step-start", "4",
        "--profile-step-end", "6", "--ckpt-format", "torch_dist",
        "--distributed-timeout-minutes", "60", "--save", f"{tmp}/ckpt", "--load", f"{tmp}/ckpt",
        "--tensorboard-dir", f"{tmp}/tb",
    ]


def test_llama3_8b_example_bf16_path_dry_runs_unchanged(tmp_path, capsys) -> None:
    argv = [*LLAMA3_8B_MODEL, *LLAMA3_8B_TRAINING, *LLAMA3_8B_PARALLEL,
            *llama3_8b_data_and_logging(str(tmp_path)), "--dry-run", "--world-size", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Megatron-LM flags taken" in out and "--normalization RMSNorm" in out


def test_llama3_8b_example_fp8_path_dry_runs(tmp_path, capsys) -> None:
    """The FP8 example's whole flag array (hybrid, delayed with 1024 steps of max history,
    --fp8-param-gather over the distributed optimizer) dry-runs on 8 ranks as it stands, and
    fits an 80 GB H100 by the planner (72.3 GiB: the FP8 weights' fp8 copy in place of most
    of their bf16 one, e4m3 saved inputs), as the bf16 path (81.7 GiB) does not."""
    argv = [*LLAMA3_8B_MODEL, *LLAMA3_8B_TRAINING, *LLAMA3_8B_FP8, *LLAMA3_8B_PARALLEL,
            *llama3_8b_data_and_logging(str(tmp_path)), "--dry-run", "--world-size", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "config is valid" in out and "unrecognized" not in out
    assert "fits," in out and "1 + 2/d in place of 2" in out


def _matching_values(rule: str, nargs: str) -> list[str]:
    if rule.startswith("in:"):
        return [rule.removeprefix("in:").split(",")[0]]
    if rule.startswith("="):
        return [rule[1:]]
    if rule == "head_dim":
        return ["16"]  # the default model: hidden 64 / 4 heads
    return [] if nargs == "0" else ["anything"]


@pytest.mark.quick
def test_every_table_flag_is_implemented_accepted_or_refused_by_name() -> None:
    """No Megatron flag reaches "unrecognized arguments": ours are our own flags, fixed ones
    parse and are taken with a matching value, refused ones stop naming the flag."""
    parser, ours = build_parser(), set(all_flags())
    cfg = parse([])[0]  # the default model, once: check_megatron_flags only reads it
    counts = {"ours": 0, "fixed": 0, "refused": 0}
    for row in megatron_flags():
        counts[row.kind] += 1
        for option in (row.flag, *row.aliases):
            assert (option in ours) == (row.kind == "ours"), f"{option}: the table says {row.kind}"
            if row.kind == "ours":
                continue
            argv = [option, *_matching_values(row.rule, row.nargs)]
            ns = parser.parse_args(argv)
            if row.kind == "fixed":
                assert check_megatron_flags(ns, cfg) == [" ".join(argv)]
            else:
                with pytest.raises(ConfigError, match=f"{option}: "):
                    check_megatron_flags(ns, cfg)
    assert all(counts.values()) and sum(counts.values()) > 800


def test_a_different_value_is_refused_naming_flag_value_and_model() -> None:
    with pytest.raises(ConfigError, match="--normalization LayerNorm: this model takes only "
                                          "--normalization RMSNorm"):
        parse(["--normalization", "LayerNorm"])
    with pytest.raises(ConfigError, match=r"--position-embedding-type none: .* "
                                          "--position-embedding-type rope"):
        parse(["--position-embedding-type", "none"])


def test_a_typo_gets_the_closest_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        parse(["--lr-decay-iter", "10"])
    assert "did you mean --lr-decay-iters?" in capsys.readouterr().err


def test_help_lists_the_megatron_flags_as_one_short_group() -> None:
    text = build_parser().format_help()
    assert "other Megatron-LM flags" in text and "megatron_flags.tsv" in text
    for hidden in ("--fp8-interval", "--moe-grouped-gemm", "--use-mcore-models"):
        assert hidden not in text
