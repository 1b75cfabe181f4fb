"""The meta-device rank dry run: device discipline, collective matching, measured memory.

Every rank runs its real model, optimizer and one training step on `torch.device("meta")`
under a fake process group, in this one process; nothing here needs several processes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pretrain
from megatron_lite import training
from megatron_lite.arguments import parse_config
from megatron_lite.dry_run import JSONL_KEYS, run_rank
from megatron_lite.kernels import resolve_use_triton
from megatron_lite.memory import LiveBytes, dry_run_report
from megatron_lite.optim import zero1
from megatron_lite.parallel import comms
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.audit import CommAudit, CommOp, DeviceDisciplineError, match
from megatron_lite.planner import estimate_memory

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "32", "--vocab-size", "250",
        "--micro-batch-size", "1"]
LAYOUTS = {
    "tp2-pp2-v2-dp2-zero1-overlaps": (8, ["--tensor-model-parallel-size", "2",
                                          "--pipeline-model-parallel-size", "2",
                                          "--num-layers-per-virtual-pipeline-stage", "1",
                                          "--sequence-parallel", "--use-distributed-optimizer",
                                          "--overlap-grad-reduce", "--overlap-param-gather",
                                          "--global-batch-size", "8", "--bf16"]),
    "tp4-sp": (4, ["--tensor-model-parallel-size", "4", "--num-query-groups", "4",
                   "--sequence-parallel",
                   "--global-batch-size", "2"]),
    "pp4-1f1b-dp2-tied": (8, ["--pipeline-model-parallel-size", "4", "--global-batch-size",
                              "8"]),
    "dp4-zero1-full-recompute": (4, ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                     "--recompute-granularity", "full", "--global-batch-size",
                                     "8", "--bf16"]),
}
LLAMA_70B = ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
             "--num-query-groups", "8", "--ffn-hidden-size", "28672", "--seq-length", "4096",
             "--max-position-embeddings", "4096", "--rotary-base", "500000",
             "--untie-embeddings-and-output-weights", "--bf16", "--vocab-size", "128256"]
LLAMA_70B_LAYOUT = ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size",
                    "8", "--num-layers-per-virtual-pipeline-stage", "2",
                    "--use-distributed-optimizer", "--overlap-grad-reduce",
                    "--overlap-param-gather", "--micro-batch-size", "1"]
"""The 70B shape and layout of scripts/pretrain_llama_70b.sh, with and without SP."""


def _cfg(extra: list[str]):
    return parse_config([*TINY, "--dry-run", *extra])


@functools.cache
def _all_ranks(layout: str) -> dict:
    """Every rank of a LAYOUTS entry, dry-run once per module (read-only to the tests)."""
    world, extra = LAYOUTS[layout]
    cfg = _cfg(extra)
    return {r: run_rank(cfg, world, r, time_host=False) for r in range(world)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_rank_of_a_layout_matches(layout: str) -> None:
    results = _all_ranks(layout)
    assert match({r: res.ops for r, res in results.items()}) is None
    for res in results.values():
        assert res.collectives > 0 and res.comm_bytes > 0
        assert res.save_growth_bytes == 0  # checkpoint assembly copies nothing on the device
        for measured, planned in ((res.params_bytes, res.planner_params_bytes),
                                  (res.grads_bytes, res.planner_grads_bytes),
                                  (res.optimizer_bytes, res.planner_optimizer_bytes)):
            assert abs(measured / planned - 1) < 0.03


def test_a_device_copy_during_checkpoint_assembly_is_measured(monkeypatch) -> None:
    """What the save path did before: clone master, exp_avg and exp_avg_sq on the device.
    The tracker sees exactly those 12 bytes per owned element."""
    real = zero1.state_dict

    def cloning(shards, *args):
        state = real(shards, *args)
        state["tensors"] = {k: v.clone() for k, v in state["tensors"].items()}
        return state

    monkeypatch.setattr(zero1, "state_dict", cloning)
    world, extra = LAYOUTS["dp4-zero1-full-recompute"]
    res = run_rank(_cfg(extra), world, 1, time_host=False)
    assert res.save_growth_bytes == res.optimizer_bytes > 0


def test_a_perturbed_schedule_on_one_rank_is_named() -> None:
    """Rank 5 runs a step with more micro-batches than its peers: its pipeline transfers
    and its TP collectives no longer line up, and the matcher says where."""
    world, extra = LAYOUTS["tp2-pp2-v2-dp2-zero1-overlaps"]
    results = {r: res.ops for r, res in _all_ranks("tp2-pp2-v2-dp2-zero1-overlaps").items()}
    other = [*extra[:extra.index("--global-batch-size")], "--global-batch-size", "16", "--bf16"]
    results[5] = run_rank(_cfg(other), world, 5, time_host=False).ops
    problem = match(results)
    assert problem is not None and "rank 5" in problem


def test_matcher_names_missing_receive_shape_mismatch_and_deadlock() -> None:
    def op(kind: str, group: tuple[int, ...], shape: tuple[int, ...] = (4,), peer=None):
        return CommOp(kind, group, "float32", (shape,), 16, peer, "here")

    world = (0, 1)
    ok = {0: [op("all_reduce", world), op("send", world, peer=1)],
          1: [op("all_reduce", world), op("recv", world, peer=0)]}
    assert match(ok) is None
    lost = {0: [op("send", world, peer=1)], 1: []}
    assert "receives nothing" in match(lost)
    shapes = {0: [op("all_reduce", world, (4,))], 1: [op("all_reduce", world, (8,))]}
    assert "collective #0" in match(shapes)
    # both wait for the other's send first: matched sequences, but a deadlock
    locked = {r: [op("recv", world, peer=1 - r), op("all_reduce", (r,)),
                  op("send", world, peer=1 - r)] for r in world}
    assert "deadlock" in match(locked)


@pytest.mark.quick
def test_a_host_tensor_in_a_collective_is_refused(monkeypatch) -> None:
    """The bug class NCCL finds at start-up: a count built on the host and all-reduced."""
    def host_count(batches, pstate):
        count = sum(b["loss_mask"].sum() for b in batches).to(torch.float32)  # stays on host
        return comms.all_reduce_(count, pstate.dp_group, kind="dp")

    monkeypatch.setattr(training, "global_token_count", host_count)
    world, extra = LAYOUTS["dp4-zero1-full-recompute"]
    with pytest.raises(DeviceDisciplineError) as err:
        run_rank(_cfg(extra), world, 0, time_host=False)
    text = str(err.value)
    assert "all_reduce over ranks [0, 1, 2, 3]" in text and "is on cpu" in text
    assert "tests/test_dry_run.py" in text and "host_count" in text


def test_parameter_count_reduces_on_the_run_device() -> None:
    """training.parameter_count once all-reduced a host float64: fatal on any NCCL group."""
    cfg = _cfg(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                "--global-batch-size", "2"])
    pstate = parallel_state.initialize_fake(cfg, 4, 3)
    try:
        with CommAudit(pstate.device) as audit:
            count = training.reduced_parameter_count(training.build_model(cfg, pstate), pstate)
    finally:
        parallel_state.destroy(pstate)
    assert count.is_meta and [(o.op, o.group, o.dtype) for o in audit.ops] == [
        ("all_reduce", (0, 1, 2, 3), "float64")]


def test_live_bytes_sees_allocations_frees_and_resized_storages() -> None:
    x = torch.empty(1000, device="meta")
    with LiveBytes(torch.device("meta")) as live:
        y = torch.empty(256, device="meta")
        z = y.clone()
        assert live.live == 2048 and live.peak == 2048
        del z
        assert live.live == 1024
        w = x + 1  # x was allocated outside: only w counts
        assert live.live == 1024 + 4000
        del w
        dist_free = torch.empty(100, device="meta")
        dist_free.untyped_storage().resize_(0)  # how the pipeline frees a sent activation
        assert live.reset_peak() == 1024
        assert live.bytes_of([y, y[:10]]) == 1024
    assert live.peak == 1024


def _rank(extra: list[str], world: int, rank: int):
    return run_rank(parse_config([*LLAMA_70B, "--dry-run", *extra]), world, rank, time_host=False)


def _script_dry_run(script: str, ranks: str, tmp_path: Path) -> tuple[str, list[dict]]:
    """The script's dry run as a real process: bash execs `$PYTHON pretrain.py ...`."""
    out = tmp_path / f"{script}.jsonl"
    env = {**os.environ, "DRY_RUN": ranks, "PYTHON": sys.executable,
           "EXTRA_ARGS": f"--log-jsonl {out}", "RUN_DIR": str(tmp_path)}
    proc = subprocess.run(["bash", f"scripts/{script}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, [json.loads(line) for line in out.read_text().splitlines()]


def _script_dry_run_in_process(script: str, ranks: str, tmp_path: Path,
                               capsys: pytest.CaptureFixture, **env_vars: str
                               ) -> tuple[str, list[dict], list[str]]:
    """The same, with the interpreter's start-up and first-use imports saved: $PYTHON is a
    stub that records the command line bash execs (and where), which then runs here through
    `pretrain.main`, the function `python pretrain.py` calls. Also returns that command line."""
    out, argv_file, stub = (tmp_path / f"{script}.jsonl", tmp_path / "argv",
                            tmp_path / "python")
    stub.write_text(f'#!/bin/bash\npwd > {argv_file}\nprintf "%s\\n" "$@" >> {argv_file}\n')
    stub.chmod(0o755)
    env = {**os.environ, "DRY_RUN": ranks, "PYTHON": str(stub),
           "EXTRA_ARGS": f"--log-jsonl {out}", "RUN_DIR": str(tmp_path), **env_vars}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cwd, program, *argv = argv_file.read_text().splitlines()
    assert Path(cwd) == ROOT and program == "pretrain.py", (cwd, program)
    capsys.readouterr()
    assert pretrain.main(argv) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return capsys.readouterr().out, records, argv


def _assert_near_planner(records: list[dict]) -> None:
    for r in records:
        for kind in ("params", "grads", "optimizer"):
            assert abs(r[f"{kind}_bytes"] / r[f"planner_{kind}_bytes"] - 1) < 0.03, (kind, r)
        assert abs(r["activation_bytes"] / r["planner_activation_bytes"] - 1) < 0.10, r


@pytest.mark.slow
def test_70b_script_on_1024_states_and_activations_match_the_planner(tmp_path, capsys) -> None:
    """scripts/pretrain_llama_70b.sh's own flags: first-stage ranks 0 and 7, last-stage 1023.

    With the script's GBS knob at 256 instead of 1,024: 16 micro-batches per pipeline instead
    of 64, a quarter of the step. The states do not depend on it, and the peak activations
    neither: the interleaved schedule's warm-up (2(p-1) + (v-1)p = 46 chunk forwards on stage
    0) is already shorter than the step's 80, so the same micro-batches are in flight at the
    peak, as the planner's estimate for the script's own 1,024 says (asserted the same)."""
    stdout, records, argv = _script_dry_run_in_process("pretrain_llama_70b.sh", "0 7 1023",
                                                       tmp_path, capsys, GBS="256")
    at = argv.index("--global-batch-size") + 1
    assert argv[at] == "256"
    cfgs = [parse_config([*argv[:at], gbs, *argv[at + 1:]]) for gbs in ("256", "1024")]
    for r in records:  # the planner as run_rank asks it, at this run's GBS and the script's
        here, script_gbs = (estimate_memory(cfg, 1024, stage=r["pp_rank"], fused_kernels=(
            resolve_use_triton(cfg.model.triton_kernels, torch.device("meta")))) for cfg in cfgs)
        assert r["planner_activation_bytes"] == int(here.activation_bytes), r
        # in flight and per micro-batch the same; the total only by what grows with the
        # micro-batch count (1.1 MB of 14 GB on stage 0)
        assert dataclasses.replace(here, activation_bytes=0) == dataclasses.replace(
            script_gbs, activation_bytes=0), r
        assert here.activation_bytes == pytest.approx(script_gbs.activation_bytes, rel=1e-3)
    assert "world size 1024 = pp 8 x dp 16 x tp 8" in stdout
    assert [r["rank"] for r in records] == [0, 7, 1023]
    _assert_near_planner(records)


@pytest.mark.parametrize(("script", "ranks", "layout", "process"), [
    ("pretrain_llama_1b.sh", "0 15", "world size 16 = pp 1 x dp 16 x tp 1", True),
    ("pretrain_llama_8b.sh", "0 63", "world size 64 = pp 1 x dp 32 x tp 2", False)])
def test_1b_and_8b_scripts_match_the_planner(script, ranks, layout, process, tmp_path,
                                             capsys) -> None:
    """The 1B script runs its real `python pretrain.py` process; the 8B (and 70B) command
    lines run in this process."""
    stdout, records = (_script_dry_run(script, ranks, tmp_path) if process
                       else _script_dry_run_in_process(script, ranks, tmp_path, capsys)[:2])
    assert layout in stdout
    assert [r["rank"] for r in records] == [int(r) for r in ranks.split()]
    _assert_near_planner(records)


@pytest.mark.slow
def test_70b_sequence_parallel_at_most_halves_activations() -> None:
    """TP8 with SP keeps each layer's norm and linear inputs as [s/8, b, h] shards."""
    flags = [*LLAMA_70B_LAYOUT, "--global-batch-size", "128"]  # 8 micro-batches: quicker
    with_sp = _rank([*flags, "--sequence-parallel"], 1024, 0)
    without = _rank(flags, 1024, 0)
    assert with_sp.activation_bytes <= 0.5 * without.activation_bytes
    assert abs(with_sp.activation_bytes / with_sp.planner_activation_bytes - 1) < 0.10
    assert abs(without.activation_bytes / without.planner_activation_bytes - 1) < 0.10


def test_cli_matches_all_ranks_and_writes_jsonl(tmp_path, capsys) -> None:
    """`pretrain.py --dry-run ... --dry-run-ranks all` through pretrain.main, in process."""
    world, extra = LAYOUTS["tp2-pp2-v2-dp2-zero1-overlaps"]
    out = tmp_path / "dry.jsonl"
    rc = pretrain.main([*TINY, "--dry-run", "--world-size", str(world), *extra,
                        "--dry-run-ranks", "all", "--log-jsonl", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0, stdout
    assert "collectives matched" in stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["rank"] for r in records] == list(range(world))
    assert all(tuple(r) == JSONL_KEYS for r in records)


def test_cli_refuses_a_rank_outside_the_world(capsys) -> None:
    rc = pretrain.main([*TINY, "--dry-run", "--world-size", "4", "--dry-run-ranks", "4"])
    assert rc == 2 and "--dry-run-ranks 4" in capsys.readouterr().err


def test_a_large_rank_grid_is_summarized_unless_asked() -> None:
    """1,024 ranks: the part before the stage table stays short; --log-rank-grid prints all."""
    flags = [*LLAMA_70B, *LLAMA_70B_LAYOUT, "--sequence-parallel", "--global-batch-size", "1024"]
    text = dry_run_report(parse_config(flags), 1024)
    head = text[:text.index("stage partition:")]
    assert len(head) < 1500 and "dp15:tp[1016-1023]" in head and "dp7:" not in head
    full = dry_run_report(parse_config([*flags, "--log-rank-grid"]), 1024)
    assert all(f"dp{d}:tp[{(7 * 16 + d) * 8}-" in full for d in range(16))
