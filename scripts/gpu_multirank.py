"""Two ranks on one GPU: TP=2 with sequence parallelism, PP=2, CP=2 (ring attention) and ZeRO-3
(--data-parallel-sharding-strategy optim_grads_params) in fp32, and TP=2 + SP and CP=2 in bf16
(on CUDA the ring runs the memory-efficient attention kernels, whose bf16 path nothing else
exercises), trained through torchrun with `--distributed-backend staged-gloo`, each compared
loss for loss with one process of the same run and dtype.

    python scripts/gpu_multirank.py --out DIR --layouts cp2_bf16,pp2   # only those

    python scripts/gpu_multirank.py --out DIR              # on a GPU (scripts/gpu_check.sh)
    python scripts/gpu_multirank.py --out DIR --device cpu # the same flow, the same backend

Why staged-gloo (megatron_lite/parallel/staged.py): NCCL refuses two ranks on one GPU, and
gloo on CUDA tensors has no send/recv (so no PP, no CP ring) and no reduce-scatter. staged-gloo
computes on the GPU and runs every collective and send/recv over gloo on host copies, and it
refuses a host tensor on a CUDA run as NCCL would. On the CPU it is the same code, staging
through fresh host buffers. A probe first runs, on two ranks, every collective these runs make,
the way they make it (through megatron_lite.parallel.comms where it has a helper) and checks
the values, so a broken op is named before the training runs fail on it; it also checks that
a host tensor is refused and tries the barrier that checkpoint saves use. fp32 losses must
agree to 1e-5 relative on CUDA; on the CPU those layouts run float64 (--fp64, as the CPU
equivalence tests run) and must agree to 1e-10; bf16 ones to 2e-2 (bf16 rounding of differently
ordered sums; the same bound gpu_check.sh holds its bf16 kernel comparison to). On the CPU the
default is the fp32 layouts (a bf16 attention core runs in fp32 there, so bf16 would prove
nothing new). Writes DIR/multirank.json and DIR/multirank.txt: one table of every requested
layout, ok or failed with the reason. Nothing is skipped: the exit status is 1 if a layout
failed, a probed op failed, or (on CUDA) a host tensor was not refused, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_lite.config import Config, ParallelConfig  # noqa: E402
from megatron_lite.errors import add_debug_flag, run_cli  # noqa: E402
from megatron_lite.parallel import comms, staged  # noqa: E402
from megatron_lite.parallel import state as parallel_state  # noqa: E402

TOLERANCE = {"cuda": 1e-5, "cpu": 1e-10}
"""Worst relative loss difference a non-bf16 layout may have from one process: fp32 on CUDA,
float64 (summation order alone, ~1e-16 per operation) on the CPU."""
BF16_TOLERANCE = 2e-2
EXIT_FAILED = 1
STAGING = ("collectives and send/recv staged through host memory over gloo, compute on the "
           "{device}")
"""What the runs' backend does, as the report prints it."""
# Odd vocabulary (padded at both TP sizes), GQA, 4 layers so PP=2 splits them evenly.
FLAGS = {
    "cuda": ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
             "--num-query-groups", "4", "--ffn-hidden-size", "768", "--seq-length", "256",
             "--vocab-size", "1000"],
    "cpu": ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "16",
            "--vocab-size", "97", "--make-vocab-size-divisible-by", "8", "--fp64"],
}
COMMON = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
          "--lr-warmup-iters", "2", "--eval-iters", "0", "--log-interval", "1", "--seed", "1",
          "--lr-decay-style", "cosine", "--adam-beta2", "0.95", "--distributed-timeout-minutes",
          "2"]
LAYOUTS = {"tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
           "pp2": ["--pipeline-model-parallel-size", "2"],
           "cp2": ["--context-parallel-size", "2"],
           "zero3": ["--data-parallel-sharding-strategy", "optim_grads_params"],
           "tp2_sp_bf16": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16"],
           "cp2_bf16": ["--context-parallel-size", "2", "--bf16"]}
DEFAULT_LAYOUTS = {"cuda": tuple(LAYOUTS),
                   "cpu": tuple(n for n in LAYOUTS if not n.endswith("_bf16"))}


def dtype_of(layout: str) -> str:
    return "bf16" if "--bf16" in LAYOUTS[layout] else "fp32"


def exit_code(runs: dict[str, dict], ops: dict[str, dict], device: str,
              host_refused: bool) -> int:
    """1 when a layout or a probed op failed, nothing ran, or CUDA took a host tensor; else 0."""
    broken = [op for op, info in ops.items() if op != "host_tensor" and info["status"] != "ok"]
    if (not runs or broken or any(r["status"] != "ok" for r in runs.values())
            or (device == "cuda" and not host_refused)):
        return EXIT_FAILED
    return 0


# ---------------------------------------------------------------------------------------------
# The probe (one process per rank, under torchrun)


def probe_ops(pstate: parallel_state.ParallelState) -> list[tuple[str, Callable[[], bool]]]:
    """(name, run -> values right) for each op, in the order run; send/recv last (it is the
    one most likely to take the process down)."""
    dev, group, rank = pstate.device, pstate.world_group, pstate.rank
    peer = 1 - rank

    def all_reduce(op: dist.ReduceOp.RedOpType, expect: float) -> bool:
        x = torch.full((8,), float(rank + 1), device=dev)
        return bool((comms.all_reduce_(x, group, op, kind="world") == expect).all())

    def all_gather(async_op: bool) -> bool:
        x = torch.full((3, 5), float(rank), device=dev)
        out, work = comms.all_gather_dim0(x, group, kind="world", async_op=async_op)
        if work is not None:
            work.wait()
        return bool((out == torch.arange(2, device=dev).repeat_interleave(3)[:, None]).all())

    def reduce_scatter(async_op: bool) -> bool:
        x = torch.arange(24.0, device=dev).view(4, 6) * (rank + 1)
        out, work = comms.reduce_scatter_dim0(x, group, kind="world", async_op=async_op)
        if work is not None:
            work.wait()
        return bool((out == 3 * torch.arange(24.0, device=dev).view(4, 6)[2 * rank:][:2]).all())

    def all_gather_list() -> bool:  # metrics.py gathers per-rank timings this way
        out = [torch.empty(2, dtype=torch.float64, device=dev) for _ in range(2)]
        dist.all_gather(out, torch.full((2,), float(rank), dtype=torch.float64, device=dev),
                        group=group)
        return all(bool((t == r).all()) for r, t in enumerate(out))

    def host_tensor() -> bool:
        """Goes through only on a CPU run; on a CUDA one staged-gloo must raise, as NCCL
        would, and the error is the refusal."""
        dist.all_reduce(torch.ones(1), group=group)
        return True

    def barrier() -> bool:  # what checkpoint saves wait on
        comms.barrier(group, dev, kind="world")
        return True

    def send_recv() -> bool:  # what pipeline/p2p.py posts for one boundary exchange
        send = torch.full((4, 3), float(rank), device=dev)
        recv = torch.empty(4, 3, device=dev)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer, tag=0),
                                            dist.P2POp(dist.irecv, recv, peer, tag=0)]):
            work.wait()
        return bool((recv == peer).all())

    return [("all_reduce", lambda: all_reduce(dist.ReduceOp.SUM, 3.0)),
            ("all_reduce_max", lambda: all_reduce(dist.ReduceOp.MAX, 2.0)),
            ("all_gather", lambda: all_gather(False)),
            ("all_gather_async", lambda: all_gather(True)),
            ("reduce_scatter", lambda: reduce_scatter(False)),
            ("reduce_scatter_async", lambda: reduce_scatter(True)),
            ("all_gather_objects", lambda: comms.all_gather_objects(
                f"r{rank}", group, dev, kind="world") == ["r0", "r1"]),
            ("all_gather_list", all_gather_list),
            ("host_tensor", host_tensor),
            ("barrier", barrier),
            ("send_recv", send_recv)]


def run_probe(out: Path, backend: str) -> int:
    """One rank of the probe: each op's start and outcome as a JSON line in probe_rankR.jsonl,
    written before the next op starts (a crash or hang leaves the op it happened in)."""
    cfg = Config(parallel=ParallelConfig(tensor_model_parallel_size=2,
                                         distributed_backend=backend,
                                         distributed_timeout_minutes=0.5))
    pstate = parallel_state.initialize(cfg)
    try:
        with open(out / f"probe_rank{pstate.rank}.jsonl", "w", buffering=1) as log:
            for name, fn in probe_ops(pstate):
                log.write(json.dumps({"op": name, "status": "start"}) + "\n")
                try:
                    status, detail = ("ok" if fn() else "wrong values"), ""
                    if pstate.device.type == "cuda":
                        torch.cuda.synchronize()
                except Exception as err:
                    status, detail = "error", f"{type(err).__name__}: {err}".split("\n")[0]
                log.write(json.dumps({"op": name, "status": status,
                                      "detail": detail[:300]}) + "\n")
    finally:
        parallel_state.destroy(pstate)
    return 0


def read_probe(out: Path, rc: int) -> dict[str, dict]:
    """op -> {"status", "detail"} over both ranks: ok only if every rank says ok; an op a rank
    started and never finished is where the probe died or hung."""
    ops: dict[str, dict] = {}
    for rank in range(2):
        path = out / f"probe_rank{rank}.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        ended = set()
        for rec in lines:
            if rec["status"] == "start":
                continue
            ended.add(rec["op"])
            if ops.get(rec["op"], {}).get("status", "ok") == "ok":
                ops[rec["op"]] = {"status": rec["status"],
                                  "detail": f"rank {rank}: {rec['detail']}" if rec["detail"]
                                  else ""}
        for rec in lines:
            if rec["status"] == "start" and rec["op"] not in ended:
                ops[rec["op"]] = {"status": "error", "detail": f"rank {rank} never finished "
                                  f"it (the probe died or hung here; exit code {rc})"}
    return ops


# ---------------------------------------------------------------------------------------------
# The runs


def read_losses(path: Path) -> list[float]:
    if not path.exists():
        return []
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def compare(losses: list[float], single: list[float], iters: int,
            tolerance: float = TOLERANCE["cuda"]) -> tuple[bool, str]:
    """(agrees, description) of a layout's losses against the one-process run's."""
    if len(losses) != iters or len(single) != iters:
        return False, f"{len(losses)} losses logged vs {len(single)} in one process ({iters} due)"
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, single))
    text = (f"{iters}/{iters} losses vs one process, worst relative difference {worst:.2e} "
            f"(tolerance {tolerance:g}); loss {single[0]:.4f} -> {single[-1]:.4f}")
    if not single[-1] < single[0]:
        return False, text + ": the loss did not fall, so agreeing proves little"
    return worst <= tolerance, text


class Job:
    """A child process whose output goes to OUT/multirank_NAME.log."""

    def __init__(self, name: str, cmd: list[str], out: Path, env: dict[str, str]) -> None:
        self.name, self.log = name, out / f"multirank_{name}.log"
        print(f"== multirank {name}: {' '.join(cmd)}", flush=True)
        self.start = time.perf_counter()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT)

    def wait(self, timeout: float) -> int:
        """Exit code (124 after killing it at the timeout); prints the log's tail on failure."""
        try:
            rc = self.proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - self.start)))
        except subprocess.TimeoutExpired:
            self.proc.terminate()  # torchrun stops its workers (SIGKILL after its 30 s grace)
            try:
                self.proc.wait(timeout=45)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            rc = 124
        self.seconds = time.perf_counter() - self.start
        print(f"== multirank {self.name}: exit {rc} after {self.seconds:.0f} s", flush=True)
        if rc:
            print("\n".join(self.log.read_text().splitlines()[-25:]), flush=True)
        return rc


def _parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The arguments and the layouts to run, in the order asked (unknown ones refused)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--backend", choices=(staged.NAME, "nccl", "gloo"), default=staged.NAME,
                        help="staged-gloo: two ranks share one GPU (the default); nccl: one "
                        "GPU each (2+ GPUs); gloo: plain, on the CPU")
    parser.add_argument("--iters", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--layouts", help="comma-separated, of " + ", ".join(LAYOUTS) +
                        " (default: all on cuda, the fp32 ones on cpu)")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    layouts = (args.layouts.split(",") if args.layouts else list(DEFAULT_LAYOUTS[args.device]))
    unknown = [n for n in layouts if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout {unknown[0]}: choose from {', '.join(LAYOUTS)}")
    return args, layouts


class Launcher:
    """How every child of one invocation starts: one environment, one torchrun command line,
    the base flags, and a fresh loss file per run (the logger appends to an existing one)."""

    def __init__(self, args: argparse.Namespace, backend: str) -> None:
        self.out, self.backend = args.out, backend
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        if args.device == "cpu":
            self.env["CUDA_VISIBLE_DEVICES"] = ""
        self.torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc_per_node=2"]
        self.flags = [*FLAGS[args.device], *COMMON, "--train-iters", str(args.iters)]

    def flags_for(self, dtype: str) -> list[str]:
        """bf16 runs drop the CPU's --fp64 (the two are exclusive)."""
        return [f for f in self.flags if f != "--fp64"] if dtype == "bf16" else self.flags

    def jsonl(self, name: str) -> Path:
        path = self.out / f"multirank_{name}.jsonl"
        path.unlink(missing_ok=True)
        return path

    def single(self, name: str, dtype: str) -> Job:
        """The one-process reference run of `dtype`."""
        return Job(name, [sys.executable, "pretrain.py", *self.flags_for(dtype),
                          *(["--bf16"] if dtype == "bf16" else []), "--log-jsonl",
                          str(self.jsonl(name))], self.out, self.env)

    def command(self, name: str) -> list[str]:
        """Layout `name`'s torchrun command line: two ranks over the invocation's backend."""
        return [*self.torchrun, "pretrain.py", *self.flags_for(dtype_of(name)), *LAYOUTS[name],
                "--distributed-backend", self.backend, "--log-jsonl",
                str(self.out / f"multirank_{name}.jsonl")]

    def layout(self, name: str) -> Job:
        """Layout `name` started, with a fresh loss file."""
        self.jsonl(name)
        return Job(name, self.command(name), self.out, self.env)


def judge(name: str, job: Job, rc: int, single_rc: int, single_losses: list[float],
          single_log: str, iters: int, tolerance: float) -> dict:
    """A finished layout's row: failed (its own exit status, or no reference to compare
    with), else ok or failed by how its losses agree with the one-process run's."""
    losses = read_losses(job.log.with_suffix(".jsonl"))  # multirank_NAME.jsonl
    dtype = dtype_of(name)
    if rc:
        run = {"status": "failed", "reason": f"exit {rc} (see {job.log.name})"}
    elif single_rc:
        run = {"status": "failed", "reason": f"the one-process {dtype} run failed "
               f"(exit {single_rc}, see {single_log}); nothing to compare with"}
    else:
        agrees, text = compare(losses, single_losses, iters, tolerance)
        run = {"status": "ok" if agrees else "failed", "reason": text}
    return {**run, "losses": losses, "seconds": job.seconds}


def _main(argv: list[str]) -> int:
    args, layouts = _parse_args(argv)
    backend = args.backend
    args.out.mkdir(parents=True, exist_ok=True)
    if args.probe:
        return run_probe(args.out, backend)
    for stale in args.out.glob("probe_rank*.jsonl"):
        stale.unlink()
    launch = Launcher(args, backend)
    # The one-process reference runs while the probe decides what the layouts can run.
    probe = Job("probe", [*launch.torchrun, str(Path(__file__).resolve()), "--probe", "--out",
                          str(args.out), "--device", args.device, "--backend", backend],
                args.out, launch.env)
    # One reference per dtype the requested layouts use ("single" is fp32, as before).
    refs = {d: ("single" if d == "fp32" else f"single_{d}")
            for d in dict.fromkeys(dtype_of(n) for n in layouts)}
    singles = {d: launch.single(ref, d) for d, ref in refs.items()}
    ops = read_probe(args.out, probe.wait(120))
    runs: dict[str, dict] = {}
    jobs = {n: launch.layout(n) for n in layouts}
    single_rcs = {d: job.wait(args.timeout) for d, job in singles.items()}
    single_losses = {d: read_losses(args.out / f"multirank_{ref}.jsonl")
                     for d, ref in refs.items()}
    for name, job in jobs.items():
        dtype = dtype_of(name)
        runs[name] = judge(name, job, job.wait(args.timeout), single_rcs[dtype],
                           single_losses[dtype], singles[dtype].log.name, args.iters,
                           BF16_TOLERANCE if dtype == "bf16" else TOLERANCE[args.device])
    host = ops.get("host_tensor", {"status": "not run", "detail": ""})
    refused = host["status"] == "error"
    result = {"backend": backend, "device": args.device, "iters": args.iters,
              "flags": launch.flags, "probe": ops, "host_tensor_refused": refused,
              "single_losses": single_losses.get("fp32", []),
              "single_exit": single_rcs.get("fp32"), "single_bf16_losses":
              single_losses.get("bf16", []), "single_bf16_exit": single_rcs.get("bf16"),
              "runs": {name: runs[name] for name in layouts}}  # the requested order
    # On CUDA the point is that a host tensor fails the run: if staged-gloo took one, say so.
    result["exit"] = exit_code(result["runs"], ops, args.device, refused)
    lines = report_lines(result)
    (args.out / "multirank.json").write_text(json.dumps(result, indent=1))
    (args.out / "multirank.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return result["exit"]


def main(argv: list[str] | None = None) -> int:
    """A user mistake ends in one `error:` line and exit status 2 (megatron_lite/errors.py)."""
    return run_cli(_main, argv)


def report_lines(result: dict) -> list[str]:
    """The summary lines (also written to OUT/multirank.txt)."""
    dtype = "float64" if "--fp64" in result["flags"] else "fp32"
    ops, lines = result["probe"], [
        f"multirank ({result['backend']}, 2 ranks on {result['device']}, {dtype}, "
        f"{result['iters']} iterations, {' '.join(result['flags'][:10])}):",
        "  " + (STAGING.format(device=result["device"]) if result["backend"] == staged.NAME
                else f"collectives and send/recv over {result['backend']} itself")]
    lines.append("  probe: " + (", ".join(
        f"{op} {info['status']}" + (f" ({info['detail']})" if info["detail"] else "")
        for op, info in ops.items() if op != "host_tensor") or "no result"))
    host = ops.get("host_tensor", {"status": "not run", "detail": ""})
    refusal = (f"refused, as NCCL would ({host['detail']})" if result["host_tensor_refused"]
               else f"NOT refused ({host['status']})")
    lines.append(f"  host tensor in a collective: {refusal}")
    lines += table_lines(result["runs"])
    return lines


def table_lines(runs: dict[str, dict]) -> list[str]:
    """One row per requested layout, `name: status: reason` (ok = ran and agreed with one
    process, else failed with why), then the counts."""
    lines = ["  layouts (layout: ok | failed: what it showed):"]
    lines += [f"  {name}: {run['status']}: {run['reason']}" for name, run in runs.items()]
    ok = sum(r["status"] == "ok" for r in runs.values())
    verdict = "all ran and agreed" if runs and ok == len(runs) else "FAILED"
    lines.append(f"  {len(runs)} layouts: {ok} ran ok, {len(runs) - ok} failed: {verdict}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
