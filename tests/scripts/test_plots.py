"""The pictures: scripts/plot_run.py on real --log-jsonl files and scripts/plan.py --timeline
write PNGs; the timeline is the simulator's play of the real action lists; bad JSONL files are
one `error:` line naming the file."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import struct
from pathlib import Path

import pytest

import scripts.plan as plan_cli
import scripts.plot_run as plot_run
from megatron_lite.arguments import parse_config
from megatron_lite.parallel.state import single_process_state
from megatron_lite.training import train

TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--ffn-hidden-size", "64", "--seq-length", "16", "--vocab-size", "64",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "2",
        "--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1", "--peak-tflops", "1",
        "--log-interval", "1"]


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the PNG signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _run(path: Path, lr: str) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        train(parse_config([*TINY, "--lr", lr, "--log-jsonl", str(path)]), single_process_state())


def test_plot_run_overlays_two_real_runs(tmp_path) -> None:
    one, two = tmp_path / "lr2e-3.jsonl", tmp_path / "lr1e-3.jsonl"
    _run(one, "2e-3")
    _run(two, "1e-3")
    with two.open("a") as f:  # an event record, as the training loop writes them
        f.write(json.dumps({"event": "skipped_iteration", "iteration": 3, "time": 1.5}) + "\n")
    records = plot_run.read_run(one)
    for field, _ in plot_run.PANELS:  # every panel finds its field in what training writes
        its, values = plot_run.series(records, field)
        assert its and len(its) == len(values), f"no {field!r} in {one}"
    out = tmp_path / "curves.png"
    assert plot_run.main([str(one), str(two), "--out", str(out)]) == 0
    assert png_size(out) == (13 * 80, int(6.5 * 80))
    assert out.stat().st_size > 20_000


@pytest.mark.quick
def test_the_latest_record_of_a_repeated_iteration_wins() -> None:
    """A resumed run appends the iterations after its checkpoint again."""
    records = [{"iteration": 1, "loss": 5.0}, {"iteration": 2, "loss": 4.0},
               {"iteration": 2, "eval_loss": 4.5}, {"iteration": 2, "loss": 3.9},
               {"iteration": 3, "loss": 3.5}, {"event": "restart", "iteration": 2}]
    assert plot_run.series(records, "loss") == ([1, 2, 3], [5.0, 3.9, 3.5])
    assert plot_run.series(records, "eval_loss") == ([2], [4.5])
    assert plot_run.series(records, "lr") == ([], [])


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("", "empty"),
    ('{"iteration": 1, "loss": 5.0}\n{"iteration": 2, "lo\n', ":2: not a JSON record"),
    ("[1, 2]\n", ":1: a JSON list, not a record"),
    ('{"name": "not a metrics file"}\n', "no record has an iteration"),
])
def test_bad_jsonl_files_are_one_error_line_naming_the_file(tmp_path, capsys, content,
                                                            message) -> None:
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text('{"iteration": 1, "loss": 5.0, "lr": 0.001}\n')
    if content is not None:
        bad.write_text(content)
    out = tmp_path / "x.png"
    assert plot_run.main([str(good), str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}") and message in err, err
    assert not out.exists()


def test_same_file_names_are_told_apart_by_their_paths() -> None:
    paths = [Path("runA/metrics.jsonl"), Path("runB/metrics.jsonl")]
    assert plot_run.labels(paths) == ["runA/metrics.jsonl", "runB/metrics.jsonl"]
    assert plot_run.labels([Path("a/x.jsonl"), Path("b/y.jsonl")]) == ["x.jsonl", "y.jsonl"]


@pytest.mark.parametrize("name, chunks", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1),
                                          ("zbv", 2)])
def test_timeline_is_every_compute_once_without_overlap(name: str, chunks: int) -> None:
    pp, m = 4, 8
    line = plan_cli.play(name, pp, chunks, m, (1.0, 1.0, 1.0))
    split = name.startswith("zb")
    for slots in line.slots:
        keys = [(s.kind, s.microbatch, s.chunk) for s in slots]
        assert len(keys) == len(set(keys)) == m * chunks * (3 if split else 2)
        assert all(a.end <= b.start + 1e-9 for a, b in itertools.pairwise(slots))
        assert all(s.end > s.start for s in slots)
    assert max(s.end for slots in line.slots for s in slots) == pytest.approx(line.makespan)
    # F + B + W of one stage's micro-batch = 1, so every stage is busy m of the step
    assert line.bubble == pytest.approx(1 - m / line.makespan)
    if name == "1f1b":  # (p - 1) / (m + p - 1) at any F : B
        assert line.bubble == pytest.approx((pp - 1) / (m + pp - 1))
    if name == "zb-h1":  # (p - 1)(F + B - W) idle per stage
        assert line.makespan == pytest.approx(m + (pp - 1) / 3)


def test_plan_timeline_writes_a_png(tmp_path, capsys) -> None:
    out = tmp_path / "pics" / "schedules.png"
    argv = ["--preset", "8B", "--gpus", "32", "--pp", "4", "--timeline", str(out),
            "--timeline-microbatches", "8"]
    assert plan_cli.main(argv) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    width, height = png_size(out)
    assert width == 1200 and height > 600 and out.stat().st_size > 50_000


@pytest.mark.parametrize("extra, message", [
    (["--pp", "1"], "no pipeline (PP = 1)"),
    (["--pp", "4", "--schedule", "interleaved", "--timeline-microbatches", "6"],
     "--timeline-microbatches 6: the interleaved schedule needs a multiple of PP = 4"),
    (["--pp", "4", "--timeline-microbatches", "0"], "--timeline-microbatches 0: give a positive"),
])
def test_plan_timeline_errors(tmp_path, capsys, extra, message) -> None:
    out = tmp_path / "t.png"
    assert plan_cli.main(["--preset", "8B", "--gpus", "32", *extra, "--timeline",
                          str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
