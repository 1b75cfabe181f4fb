"""The pieces of an unattended run without training: goodput, host collection, the
resubmission bound, the planner's checkpoint interval and TP check, the torchrun launch command,
token-weighted evaluation, --save-interval-minutes and the free-space check before a save."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_lite import unattended
from megatron_lite.arguments import build_parser, parse_with_notes
from megatron_lite.checkpoint import checkpointer
from megatron_lite.checkpoint.files import CheckpointError
from megatron_lite.config import ConfigError
from megatron_lite.errors import run_cli
from megatron_lite.parallel.state import single_process_state
from megatron_lite.planner import estimate_memory
from megatron_lite.reliability import preflight, watchdog
from megatron_lite.reliability.heartbeat import (
    PEER_LOST_EXIT_CODE,
    Beat,
    PeerLostError,
    Verdict,
    lost_peer,
)
from megatron_lite.training import evaluate, run
from megatron_lite.unattended import (
    STRAGGLER_EXCLUDE_FRACTION,
    STRAGGLER_EXCLUDE_INTERVALS,
    decide,
    goodput,
    hosts_named,
)

ROOT = Path(__file__).resolve().parents[2]
STUBS = Path(__file__).resolve().parent / "slurm_stubs"


@pytest.mark.quick
def test_goodput_counts_kept_steps_over_allocated_time():
    records = [
        {"iteration": 2, "loss": 1.0, "iter_time_ms": 500.0},  # iterations 1-2: 0.5 s each
        {"iteration": 4, "loss": 1.0, "iter_time_ms": 1000.0},  # 3-4, lost below
        {"event": "job_end", "allocated_s": 10.0},
        {"event": "resume", "iteration": 3, "resumed_from": 2},  # 3-4 redone
        {"iteration": 3, "loss": 1.0, "iter_time_ms": 250.0},
        {"iteration": 4, "loss": 1.0, "iter_time_ms": 250.0},
        {"event": "rollback", "iteration": 4, "restored_iteration": 3},  # 4 redone
        {"iteration": 4, "loss": 1.0, "iter_time_ms": 100.0},
        {"event": "job_end", "allocated_s": 5.0},
    ]
    productive, allocated = goodput(records)
    assert (productive, allocated) == pytest.approx((0.5 + 0.5 + 0.25 + 0.1, 15.0))
    assert "goodput: 9.0% = 1.4 s" in unattended.goodput_line(records)


@pytest.mark.quick
def test_hosts_named_by_hang_nan_straggler_and_preflight():
    log = "\n".join([
        "hang watchdog: rank 3 on host gpu-07, iteration 12: phase 'x' has run for 9 s",
        "NaN/Inf at iteration 5, found before any reduction in rank 1 (host gpu-02): the loss; "
        "rank 6 (host gpu-09): a gradient; step skipped on every rank",
        "warning: straggler: rank 4 on host gpu-05 has been 40% slower than the median rank "
        "for 6 log intervals (forward-backward 1.4 ms vs 1.0 ms; threshold 10%)",
        "preflight: FAILED on host gpu-11: local rank 0, cuda:0: GEMM on cuda:0 is wrong",
        "hang watchdog: rank 2 on host gpu-07, iteration 12: again",
        "iter 12 | loss 3.0 | on host gpu-99 (not a health message)",
    ])
    assert hosts_named(log) == ["gpu-07", "gpu-02", "gpu-09", "gpu-05", "gpu-11"]


def test_a_hang_is_blamed_on_the_stale_rank_not_the_rank_reporting_it():
    """nodeA's watchdog fires because rank 1 on nodeB stopped: nodeB is excluded, not nodeA
    (a live rank stuck in a phase is not blamed); with no stale rank named, the reporter is."""
    line = ("hang watchdog: rank 0 on host nodeA, iteration 3: phase 'forward-backward' has run "
            "for 31.0 s, more than --hang-timeout-seconds 30. Heartbeats: rank 1 (host nodeB, "
            "pid 4242) stopped answering 29.5 s ago, last heard from in phase 'forward-backward' "
            "of iteration 3; rank 2 (host nodeC, pid 77) is alive but has been in phase "
            "'forward-backward' of iteration 3 for 31.0 s. Stacks of every thread follow.")
    assert hosts_named(line) == ["nodeB"]
    alone = ("hang watchdog: rank 0 on host nodeA, iteration 3: phase 'checkpoint save' has run "
             "for 31.0 s. Heartbeats: every other rank's heartbeat is current.")
    assert hosts_named(alone) == ["nodeA"]
    unknown = ("hang watchdog: rank 0 on host nodeA, iteration 0: phase 'start-up' has run for "
               "31.0 s. Heartbeats: rank 1 never sent a heartbeat. Stacks follow.")
    assert hosts_named(unknown) == []  # the stale rank's host is unknown: nodeA is not it


def test_a_dead_peer_is_named_with_its_host_and_excluded(tmp_path):
    """The lost-peer error (`heartbeat.lost_peer`) names the dead rank's host from its last
    heartbeat; the launch then resubmits without that host instead of restarting in place."""
    beat = Beat(rank=1, seq=9, iteration=3, phase="forward-backward", phase_s=0.2,
                time=0.0, host="nodeB", pid=4242)
    verdict = Verdict(stale=[(1, beat, 12.0)], stuck=[])

    class _Beats:
        def verdict(self):
            return verdict

    err = lost_peer(_Beats(), RuntimeError("[pair.cc:537] Connection reset by peer. more"), 3,
                    "forward-backward")
    assert isinstance(err, PeerLostError)
    assert hosts_named(f"error: rank 0: {err}") == ["nodeB"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "train.log").write_text(f"error: rank 0: {err}\n")
    decision, _ = _decide(run_dir, rc=PEER_LOST_EXIT_CODE, restarts=0, max_restarts=1)
    assert decision == "resubmit nodeB"
    # lost before its first heartbeat: the host comes from the ranks' start-up gather
    never = Verdict(stale=[(1, None, 0.0)], stuck=[], hosts=("nodeA", "nodeB"))
    assert "rank 1 (host nodeB) never sent a heartbeat" in never.describe()
    assert hosts_named(f"error: rank 0: a collective failed because {never.describe()}") \
        == ["nodeB"]


def test_a_lost_peer_exits_with_its_own_code_not_a_user_mistakes(capsys):
    """2 stays for user mistakes; a lost peer keeps its one-line report but exits
    PEER_LOST_EXIT_CODE."""
    def lose(_: list[str]) -> int:
        raise PeerLostError("a collective failed because rank 1 never sent a heartbeat")

    def mistake(_: list[str]) -> int:
        raise ConfigError("--bad: not a flag")

    assert PEER_LOST_EXIT_CODE not in (0, 1, 2, 3, 4)
    assert run_cli(lose, []) == PEER_LOST_EXIT_CODE
    assert run_cli(mistake, []) == 2
    assert capsys.readouterr().err.count("error: ") == 2


def test_only_a_persistent_straggler_is_excluded():
    """A warning (10% for 3 intervals) is noise; STRAGGLER_EXCLUDE_FRACTION for
    STRAGGLER_EXCLUDE_INTERVALS excludes the host."""
    def line(pct: int, intervals: int) -> str:
        return (f"warning: straggler: rank 3 on host gpu-04 has been {pct}% slower than the "
                f"median rank for {intervals} log intervals (forward-backward 1 ms vs 1 ms)")
    pct = round(100 * STRAGGLER_EXCLUDE_FRACTION)
    assert hosts_named(line(12, 3)) == []
    assert hosts_named(line(52, STRAGGLER_EXCLUDE_INTERVALS - 1)) == []
    assert hosts_named(line(pct - 1, 30)) == []
    assert hosts_named(line(pct, STRAGGLER_EXCLUDE_INTERVALS)) == ["gpu-04"]
    assert hosts_named(line(52, 12)) == ["gpu-04"]


def _decide(run_dir: Path, **kw):
    said: list[str] = []
    args = dict(rc=0, from_line=0, log_offset=0, restarts=0, max_restarts=1, max_resubmits=2,
                job_start=0.0, can_resubmit=True, say=said.append)
    return decide(run_dir, **{**args, **kw}), said


def test_resubmissions_stop_at_max_resubmits(tmp_path):
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in (
        {"event": "resubmit", "count": 1}, {"event": "resubmit", "count": 2},
        {"event": "train_end", "iteration": 30, "train_iters": 50, "done": False})))
    assert _decide(tmp_path, from_line=2, max_resubmits=3)[0] == "resubmit"
    decision, said = _decide(tmp_path, from_line=2, max_resubmits=3)
    assert decision == "stop" and "MAX_RESUBMITS=3 reached" in said[0]


def test_failure_restarts_in_place_then_resubmits(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(
        {"iteration": 7, "loss": 2.0, "iter_time_ms": 1.0}) + "\n")
    assert _decide(tmp_path, rc=1, restarts=0)[0] == "restart"
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"iteration": 9, "loss": 2.0, "iter_time_ms": 1.0}) + "\n")
    assert _decide(tmp_path, rc=1, restarts=1, from_line=2)[0] == "resubmit"
    assert _decide(tmp_path, rc=1, restarts=0, can_resubmit=False)[0] == "stop"  # again at 9


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    """scripts/plan.py in this process (its search imports torch once, not per call)."""
    spec = importlib.util.spec_from_file_location("plan_script", ROOT / "scripts" / "plan.py")
    plan = importlib.util.module_from_spec(spec)
    sys.modules["plan_script"] = plan  # its dataclasses look their module up
    spec.loader.exec_module(plan)
    code = plan.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_tp_wider_than_a_node_and_young_daly_interval(tmp_path, capsys):
    code, _, err = _plan(capsys, "--preset", "8B", "--gpus", "64", "--tp", "16")
    assert code == 2 and "TP wider than a node (8 GPUs" in err, err
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text("".join(json.dumps({"iteration": i, "checkpoint_save_s": s}) + "\n"
                             for i, s in ((1, 50.0), (2, 40.0), (3, 30.0))))
    _, out, err = _plan(capsys, "--preset", "125M", "--gpus", "8", "--tp", "1", "--pp", "1",
                        "--save-seconds", str(jsonl), "--mtbf-hours", "168")
    # Daly for C = 40 s (the median save), M = 7 days: 1.92 h (RELIABILITY.md 1.6)
    assert "every 115.5 min = --save-interval" in out, out[-2000:] + err


def test_plan_grad_reduce_in_bf16_counts_16_bit_gradients_as_the_dry_run(capsys):
    """scripts/plan.py --grad-reduce-in-bf16 stores the gradients in 2 bytes, as
    `estimate_memory` (the dry run's planner figure) does for the flags it prints: Llama-7B
    ZeRO-1 on 8 GPUs holds 2 + 2 + 12/8 bytes per parameter (33.8 GiB), not 2 + 4 + 12/8
    (46.2 GiB: the gradients' bytes went only into the DP time before)."""
    shape = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "11008",
             "--num-attention-heads", "32", "--seq-length", "4096", "--vocab-size", "32000",
             "--global-batch-size", "64", "--gpus", "8", "--tp", "1", "--pp", "1",
             "--sharding", "optim", "--top", "1"]
    states = {}
    for extra in ([], ["--grad-reduce-in-bf16"]):
        code, out, err = _plan(capsys, *shape, *extra)
        assert code == 0, err
        lines = out.splitlines()
        row = lines[lines.index("fitting layouts, fastest first:") + 2].split()
        flags = lines[lines.index("pretrain.py flags for #1:") + 1].split()
        assert ("--grad-reduce-in-bf16" in flags) == bool(extra)
        est = estimate_memory(parse_with_notes(flags)[0], 8)
        states[bool(extra)] = float(row[12])
        assert states[bool(extra)] == round(est.state_bytes / 2**30, 1), (row, est)
    params = 6_607_343_616
    assert states[False] == round(params * (2 + 4 + 12 / 8) / 2**30, 1) == 46.2
    assert states[True] == round(params * (2 + 2 + 12 / 8) / 2**30, 1) == 33.8


def test_torchrun_launcher_command(tmp_path):
    """LAUNCHER=torchrun: one srun task per node running torchrun with the pretrain flags."""
    record = tmp_path / "srun.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(PATH=f"{STUBS}:{env['PATH']}", PYTHON=sys.executable, LAUNCHER="torchrun",
               MEGATRON_LITE_DIR=str(ROOT), RUN_DIR=str(tmp_path / "run"),
               FAKE_SRUN_ECHO=str(record),
               SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="1",
               SLURM_JOB_NODELIST="127.0.0.[1-2]", MAX_RESUBMITS="0")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "pretrain_llama_8b.sh")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = json.loads(record.read_text().splitlines()[0])
    assert step["ntasks_per_node"] == 1 and step["argv"][:2] == ["bash", "-c"]
    command = step["argv"][2]
    for part in ("-m torch.distributed.run --nnodes=2", "--node-rank=$SLURM_NODEID",
                 "--master-addr=127.0.0.1 --master-port=14242", "--max-restarts=0",
                 "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1"):
        assert part in " ".join(command.split()), command
    flags = command.split(" pretrain.py ", 1)[1]
    args = build_parser().parse_args(subprocess.run(
        ["bash", "-c", f"printf '%s\\n' {flags}"], capture_output=True, text=True
    ).stdout.splitlines())
    assert getattr(args, "checkpoint.save") == str(tmp_path / "run" / "checkpoints")
    assert getattr(args, "reliability.preflight") == "quick"


class _Runner:
    """Returns what StepRunner returns: each batch's masked token-loss sum / `num_tokens`."""

    chunks: tuple = ()

    def __call__(self, batches, num_tokens, *, backward=True):
        return sum((b["token_loss"] * b["loss_mask"]).sum() for b in batches) / num_tokens


class _Loader:
    def __init__(self, steps):
        self.steps, self.consumed_samples = iter(steps), 0

    def next_step(self):
        return next(self.steps)


def test_evaluation_is_a_token_weighted_mean_not_a_mean_of_batch_means():
    # two evaluation batches with 4 and 1 valid tokens: per-batch means 1.0 and 6.0
    first = {"token_loss": torch.tensor([[1.0, 1.0, 1.0, 1.0]]),
             "loss_mask": torch.tensor([[1.0, 1.0, 1.0, 1.0]])}
    second = {"token_loss": torch.tensor([[6.0, 9.0, 9.0, 9.0]]),
              "loss_mask": torch.tensor([[1.0, 0.0, 0.0, 0.0]])}
    cfg = SimpleNamespace(train=SimpleNamespace(eval_iters=2))
    loss = evaluate(cfg, _Runner(), _Loader([[first], [second]]), single_process_state())
    assert loss == pytest.approx((4 * 1.0 + 6.0) / 5)  # 2.0; the mean of means would be 3.5


def _tiny_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
            "--ffn-hidden-size", "64", "--seq-length", "16", "--vocab-size", "64", "--mock-data",
            "--micro-batch-size", "1", "--train-iters", "3", "--lr", "1e-3", "--eval-iters", "0",
            "--log-interval", "1", "--save", str(tmp_path / "ckpt"), "--log-jsonl",
            str(tmp_path / "m.jsonl"), *extra]


def test_save_interval_minutes_saves_by_wall_clock(tmp_path):
    """A wall-clock interval shorter than a step saves after every step; without it only the
    final save (iteration 3) would be written."""
    cfg, _, _ = parse_with_notes(_tiny_args(tmp_path, "--save-interval-minutes", "1e-9"))
    run(cfg)
    saved = [r["iteration"] for r in map(json.loads, (tmp_path / "m.jsonl").read_text()
                                         .splitlines()) if "checkpoint_save_s" in r]
    assert saved == [1, 2, 3]


def test_save_refused_when_the_disk_is_too_full(tmp_path, monkeypatch):
    full = shutil.disk_usage(tmp_path)._replace(free=1000)
    monkeypatch.setattr(checkpointer.shutil, "disk_usage", lambda _path: full)
    cfg, _, _ = parse_with_notes(_tiny_args(tmp_path, "--save-interval", "2"))
    with pytest.raises(CheckpointError, match=r"saving iteration 2 to .*only 0.000 GB are free"):
        run(cfg)
    assert not list((tmp_path / "ckpt").iterdir())  # no partial iter_0000002.tmp left behind


def test_plot_run_prints_the_goodput(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("plot_run_script",
                                                  ROOT / "scripts" / "plot_run.py")
    plot_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_run)
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in (
        {"iteration": 4, "loss": 2.0, "iter_time_ms": 500.0},
        {"event": "job_end", "job": "7", "allocated_s": 8.0})))
    assert plot_run.main([str(jsonl), "--out", str(tmp_path / "p.png")]) == 0
    assert "metrics.jsonl: goodput: 25.0% = 2.0 s of kept training steps / 8.0 s allocated " \
           "over 1 job(s)" in capsys.readouterr().out


def test_site_profile_and_nccl_transport_warning(tmp_path):
    """SITE=example sources scripts/site/example.env; NCCL's chosen transport goes into
    run_info.txt, and plain sockets on a multi-node job warn in the run log."""
    log = tmp_path / "train.log"
    log.write_text("x\nnode1:12:34 [0] NCCL INFO Using network Socket\n")
    script = (f'REPO_DIR={ROOT} RUN_NAME=t RUN_DIR={tmp_path} SLURM_NNODES=2 SITE=example '
              'TRANSPORT_WAIT_S=2; source scripts/common.sh; set +u; ml_nccl_env; '
              'echo "family=$NCCL_SOCKET_FAMILY debug=$NCCL_DEBUG/$NCCL_DEBUG_SUBSYS"; '
              f'ml_watch_transport {log} 0')
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "NCCL_", "GLOO_"))}
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env={**env, "PYTHON": "python3"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "fabric profile: " in proc.stdout and "family=AF_INET debug=INFO/NET" in proc.stdout
    assert "nccl transport: Socket" in (tmp_path / "run_info.txt").read_text()
    assert "warning: NCCL runs this 2-node job over plain TCP sockets" in log.read_text()


def test_preflight_failure_names_the_host_that_gets_excluded(capsys):
    cpu = torch.device("cpu")
    rate, failure = preflight.gemm_check(cpu, n=128, seconds=0.05)
    assert failure is None and rate > 0  # the result matched float64
    # a device far below its expected rate fails, and the line names this host
    assert not preflight.run_checks(cpu, 1e9, counters=False, allreduce=False, label="cpu")
    err = capsys.readouterr().err
    assert "bfloat16 GEMM on cpu ran at" in err and "under 25% of the expected 1e+09" in err
    assert hosts_named(err) == [socket.gethostname()]


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_watchdog_kills_a_frozen_rank_under_srun_and_torchrun(launcher, monkeypatch):
    """The stale rank's process on this host is SIGKILLed when its environment says it is that
    rank of this launch: srun sets only SLURM_PROCID (no RANK/MASTER_PORT), torchrun RANK. A
    process of another job step with the same rank number is left alone."""
    if launcher == "srun":
        ours = {"SLURM_NTASKS": "2", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}
        rank_var, other = "SLURM_PROCID", {**ours, "SLURM_STEP_ID": "1"}
    else:
        ours = {"WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29511"}
        rank_var, other = "RANK", {**ours, "MASTER_PORT": "29512"}
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "SLURM_PROCID",
                 "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**ours, rank_var: "0"}.items():
        monkeypatch.setenv(name, value)
    clean = {k: v for k, v in os.environ.items() if k not in ours and k != rank_var}
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    frozen = subprocess.Popen(sleep, env={**clean, **ours, rank_var: "1"})
    stranger = subprocess.Popen(sleep, env={**clean, **other, rank_var: "1"})
    try:
        time.sleep(0.5)  # the children's /proc environ is readable once they exec

        def stale(pid: int) -> Verdict:
            beat = Beat(rank=1, seq=3, iteration=2, phase="forward-backward", phase_s=9.0,
                        time=0.0, host=socket.gethostname(), pid=pid)
            return Verdict(stale=[(1, beat, 9.0)], stuck=[])

        assert watchdog._kill_local_stale(stale(stranger.pid)) == ""
        said = watchdog._kill_local_stale(stale(frozen.pid))
        assert f"killed stale rank 1 (pid {frozen.pid})" in said
        assert frozen.wait(timeout=10) == -signal.SIGKILL
        assert stranger.poll() is None
    finally:
        for proc in (frozen, stranger):
            proc.kill()
            proc.wait()
