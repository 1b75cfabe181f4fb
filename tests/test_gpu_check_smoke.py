"""scripts/gpu_check.sh runs only when a GPU is lent (rarely, with minutes to spare), so every
piece of it that can run on a CPU runs here: its --smoke mode (every part's code path at tiny
sizes, failing any part that is skipped), its --plan (the sum fits the loan's 480 s),
bench/gpu_train.py's two sides and report at a tiny size, scripts/gpu_multirank.py's whole flow
over staged-gloo, and the shell script's syntax and its no-GPU exit."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_lite.arguments import parse_config
from megatron_lite.planner import ModelShape, matmul_params, training_flops_per_token
from tests.numerics import EXACT

ROOT = Path(__file__).resolve().parents[1]
CPU_ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def _load(relpath: str):
    spec = importlib.util.spec_from_file_location(Path(relpath).stem, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_gpu_train_tiny_on_cpu_writes_table_and_json(tmp_path, monkeypatch, capfd) -> None:
    """The parent (bench/gpu_train.py's main) runs here, its two sides as its own child
    processes, as on a GPU."""
    for key, value in CPU_ENV.items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)
    bench = _load("bench/gpu_train.py")
    rc = bench.main(["--model", "tiny", "--device", "cpu", "--compile-backend", "eager",
                     "--steps", "4", "--warmup", "2", "--out", str(tmp_path)])
    out, err = capfd.readouterr()
    assert rc == 0, out[-3000:] + err[-3000:]
    row = json.loads((tmp_path / "gpu_train_tiny.json").read_text())
    cfg = parse_config(bench.MODELS["tiny"])
    assert row["flops_per_token"] == training_flops_per_token(
        ModelShape.from_config(cfg.model), 64)
    ours, plain = row["ours"], row["plain"]
    for side in (ours, plain):
        assert side["tokens_per_sec"] > 0 and side["mfu"] > 0
        assert math.isclose(side["tflops_per_device"],
                            side["tokens_per_sec"] * row["flops_per_token"] / 1e12)
        assert len(side["losses"]) == 4 and all(map(math.isfinite, side["losses"]))
    assert ours["same_flop_formula"]
    assert math.isclose(ours["peak_tflops"], plain["peak_tflops"], rel_tol=1e-12)
    assert math.isclose(row["ratio"], ours["tokens_per_sec"] / plain["tokens_per_sec"])
    # Both blocks reuse one compiled graph (plus the head's): no per-layer recompiles that
    # would hit dynamo's recompile limit at 16-28 layers and fall back to eager.
    assert plain["compiled_graphs"] == 2
    assert row["memory"]["total_bytes"] > row["memory"]["state_bytes"] > 0
    text = (tmp_path / "gpu_train_tiny.txt").read_text()
    assert "ours " in text and "plain PyTorch " in text and f"ratio {row['ratio']:.3f}" in text
    assert "memory: planner total" in text


def test_plain_model_has_the_matmul_weights_the_flop_formula_counts() -> None:
    bench = _load("bench/gpu_train.py")
    cfg = parse_config(bench.MODELS["tiny"])
    model = bench.PlainLlama(cfg.model)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    tied_output = model.embedding.weight.numel()
    assert model.head.weight is model.embedding.weight
    assert weights + tied_output == matmul_params(ModelShape.from_config(cfg.model))
    tokens, labels = torch.randint(0, cfg.model.vocab_size, (2, 2, cfg.model.seq_length))
    loss = model(tokens, labels)
    assert abs(loss.item() - math.log(cfg.model.vocab_size)) < 0.1  # N(0, 0.02) init


@pytest.mark.slow  # seven processes: 12-25 s on 2 cores
def test_multirank_flow_on_cpu(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_multirank.py", "--out", str(tmp_path), "--device", "cpu",
         "--iters", "5"], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "multirank.json").read_text())
    # On the CPU host tensors are the run's own; every other op the layouts need must work.
    assert {op: i["status"] for op, i in result["probe"].items() if op != "host_tensor"} == \
        dict.fromkeys(["all_reduce", "all_reduce_max", "all_gather", "all_gather_async",
                       "reduce_scatter", "reduce_scatter_async", "all_gather_objects",
                       "all_gather_list", "barrier", "send_recv"], "ok")
    assert not result["host_tensor_refused"]
    assert {name: run["status"] for name, run in result["runs"].items()} == \
        {"tp2_sp": "ok", "pp2": "ok", "cp2": "ok", "zero3": "ok"}
    # float64 on the CPU: every layout's five losses equal one process's to EXACT (1e-10)
    assert "--fp64" in result["flags"]
    text = (tmp_path / "multirank.txt").read_text()
    assert "2 ranks on cpu, float64," in text.splitlines()[0]
    for name in ("tp2_sp", "pp2", "cp2", "zero3"):
        assert f"{name}: ok: 5/5 losses" in text
        assert f"(tolerance {EXACT:g})" in result["runs"][name]["reason"]
        print(name, result["runs"][name]["reason"])


def test_probe_results_name_the_op_a_rank_died_in(tmp_path) -> None:
    multirank = _load("scripts/gpu_multirank.py")
    lines = {0: [{"op": "all_reduce", "status": "start"},
                 {"op": "all_reduce", "status": "ok", "detail": ""},
                 {"op": "send_recv", "status": "start"}],
             1: [{"op": "all_reduce", "status": "start"},
                 {"op": "all_reduce", "status": "error", "detail": "RuntimeError: boom"}]}
    for rank, recs in lines.items():
        (tmp_path / f"probe_rank{rank}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in recs))
    ops = multirank.read_probe(tmp_path, rc=-11)
    assert ops["all_reduce"] == {"status": "error", "detail": "rank 1: RuntimeError: boom"}
    assert ops["send_recv"]["status"] == "error"
    assert "rank 0 never finished it" in ops["send_recv"]["detail"]
    assert "exit code -11" in ops["send_recv"]["detail"]
    ok, text = multirank.compare([2.0, 1.5], [2.0, 1.5 * (1 + 2e-5)], 2)
    assert not ok and "worst relative difference 2.00e-05" in text


def test_gpu_check_script_parses_and_stops_without_cuda(tmp_path) -> None:
    script = ROOT / "scripts" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    proc = subprocess.run(["bash", str(script), str(tmp_path / "out")], cwd=tmp_path,
                          env={**CPU_ENV, "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "no CUDA device visible" in proc.stdout, \
        proc.stdout + proc.stderr


@pytest.mark.quick
def test_gpu_train_report_names_what_failed() -> None:
    """An OOM on either side still reports the other side, the error and the memory numbers."""
    bench = _load("bench/gpu_train.py")
    args = argparse.Namespace(model="tiny", steps=4, warmup=2, micro_batch=None,
                              compile_backend="inductor")
    flags = bench.run_flags(args)
    ours = {"rc": 1, "error": "OutOfMemoryError: CUDA out of memory", "wall_s": 9.0,
            "device": "NVIDIA H200", "max_memory_allocated": 3 * 2**30,
            "max_memory_reserved": 4 * 2**30,
            "planner": {"total_bytes": 2**31, "state_bytes": 2**30, "activation_bytes": 2**30}}
    plain = {"rc": 1, "error": "RuntimeError: boom", "wall_s": 1.0, "device": "NVIDIA H200"}
    row = bench.summarize(args, flags, [], ours, plain)
    assert row["ours"] is None and row["plain"] is None and row["ratio"] is None
    assert row["memory"]["planner_over_measured"] == 2 / 3
    assert row["memory"]["planner_activation_over_that"] == 0.5
    text = "\n".join(bench.report_lines(row))
    assert "ours FAILED (OutOfMemoryError: CUDA out of memory)" in text
    assert "plain PyTorch FAILED (RuntimeError: boom)" in text and "ratio n/a" in text
    assert "planner/measured 0.667" in text
    assert "did not finish" in "\n".join(bench.report_lines(bench.summarize(args, flags, [],
                                                                            ours, None)))


@pytest.mark.slow
def test_gpu_fp8_tiny_on_cpu_compares_gemms_and_training(tmp_path) -> None:
    """bench/gpu_fp8.py end to end at the tiny shape on the CPU: four GEMM rows whose bf16,
    FP8 and FP8-with-casts rates are measured (positive, distinct per path), both training
    runs finish every step from the same first loss (same samples and initial weights), and
    the FP8 run's losses are not the bf16 run's (the FP8 path ran)."""
    proc = subprocess.run([sys.executable, "bench/gpu_fp8.py", "--model", "tiny", "--device",
                           "cpu", "--steps", "3", "--warmup", "1", "--gemm-reps", "2",
                           "--out", str(tmp_path)], cwd=ROOT, env=CPU_ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = json.loads((tmp_path / "gpu_fp8_tiny.json").read_text())
    assert [g["gemm"] for g in row["gemms"]] == ["qkv", "attn_out", "gate_up", "down"]
    assert all(g[f"{k}_tflops"] > 0 for g in row["gemms"]
               for k in ("bf16", "fp8", "fp8_with_casts"))
    bf16, fp8 = row["bf16"]["losses"], row["fp8"]["losses"]
    assert len(bf16) == len(fp8) == 3 and math.isclose(bf16[0], fp8[0], rel_tol=1e-2)
    assert bf16 != fp8 and row["compare"]["ok"]
    assert "fp8" in (tmp_path / "gpu_fp8_tiny.txt").read_text()


SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _plan(script: Path = SCRIPT, gpus: int = 1) -> tuple[int, dict[str, int], str]:
    proc = subprocess.run(["bash", str(script), "--plan"], capture_output=True, text=True,
                          env={**CPU_ENV, "GPU_CHECK_GPUS": str(gpus)}, timeout=30)
    parts = {line.split()[0]: int(line.split()[1]) for line in proc.stdout.splitlines()
             if line.startswith("  ") and "2+ GPUs only" not in line}
    return proc.returncode, parts, proc.stdout


@pytest.mark.quick
def test_plan_fits_the_one_gpu_loan(tmp_path) -> None:
    """Each part's estimate is printed and their sum, which fits the 480 s loan; the
    multi-GPU part is listed but counted only with 2+ GPUs. A plan that grows past 480 s
    exits 1 (planted: train_1b's estimate raised by 60 s)."""
    rc, parts, text = _plan()
    assert rc == 0, text
    assert f"total for 1 GPU(s): {sum(parts.values())} s" in text
    assert sum(parts.values()) <= 480 and {"multirank", "train_1b", "fp8_1b"} <= set(parts)
    assert "multirank_nccl" in text and "multirank_nccl" not in parts
    assert "multirank_nccl" in _plan(gpus=2)[1]
    planted = tmp_path / "gpu_check.sh"
    planted.write_text(SCRIPT.read_text().replace(
        f"train_1b {parts['train_1b']}\n", f"train_1b {parts['train_1b'] + 60}\n"))
    rc, _, text = _plan(planted)
    assert rc == 1 and f"{sum(parts.values()) + 60} s" in text


def _smoke(out: Path, only: str | None = None, plant: str | None = None,
           timeout: float = 900) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """gpu_check.sh --smoke into `out`, with PYTHON a wrapper that, for a command line
    containing `plant`, prints a `SKIPPED:` line and exits 0 (a part that skips its check)."""
    wrapper = out.parent / "python"
    wrapper.write_text(f"""#!/bin/bash
if [[ -n "${{PLANT:-}}" && " $* " == *"$PLANT"* ]]; then echo "SKIPPED: planted"; exit 0; fi
exec {sys.executable} "$@"
""")
    wrapper.chmod(0o755)
    env = {**CPU_ENV, "PYTHON": str(wrapper), "PLANT": plant or ""}
    if only:
        env["GPU_CHECK_ONLY"] = only
    proc = subprocess.run(["bash", str(SCRIPT), "--smoke", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    rows = [line.split("\t") for line in (out / "parts.tsv").read_text().splitlines()]
    return proc, {row[0]: row[1] for row in rows}


def test_smoke_fails_a_part_that_skips_inside_and_names_the_parts_not_run(tmp_path) -> None:
    proc, parts = _smoke(tmp_path / "plain", only="install")
    assert proc.returncode == 1 and parts["install"] == "ok", proc.stdout[-2000:]
    assert parts["multirank"] == parts["fp8_1b"] == "NOT RUN (GPU_CHECK_ONLY)"
    summary = (tmp_path / "plain" / "summary.txt").read_text()
    assert "NOT OK: kernel_tests, kernel_bench" in summary
    proc, parts = _smoke(tmp_path / "planted", only="install", plant="-m pip install")
    assert proc.returncode == 1 and parts["install"].startswith(
        "FAILED: skipped inside (SKIPPED: planted)"), parts
    assert "NOT OK: install, kernel_tests" in (tmp_path / "planted" / "summary.txt").read_text()


@pytest.mark.slow  # every part at tiny sizes: a few minutes on 2 cores
def test_smoke_runs_every_part_and_fails_a_planted_skip(tmp_path) -> None:
    """The whole --smoke run: every planned part (the multi-GPU one over gloo) ran ok, the
    summary names the results directory; then the same run with the FP8 benchmark planted to
    skip fails, naming fp8_1b."""
    _, planned, _ = _plan(gpus=2)
    proc, parts = _smoke(tmp_path / "all")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert parts == dict.fromkeys(planned, "ok")
    summary = (tmp_path / "all" / "summary.txt").read_text()
    assert f"all results: {tmp_path / 'all'}" in summary and "calibration: " in summary
    assert "multirank: " in summary and "all ran and agreed" in summary
    proc, parts = _smoke(tmp_path / "fp8", only="fp8_1b", plant="bench/gpu_fp8.py")
    assert proc.returncode == 1 and parts["fp8_1b"].startswith("FAILED: skipped inside")


@pytest.mark.quick
def test_summary_shows_where_a_failed_parts_numbers_would_be(tmp_path) -> None:
    summary = _load("bench/gpu_summary.py")
    (tmp_path / "parts.tsv").write_text("calibrate\tok\t30\t30\n"
                                        "fp8_1b\tTIMED OUT after 155 s (planned ~90 s)\t155\t90\n")
    (tmp_path / "calibration.json").write_text("{}")
    text = "\n".join([*summary.parts_lines(tmp_path), *summary.number_lines(tmp_path)])
    assert "1/2 parts ok; NOT OK: fp8_1b" in text
    assert "GEMM TFLOP/s: n/a (fp8_1b wrote no gpu_fp8_*.json)" in text
    assert "training MFU: n/a" in text and f"calibration: {tmp_path}/calibration.json" in text
