"""Pipeline bubble: measured idle fraction per stage, against theory and the simulator.

Each stage runs the real engine and schedule over gloo, but its chunks only sleep: a forward
takes t_f / v and a backward t_b / v per chunk (split by the zero-bubble schedules into B,
t_b - t_w, and W, t_w), so the work per stage and micro-batch is fixed and known and
everything else the stage spends is pipeline bubble (plus transfer overhead, which the
tolerance absorbs). Idle fraction of a stage = 1 - busy / step time.

Rows: 1F1B (v = 1) and interleaved 1F1B (v = 2) at p in {2, 4}, m in {4, 8, 16}, against
(p - 1) / (v*m + p - 1); ZB-H1 and ZBV at p = 4, m in {8, 16}, their timelines built for
these F, B and W times (`build_schedule(costs=...)`), shown beside the paper's bubble
(`planner.bubble_time`; at F = B = W the simulator's too). Every row is also compared
with the simulator (tests/pipeline/simulator.py) playing the same action lists with the
costs measured in the run (the sleeps plus Python and autograd overhead). Also reports the
1F1B -> interleaved speed-up at equal m, and ZB-H1 vs 1F1B and ZBV vs interleaved.

    python bench/pipeline_bubble.py [--tf-ms 100 --tb-ms 200 --tw-ms 100 --steps 2]

Prints a table and writes bench/results/pipeline_bubble.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite import schedules
from megatron_lite.config import Config, ParallelConfig
from megatron_lite.layers.linear import WeightGradQueue
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.launch import LaunchEnv
from megatron_lite.pipeline.engine import forward_backward
from megatron_lite.pipeline.p2p import StageComm
from megatron_lite.pipeline.partition import virtual_stage
from megatron_lite.pipeline.schedule import build_schedule, stage_schedule
from megatron_lite.planner import bubble_time
from tests.pipeline.simulator import simulate

SHAPE = (8, 1, 16)  # [s, b, h]: tiny, so transfers cost little next to the sleeps
CHUNKS = {name: s.stage_chunks(2) for name, s in schedules.SCHEDULES.items()}
"""Chunks per stage of each row: interleaved at v = 2."""
PLAIN = tuple(name for name, s in schedules.SCHEDULES.items() if not s.split_backward)


def baseline(kind: str) -> str | None:
    """The schedule a row is compared with: a zero-bubble one's plain schedule with as many
    chunks (ZB-H1: 1F1B, ZBV: interleaved), interleaved's 1F1B."""
    if schedules.get(kind).split_backward:
        return schedules.get(None, CHUNKS[kind]).name
    return schedules.ONE_F_ONE_B.name if CHUNKS[kind] > 1 else None


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each sleep a fixed time and count it as busy.

    For a chunk with a `weight_grads` queue (zero-bubble schedules) the backward sleeps
    B's share and queues W's sleep, as the real layers queue their weight GEMMs."""

    @staticmethod
    def forward(ctx, x: Tensor, chunk: SleepChunk) -> Tensor:
        ctx.chunk = chunk
        chunk.work("F", chunk.forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        chunk = ctx.chunk
        if chunk.weight_grads is None:
            chunk.work("BW", chunk.backward_s)
        else:
            chunk.work("B", chunk.backward_s - chunk.weight_s)
            chunk.weight_grads.push(chunk.weight, chunk.weight_grad)
        return grad.clone(), None


class SleepChunk(nn.Module):
    def __init__(self, pre_process: bool, post_process: bool, forward_s: float,
                 backward_s: float, weight_s: float, split: bool,
                 busy: dict[str, list[float]]) -> None:
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.forward_s, self.backward_s, self.weight_s = forward_s, backward_s, weight_s
        self.busy = busy
        self.weight = nn.Parameter(torch.ones(()))
        self.weight_grads = WeightGradQueue() if split else None
        if split:
            self.weight_grads.register(self.weight)

    def work(self, kind: str, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.busy[kind].append(time.perf_counter() - start)

    def weight_grad(self) -> Tensor:
        self.work("W", self.weight_s)
        return torch.zeros(())

    def forward(self, x: Tensor, labels: Tensor | None = None) -> Tensor:
        h = torch.zeros(SHAPE, requires_grad=True) if self.pre_process else x
        if self.weight_grads is None:
            h = self.weight * h
        h = _Sleep.apply(h, self)
        return h.sum(-1).t() if self.post_process else h  # per-token "loss" [b, s]


def _measure(pstate, pp: int, kind: str, m: int, args, steps: int) -> dict:
    busy: dict[str, list[float]] = defaultdict(list)
    v = CHUNKS[kind]
    split = schedules.get(kind).split_backward
    tf, tb, tw = args.tf_ms / 1e3, args.tb_ms / 1e3, args.tw_ms / 1e3
    actions = stage_schedule(pp, pstate.pp_rank, m, v, kind=kind, costs=_costs(args))
    chunks = []
    for spec in _chunk_specs(pp, pstate.pp_rank, kind):
        chunks.append(SleepChunk(*spec, tf / v, tb / v, tw / v, split, busy))
    comm = StageComm(pstate, SHAPE, torch.float32)
    batches = [{"tokens": torch.zeros(1, 8, dtype=torch.long), "labels": torch.zeros(1, 8)}
               for _ in range(m)]
    idles = []
    for _ in range(steps + 1):  # the first step warms up gloo connections
        dist.barrier()
        busy.clear()
        start = time.perf_counter()
        forward_backward(chunks, actions, batches, comm, lambda t, b: t.mean())
        dist.barrier()
        total = sum(sum(times) for times in busy.values())
        idles.append(1.0 - total / (time.perf_counter() - start))
    mean = {k: statistics.mean(times) * v for k, times in busy.items()}  # whole-stage costs
    return {"idle": statistics.median(idles[1:]), "costs": mean}


def _chunk_specs(pp: int, rank: int, kind: str) -> list[tuple[bool, bool]]:
    """(pre_process, post_process) of this stage's chunks under the schedule's placement."""
    v, v_shape = CHUNKS[kind], schedules.get(kind).v_shape
    virtual = [virtual_stage(pp, rank, c, v_shape) for c in range(v)]
    return [(n == 0, n == pp * v - 1) for n in virtual]


def _worker(rank: int, pp: int, init_file: str, rows: list, args, out_file: str) -> None:
    torch.set_num_threads(1)
    env = LaunchEnv(rank=rank, local_rank=rank, world_size=pp, local_world_size=pp,
                    master_addr="127.0.0.1", master_port=0, source="test", node_rank=0,
                    num_nodes=1)
    cfg = Config(parallel=ParallelConfig(pipeline_model_parallel_size=pp,
                                         distributed_backend="gloo"))
    pstate = parallel_state.initialize(cfg, env=env, init_method=f"file://{init_file}")
    results = []
    for kind, m in rows:
        mine = _measure(pstate, pp, kind, m, args, args.steps)
        gathered = [None] * pp
        dist.all_gather_object(gathered, mine)
        results.append({"pp": pp, "schedule": kind, "v": CHUNKS[kind], "m": m,
                        "idle_per_stage": [g["idle"] for g in gathered],
                        "measured_costs": _mean_costs([g["costs"] for g in gathered])})
    if rank == 0:
        Path(out_file).write_text(json.dumps(results))
    parallel_state.destroy(pstate)


def _costs(args) -> tuple[float, float, float]:
    """(F, B, W) the zero-bubble timelines are built for: the sleeps of this run."""
    return args.tf_ms, args.tb_ms - args.tw_ms, args.tw_ms


def _mean_costs(per_stage: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.mean(c[k] for c in per_stage) for k in per_stage[0]}


def simulated_idle(row: dict, args) -> list[float]:
    """Per-stage idle fraction the simulator predicts for the row's schedule and costs."""
    kind, pp, m, costs = row["schedule"], row["pp"], row["m"], row["measured_costs"]
    v = CHUNKS[kind]
    schedule = build_schedule(pp, m, v, kind=kind, costs=_costs(args))
    if "W" in costs:
        result = simulate(schedule, m, v, costs["F"], costs["B"] + costs["W"],
                          weight_time=costs["W"], v_shape=schedules.get(kind).v_shape)
    else:
        result = simulate(schedule, m, v, costs["F"], costs["BW"])
    return [1.0 - busy / result.makespan for busy in result.busy]


def _report(rows_out: list[dict], args) -> list[dict]:
    print(f"{'p':>2} {'schedule':>11} {'m':>3} {'theory':>7} {'sim':>6} {'worst stage':>11} "
          f"{'mean':>6} {'|err|':>6} ok")
    mean_idle = {}
    for row in rows_out:
        p, v, m, kind = row["pp"], row["v"], row["m"], row["schedule"]
        idle = row["idle_per_stage"]
        row["simulated_idle_per_stage"] = sim = simulated_idle(row, args)
        row["max_abs_error_vs_simulator"] = max(abs(a - b) for a, b in zip(idle, sim))
        refs = [row["max_abs_error_vs_simulator"]]
        if schedules.get(kind).split_backward:  # the paper's bubble for these costs (not checked)
            costs = _costs(args)
            bubble = bubble_time(p, sum(costs), v, kind, costs)
            row["theory"] = bubble / (m * sum(costs) + bubble)
        else:
            row["theory"] = (p - 1) / (v * m + p - 1)
            row["max_abs_error"] = max(abs(x - row["theory"]) for x in idle)
            refs.append(row["max_abs_error"])
        row["within_0_05"] = max(refs) <= 0.05
        worst = max(zip(idle, sim), key=lambda pair: abs(pair[0] - pair[1]))[0]
        theory = f"{row['theory']:7.3f}"
        print(f"{p:>2} {kind:>11} {m:>3} {theory} {statistics.mean(sim):6.3f} {worst:11.3f} "
              f"{statistics.mean(idle):6.3f} {max(refs):6.3f} "
              f"{'yes' if row['within_0_05'] else 'NO'}")
        mean_idle[(p, kind, m)] = statistics.mean(idle)
    comparisons = []
    for (p, kind, m), idle in mean_idle.items():
        base = baseline(kind)
        if base is None or (p, base, m) not in mean_idle:
            continue
        ratio = (1 - idle) / (1 - mean_idle[(p, base, m)])
        comparisons.append({"pp": p, "m": m, "schedule": kind, "baseline": base,
                            "idle": idle, "baseline_idle": mean_idle[(p, base, m)],
                            "busy_fraction_ratio": ratio})
        print(f"p={p} m={m}: {kind} idle {idle:.3f} vs {base} {mean_idle[(p, base, m)]:.3f} "
              f"(busy fraction {ratio:.3f}x)")
    return comparisons


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tf-ms", type=float, default=100.0, help="forward time per stage")
    parser.add_argument("--tb-ms", type=float, default=200.0,
                        help="backward time per stage (B + W)")
    parser.add_argument("--tw-ms", type=float, default=100.0,
                        help="W's part of the backward under the zero-bubble schedules")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per row (median)")
    parser.add_argument("--zero-bubble-only", action="store_true",
                        help="only p = 4, m in {8, 16}: ZB-H1, ZBV and their baselines")
    args = parser.parse_args()
    plan = {4: [(kind, m) for m in (8, 16) for kind in CHUNKS]}
    if not args.zero_bubble_only:
        plan = {2: [(kind, m) for m in (4, 8, 16) for kind in PLAIN],
                4: [(kind, m) for m in (4, 8, 16) for kind in PLAIN]
                + [(kind, m) for m in (8, 16) for kind in schedules.ZERO_BUBBLE]}
    rows_out = []
    for pp, rows in plan.items():
        with tempfile.TemporaryDirectory() as tmp:
            out_file = os.path.join(tmp, "out.json")
            mp.spawn(_worker, args=(pp, os.path.join(tmp, "rdzv"), rows, args, out_file),
                     nprocs=pp)
            rows_out += json.loads(Path(out_file).read_text())
    comparisons = _report(rows_out, args)
    out = Path(__file__).resolve().parent / "results" / "pipeline_bubble.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows_out,
                               "comparisons": comparisons}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
