"""Draw the curves of one or more training runs from their --log-jsonl files into one PNG.

    python scripts/plot_run.py demo/metrics.jsonl --out curves.png
    python scripts/plot_run.py runA/metrics.jsonl runB/metrics.jsonl --out compare.png

Six panels against the iteration: loss, eval loss (test loss as a star where logged), lr,
grad norm, tokens/s and MFU; runs overlaid, one colour each, labelled by file name. A
record's missing field is skipped, so files of older or newer versions still plot. Records
with an "event" key are drawn as dotted vertical lines in the run's colour, named on the
loss panel. A resumed run appends to its file and repeats the iterations after its last
checkpoint: the latest record of an iteration wins, as training continued from it. For a run
launched by scripts/common.sh (its `job_end` records) it prints the run's goodput line: kept
training-step time over the allocated time of all its jobs (megatron_lite/unattended.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.errors import UserError, add_debug_flag, run_cli
from megatron_lite.unattended import goodput_line

PANELS = (("loss", "loss"), ("eval_loss", "eval loss"), ("lr", "learning rate"),
          ("grad_norm", "grad norm"), ("tokens_per_sec", "tokens/s"), ("mfu", "MFU"))
"""(JSONL field, panel title), as megatron_lite/metrics.py writes them."""


def read_run(path: Path) -> list[dict]:
    """The records of one --log-jsonl file; a missing, empty or broken file is a UserError
    naming it (and the line)."""
    if not path.is_file():
        raise UserError(f"{path}: no such file (give the --log-jsonl file of a run)")
    records = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{number}: not a JSON record ({err.msg}); is it a "
                                "--log-jsonl file?") from err
            if not isinstance(record, dict):
                raise UserError(f"{path}:{number}: a JSON {type(record).__name__}, not a "
                                "record (an object); is it a --log-jsonl file?")
            records.append(record)
    if not records:
        raise UserError(f"{path}: empty (no records yet: did the run log an iteration?)")
    if not any(field in r and "iteration" in r for r in records for field, _ in PANELS):
        raise UserError(f"{path}: no record has an iteration and one of "
                        f"{', '.join(f for f, _ in PANELS)}; is it a --log-jsonl file?")
    return records


def series(records: list[dict], field: str) -> tuple[list[int], list[float]]:
    """(iterations, values) of `field`, the latest record of each iteration winning."""
    latest = {r["iteration"]: r[field] for r in records
              if "iteration" in r and isinstance(r.get(field), int | float)}
    its = sorted(latest)
    return its, [latest[i] for i in its]


def labels(paths: list[Path]) -> list[str]:
    """File names, or the paths where two runs share a name (run1/metrics.jsonl, ...)."""
    names = [p.name for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


def plot(runs: dict[str, list[dict]], out: Path) -> None:
    try:
        import matplotlib
    except ImportError as err:
        raise UserError("plot_run.py needs matplotlib: pip install matplotlib (it is in "
                        "requirements-dev.txt)") from err
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), sharex=True)
    colours = plt.get_cmap("tab10")
    for i, (label, records) in enumerate(runs.items()):
        colour = colours(i % 10)
        for ax, (field, title) in zip(axes.flat, PANELS):
            its, values = series(records, field)
            marker = "o" if field == "eval_loss" or len(its) < 30 else None
            ax.plot(its, values, color=colour, marker=marker, markersize=3, linewidth=1.2,
                    label=label)
            ax.set_title(title, fontsize=10)
        test_its, test = series(records, "test_loss")
        axes.flat[1].plot(test_its, test, color=colour, marker="*", markersize=9,
                          linestyle="none")
        for event in (r for r in records if "event" in r and "iteration" in r):
            for ax in axes.flat:
                ax.axvline(event["iteration"], color=colour, linestyle=":", linewidth=1)
            axes.flat[0].annotate(str(event["event"]), (event["iteration"], 1.0),
                                  xycoords=("data", "axes fraction"), rotation=90,
                                  va="top", ha="right", fontsize=7, color=colour)
    axes.flat[5].yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    for ax in axes[1]:
        ax.set_xlabel("iteration")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, format="png")  # whatever the suffix says
    plt.close(fig)


def _main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, metavar="RUN.jsonl",
                    help="--log-jsonl files of the runs to overlay")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    add_debug_flag(ap)
    args = ap.parse_args(argv)
    runs = {label: read_run(path) for label, path in zip(labels(args.runs), args.runs)}
    plot(runs, args.out)
    print(f"wrote {args.out} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    for label, records in runs.items():
        if any(r.get("event") == "job_end" for r in records):
            print(f"{label}: {goodput_line(records)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """A missing, empty or unreadable JSONL file ends in one `error:` line and exit status 2."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
