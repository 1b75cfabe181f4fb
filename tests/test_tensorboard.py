"""TensorBoard event files, the torch.profiler trace and --manual-gc."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_lite.arguments import parse_config
from megatron_lite.config import ConfigError
from megatron_lite.profiling import StepHooks
from megatron_lite.training import run

TINY = ["--mock-data", "--eval-iters", "2", "--eval-interval", "10", "--peak-tflops", "1",
        "--log-interval", "1"]


@pytest.mark.quick
def test_tensorboard_holds_the_jsonl_losses(tmp_path) -> None:
    tb, log = tmp_path / "tb", tmp_path / "log.jsonl"
    run(parse_config([*TINY, "--train-iters", "20", "--tensorboard-dir", str(tb),
                      "--log-jsonl", str(log), "--log-throughput",
                      "--log-validation-ppl-to-tensorboard"]))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    events = EventAccumulator(str(tb))
    events.Reload()
    for name in ("loss", "lr", "eval_loss", "eval_ppl", "tokens_per_sec"):
        logged = [(r["iteration"], r[name]) for r in records if name in r]
        written = [(e.step, e.value) for e in events.Scalars(name)]
        assert len(logged) == len(written) >= 2, name
        for (step, value), (tb_step, tb_value) in zip(logged, written):
            # TensorBoard stores float32
            assert step == tb_step and tb_value == torch.tensor(value).float().item(), name
    assert "memory/rss_gib" not in events.Tags()["scalars"]  # without --log-memory-to-tensorboard


def test_profile_writes_a_chrome_trace_per_rank(tmp_path) -> None:
    run(parse_config([*TINY, "--train-iters", "10", "--profile", "--profile-step-start", "3",
                      "--profile-step-end", "5", "--profile-dir", str(tmp_path)]))
    trace = json.loads((tmp_path / "trace_rank0.json").read_text())
    assert trace["traceEvents"]
    with pytest.raises(ConfigError, match="--profile-dir or --tensorboard-dir"):
        parse_config(["--profile"])


def test_manual_gc_disables_the_collector_for_the_run() -> None:
    hooks = StepHooks(parse_config(["--manual-gc", "--manual-gc-interval", "2"]), 0,
                      torch.device("cpu"))
    assert not gc.isenabled()
    hooks.after_step(2)
    hooks.close()
    assert gc.isenabled()
