"""The --dry-run summary: iterations, accumulation, tokens, memory against the device, the
planner under --grad-reduce-in-bf16, and the data flags checked without reading a shard."""

from __future__ import annotations

import json

import pytest

import pretrain
from megatron_lite.arguments import parse_config
from megatron_lite.data.format import write_manifest
from megatron_lite.dry_run import SUMMARY_KEYS, run_rank, summarize
from megatron_lite.planner import GIB, Cluster, estimate_memory, stage_params

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--vocab-size", "256", "--micro-batch-size", "2"]


@pytest.mark.quick
def test_summary_counts_steps_accumulation_tokens_and_fit() -> None:
    """DP 4 (TP 2 of 8 ranks), micro-batch 2, global batch 48: 6 micro-batches per step,
    48 x 32 tokens; 1000 samples are 1000 // 48 = 20 steps; the memory is the planner's
    largest stage plus its allowance, and fits exactly when the device holds that much."""
    flags = [*TINY, "--tensor-model-parallel-size", "2", "--global-batch-size", "48",
             "--train-samples", "1000", "--dry-run"]
    cfg = parse_config(flags)
    s = summarize(cfg, 8)
    assert (s.iters, s.grad_acc, s.grad_acc_start, s.tokens_per_step) == (20, 6, 6, 48 * 32)
    need = estimate_memory(cfg, 8).total_bytes / GIB + Cluster(gpus=8).allowance_gib
    assert s.mem_gib == pytest.approx(need, abs=0.01)
    assert (s.device_gib, s.fits, s.data_errors) == (80.0, True, [])
    small = summarize(parse_config([*flags, "--dry-run-device-memory-gb",
                                    f"{need / 2:.4f}"]), 8)
    assert (small.device_gib, small.fits) == (pytest.approx(need / 2, abs=1e-3), False)
    ramp = summarize(parse_config([*flags, "--rampup-batch-size", "16", "16", "64"]), 8)
    assert (ramp.grad_acc_start, ramp.grad_acc) == (2, 6)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads",
                                      "optim_grads_params"])
def test_planner_grads_in_bf16_match_the_measured_rank(strategy: str) -> None:
    """--grad-reduce-in-bf16 halves the gradient bytes (2 per parameter, sharded by ZeRO-2/3
    over d = 4); the planner says so and the meta-device rank measures the same."""
    cfg = parse_config([*TINY, "--bf16", "--grad-reduce-in-bf16", "--global-batch-size", "8",
                        "--data-parallel-sharding-strategy", strategy, "--dry-run"])
    r = run_rank(cfg, 4, 0, time_host=False)
    n = stage_params(cfg.model, 1, 1, 0, 2)
    owned = -(-n // 4) if strategy in ("optim_grads", "optim_grads_params") else n
    assert r.planner_grads_bytes == 2 * owned
    assert r.grads_bytes == pytest.approx(2 * owned, rel=0.01)


def _shard(prefix) -> None:
    """A .bin/.idx pair: empty, since the check only asks whether the files exist."""
    for ext in (".bin", ".idx"):
        prefix.with_name(prefix.name + ext).touch()


def test_data_flags_are_checked_without_reading_shards(tmp_path, capsys) -> None:
    """Each missing file is named by its flag and path; the good prefix and manifest pass;
    the dry run exits 2 after printing the summary; the JSONL summary lists the problems."""
    _shard(tmp_path / "good")
    _shard(tmp_path / "half")
    (tmp_path / "half.idx").unlink()
    write_manifest(tmp_path / "m.manifest.json", {
        "shards": [{"prefix": "good"}, {"prefix": "gone_0"}], "total_tokens": 20,
        "total_documents": 4})
    out = tmp_path / "dry.jsonl"
    rc = pretrain.main([*TINY, "--dry-run", "--world-size", "2", "--log-jsonl", str(out),
                        "--data-path", "0.5", str(tmp_path / "good"), "0.3",
                        str(tmp_path / "half"), "0.2", str(tmp_path / "m"),
                        "--tokenizer-model", str(tmp_path / "no.model"), "--split", "9,x"])
    captured = capsys.readouterr()
    assert rc == 2
    assert "mem_gib" in captured.out and "4 problem(s) in the data flags" in captured.out
    lines = [line.strip() for line in captured.err.splitlines()[1:]]
    assert lines[0].startswith(f"--tokenizer-model {tmp_path / 'no.model'}: no such file")
    assert lines[1].startswith(f"--data-path {tmp_path / 'half'}: {tmp_path / 'half.idx'} is "
                               "missing")
    assert lines[2].startswith(f"--data-path {tmp_path / 'm'}: 2 shard file(s)")
    assert f"{tmp_path / 'gone_0.bin'}, {tmp_path / 'gone_0.idx'}" in lines[2]
    assert lines[3].startswith("--split '9,x'") and len(lines) == 4
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert tuple(record) == SUMMARY_KEYS and len(record["data_errors"]) == 4


def test_good_data_flags_pass(tmp_path, capsys) -> None:
    _shard(tmp_path / "good")
    rc = pretrain.main([*TINY, "--dry-run", "--world-size", "2", "--train-data-path",
                        str(tmp_path / "good"), "--valid-data-path", str(tmp_path / "good")])
    assert rc == 0 and "data flags ok" in capsys.readouterr().out
