"""Unattended runs: one run across Slurm jobs, what each job end decides, and the run's goodput.

A run lives in one directory, `${RUNS_DIR:-runs}/<RUN_NAME>` (scripts/common.sh), whatever
the job id: checkpoints, one `train.log` and one `metrics.jsonl` appended by every job (each
record carries its `job`). Two sides read and write that JSONL:

- training (`RunJournal`, rank 0): after the first new step of a process that finds earlier
  progress in the JSONL, one `resume` event (iterations lost since the last checkpoint,
  seconds from the previous job's last log line or failure to the first new step); at the end
  of `train`, under the launch scripts (MEGATRON_LITE_JOURNAL=1), one `train_end` record
  (done, or interrupted by a signal / time limit).
- the launch script, after each launch (`python -m megatron_lite.unattended after-launch`,
  no torch import): a `failure` record when the launch failed, the hosts its log blames
  (`hosts_named`: hang watchdog, lost peer, NaN/Inf, persistent straggler, preflight)
  appended to `<run>/exclude_hosts`, and one decision printed on stdout: `restart` (in
  place, a bounded number of times), `resubmit HOSTS` (sbatch --dependency=afterany:<job>
  --exclude=HOSTS, bounded by MAX_RESUBMITS) or `stop` (done, repeated failure at one
  iteration, or out of resubmissions). When the job ends, a `job_end` record and the
  `goodput:` line: productive training time (the step times of iterations that were kept:
  not redone after a resume or rollback) over the allocated time of all jobs so far.
  scripts/plot_run.py prints the same number.

Stdlib only: the launch script calls it between launches, where importing torch would cost
seconds per call.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

JOB_ENV = "SLURM_JOB_ID"
JOURNAL_ENV = "MEGATRON_LITE_JOURNAL"
"""Set to 1 by scripts/common.sh: training then ends with the `train_end` record its
after-launch step reads (a plain pretrain.py run's JSONL stays as it was)."""
EXCLUDE_FILE = "exclude_hosts"
JSONL_NAME = "metrics.jsonl"
LOG_NAME = "train.log"

HOST_PATTERNS = (
    re.compile(r"preflight: FAILED on host ([^\s:]+)"),
)
HANG_LINE = re.compile(r"hang watchdog: rank \d+ on host ([^\s,]+)(.*)")
"""The watchdog's line: the reporting rank's host, then (with heartbeats) the peers it names."""
STALE_HOST = re.compile(r"rank \d+ \(host ([^,)]+)(?:, pid \d+)?\) "
                        r"(?:stopped answering|has exited|never sent a heartbeat)")
"""A stale rank in a heartbeat verdict (`Verdict.describe`): its host is the one to blame."""
NO_BEAT = re.compile(r"rank \d+ (?:\([^)]*\) )?(?:stopped answering|has exited|never sent)")
"""Any stale rank, host known or not: then the rank reporting the hang is not blamed."""
PEER_LOST_LINE = re.compile(r"a collective failed because (.*)")
"""`heartbeat.lost_peer`'s message: the dead or stale ranks it names carry their hosts."""
STRAGGLER_LINE = re.compile(r"straggler: rank \d+ on host (\S+) has been (\d+)% slower than "
                            r"the median rank for (\d+) log intervals")
STRAGGLER_EXCLUDE_FRACTION = 0.25
"""A straggler's host is excluded from the next submission when it is at least this much slower
than the median rank (a warning starts at --straggler-threshold, 10% by default: noise on a
shared fabric; 25% is a quarter of every step lost by all ranks waiting for one)."""
STRAGGLER_EXCLUDE_INTERVALS = 6
"""... for at least this many log intervals in a row (twice the default
--straggler-intervals, so a slowdown that one warning reports and then clears stays a
warning)."""
NAN_LINE = re.compile(r"NaN/Inf at iteration \d+, found before any reduction in (.*)")
NAN_HOST = re.compile(r"\(host ([^)]+)\)")


def job_id() -> str | None:
    """This process's Slurm job id (None outside Slurm)."""
    return os.environ.get(JOB_ENV) or None


def read_records(path: Path) -> list[dict]:
    """The JSONL's records; a torn last line (a job killed mid-write) is skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def is_train(record: dict) -> bool:
    return "loss" in record and "iter_time_ms" in record and "event" not in record


def furthest_iteration(records: Iterable[dict]) -> int:
    return max((int(r["iteration"]) for r in records if is_train(r)), default=0)


# ---- training side ---------------------------------------------------------------------------


class RunJournal:
    """Rank 0's resume and end-of-training records (a no-op elsewhere or without a JSONL)."""

    def __init__(self, jsonl: str | None, rank: int) -> None:
        path = Path(jsonl) if jsonl and rank == 0 else None
        self.enabled = path is not None
        self.previous = read_records(path) if path is not None else []
        # the last write before this process: the previous job's last log line or the
        # failure record its launch script wrote
        self.previous_time = path.stat().st_mtime if self.previous and path else None
        self.start_iteration = 0

    def first_step(self, iteration: int, log: Callable[[dict], None]) -> None:
        """After the first step of this process: the `resume` event if there was progress."""
        if self.previous_time is None:
            return
        furthest = furthest_iteration(self.previous)
        if not furthest and not self.start_iteration:
            return
        resumed = self.start_iteration
        lost = max(0, furthest - resumed)
        downtime = time.time() - self.previous_time
        record = {"event": "resume", "iteration": iteration, "time": time.time(),
                  "resumed_from": resumed, "furthest_iteration": furthest,
                  "iterations_lost": lost, "downtime_s": downtime}
        print(f"resume: from the checkpoint of iteration {resumed}; {lost} iterations lost "
              f"since it (the run had logged iteration {furthest}); first new step "
              f"{downtime:.1f} s after the previous job's last log line", flush=True)
        log(record)

    def train_end(self, iteration: int, train_iters: int, log: Callable[[dict], None]) -> None:
        """End of `train`: done, or stopped early (a signal or time limit; saved)."""
        if not self.enabled or os.environ.get(JOURNAL_ENV) != "1":
            return
        log({"event": "train_end", "iteration": iteration, "time": time.time(),
             "train_iters": train_iters, "done": iteration >= train_iters})


# ---- goodput ---------------------------------------------------------------------------------


def goodput(records: Iterable[dict]) -> tuple[float, float]:
    """(productive seconds, allocated seconds) of a run's records: the step times of the
    iterations the run kept (a train record's mean step time counts for every iteration since
    the previous record of the same launch; a resume or rollback drops what comes after its
    checkpoint) and the `allocated_s` of every `job_end`."""
    kept: dict[int, float] = {}
    previous, allocated = 0, 0.0
    for r in records:
        event = r.get("event")
        restored = (r.get("resumed_from") if event == "resume" else
                    r.get("restored_iteration") if event == "rollback" else None)
        if restored is not None:
            kept = {i: s for i, s in kept.items() if i <= int(restored)}
            previous = int(restored)
        elif event == "job_end":
            allocated += float(r.get("allocated_s", 0.0))
        elif is_train(r):
            iteration = int(r["iteration"])
            first = previous + 1 if previous < iteration else iteration
            for i in range(first, iteration + 1):
                kept[i] = float(r["iter_time_ms"]) / 1e3
            previous = iteration
    return sum(kept.values()), allocated


def goodput_line(records: list[dict]) -> str:
    productive, allocated = goodput(records)
    jobs = len({r.get("job") for r in records if r.get("event") == "job_end"})
    ratio = productive / allocated if allocated > 0 else float("nan")
    return (f"goodput: {100 * ratio:.1f}% = {productive:.1f} s of kept training steps / "
            f"{allocated:.1f} s allocated over {jobs} job(s)")


# ---- launch-script side ----------------------------------------------------------------------


def hosts_named(log_text: str) -> list[str]:
    """Hosts to blame that hang, lost-peer, straggler, NaN/Inf and preflight messages name, in
    order, once. A hang is blamed on the stale ranks' hosts the reporting rank names (their
    process stopped; the reporter only waited for them), on the reporter's own host when it
    names none; a straggler only past STRAGGLER_EXCLUDE_FRACTION for
    STRAGGLER_EXCLUDE_INTERVALS."""
    found: list[str] = []
    for line in log_text.splitlines():
        names = [m.group(1) for p in HOST_PATTERNS if (m := p.search(line))]
        if (m := HANG_LINE.search(line)) is not None:
            stale = NO_BEAT.search(m.group(2)) is not None
            names += STALE_HOST.findall(m.group(2)) if stale else [m.group(1)]
        elif (m := PEER_LOST_LINE.search(line)) is not None:
            names += STALE_HOST.findall(m.group(1))
        if (m := STRAGGLER_LINE.search(line)) is not None and \
                int(m.group(2)) >= 100 * STRAGGLER_EXCLUDE_FRACTION and \
                int(m.group(3)) >= STRAGGLER_EXCLUDE_INTERVALS:
            names.append(m.group(1))
        if (m := NAN_LINE.search(line)) is not None:
            names += NAN_HOST.findall(m.group(1))
        found += [n for n in names if n not in found]
    return found


def add_excluded(run_dir: Path, hosts: list[str]) -> list[str]:
    """Append new `hosts` to <run>/exclude_hosts; all excluded hosts, oldest first."""
    path = run_dir / EXCLUDE_FILE
    known = path.read_text().split() if path.is_file() else []
    new = [h for h in hosts if h not in known]
    if new:
        with path.open("a") as f:
            f.write("".join(f"{h}\n" for h in new))
    return known + new


def decide(run_dir: Path, *, rc: int, from_line: int, log_offset: int, restarts: int,
           max_restarts: int, max_resubmits: int, job_start: float, can_resubmit: bool,
           say: Callable[[str], None]) -> str:
    """What the launch script does after a launch (see the module docstring); writes the
    `failure`, `resubmit` and `job_end` records and appends to exclude_hosts."""
    jsonl = run_dir / JSONL_NAME
    records = read_records(jsonl)
    named = hosts_named(_log_since(run_dir / LOG_NAME, log_offset))
    excluded = add_excluded(run_dir, named)
    if named:
        say(f"unattended: hosts named by hang/lost-peer/NaN/straggler/preflight messages: "
            f"{', '.join(named)} (now in {run_dir / EXCLUDE_FILE})")
    job = job_id()
    stamp = {"job": job} if job else {}
    if rc == 0:
        decision, why = _after_clean_exit(records[from_line:])
    else:
        decision, why = _after_failure(jsonl, records, rc, named, restarts, max_restarts, stamp)
    if decision == "resubmit":
        decision, why = _resubmit_or_stop(jsonl, records, why, can_resubmit, max_resubmits,
                                          excluded, stamp)
    say(f"unattended: {decision}: {why}")
    if decision != "restart":
        _end_job(jsonl, rc, job_start, stamp, say)
    return f"resubmit {','.join(excluded)}".strip() if decision == "resubmit" else decision


def _log_since(log: Path, offset: int) -> str:
    """The launch's own part of the run's log: what it appended after byte `offset`."""
    if not log.is_file():
        return ""
    with log.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def _after_clean_exit(new: list[dict]) -> tuple[str, str]:
    """(decision, why) after exit status 0: the launch's last train_end record says whether
    training finished or stopped early with a checkpoint to resume from."""
    ends = [r for r in new if r.get("event") == "train_end"]
    if ends and ends[-1].get("done"):
        return "stop", f"training done at iteration {ends[-1]['iteration']}"
    if ends:
        return "resubmit", (f"stopped early at iteration {ends[-1]['iteration']} "
                            "(signal or time limit), checkpoint saved")
    return "stop", "the launch exited 0 without a train_end record (nothing to resume)"


def _after_failure(jsonl: Path, records: list[dict], rc: int, named: list[str], restarts: int,
                   max_restarts: int, stamp: dict) -> tuple[str, str]:
    """(decision, why) after a failed launch, which is recorded first: a failure at the same
    iteration as the previous one is a bug that restarts would only repeat; a named host is
    left behind by resubmitting; otherwise restart in place while restarts are left."""
    iteration = next((int(r["iteration"]) for r in reversed(records) if is_train(r)), 0)
    before = [r for r in records if r.get("event") == "failure"]
    _append(jsonl, {"event": "failure", "iteration": iteration, "time": time.time(),
                    "rc": rc, "hosts": named, **stamp})
    if before and int(before[-1]["iteration"]) == iteration:
        return "stop", (f"the failure repeated at iteration {iteration} (exit status {rc}); not "
                        "restarting: look at the log above")
    if named:
        return "resubmit", f"failed (exit status {rc}) on a named host: resubmitting without it"
    if restarts < max_restarts:
        return "restart", (f"failed at iteration {iteration} (exit status {rc}): "
                           f"restart {restarts + 1} of {max_restarts} in place")
    return "resubmit", f"failed (exit status {rc}) after {restarts} restarts in place"


def _resubmit_or_stop(jsonl: Path, records: list[dict], why: str, can_resubmit: bool,
                      max_resubmits: int, excluded: list[str], stamp: dict) -> tuple[str, str]:
    """A resubmission happens only under Slurm and within MAX_RESUBMITS (counted over the
    run's records, so across jobs); one that happens is recorded with the hosts it avoids."""
    done = sum(1 for r in records if r.get("event") == "resubmit")
    if not can_resubmit:
        return "stop", why + "; not under Slurm, so not resubmitting"
    if done >= max_resubmits:
        return "stop", why + f"; MAX_RESUBMITS={max_resubmits} reached"
    _append(jsonl, {"event": "resubmit", "time": time.time(), "count": done + 1,
                    "exclude": excluded, **stamp})
    return "resubmit", why + f" (resubmission {done + 1} of {max_resubmits})"


def _end_job(jsonl: Path, rc: int, job_start: float, stamp: dict,
             say: Callable[[str], None]) -> None:
    """Record the job's end (a restart in place is the same job) with the run's goodput so
    far, and print it."""
    end = {"event": "job_end", "time": time.time(), "rc": rc,
           "allocated_s": time.time() - job_start, **stamp}
    productive, allocated = goodput([*read_records(jsonl), end])
    _append(jsonl, {**end, "run_productive_s": productive, "run_allocated_s": allocated,
                    "run_goodput": productive / allocated if allocated > 0 else None})
    say(goodput_line(read_records(jsonl)))


def _append(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_lite.unattended",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    after = sub.add_parser("after-launch", help="record the launch; print the decision")
    after.add_argument("--run-dir", type=Path, required=True)
    after.add_argument("--rc", type=int, required=True, help="the launch's exit status")
    after.add_argument("--from-line", type=int, default=0,
                       help="JSONL lines before the launch")
    after.add_argument("--log-offset", type=int, default=0, help="train.log bytes before it")
    after.add_argument("--restarts", type=int, default=0, help="in-place restarts so far")
    after.add_argument("--max-restarts", type=int, default=0)
    after.add_argument("--max-resubmits", type=int, default=0)
    after.add_argument("--job-start", type=float, default=time.time(),
                       help="when the job started (seconds since the epoch)")
    after.add_argument("--no-resubmit", action="store_true", help="not under Slurm")
    good = sub.add_parser("goodput", help="print the goodput line of a run's JSONL")
    good.add_argument("jsonl", type=Path)
    args = parser.parse_args(argv)
    if args.command == "goodput":
        print(goodput_line(read_records(args.jsonl)))
        return 0
    log = args.run_dir / LOG_NAME

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)
        with log.open("a") as f:
            f.write(text + "\n")

    print(decide(args.run_dir, rc=args.rc, from_line=args.from_line,
                 log_offset=args.log_offset, restarts=args.restarts,
                 max_restarts=args.max_restarts, max_resubmits=args.max_resubmits,
                 job_start=args.job_start, can_resubmit=not args.no_resubmit, say=say))
    return 0


if __name__ == "__main__":
    sys.exit(main())
