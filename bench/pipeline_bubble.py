"""Pipeline bubble: measured idle fraction per stage vs (p - 1) / (v*m + p - 1).

Each stage runs the real engine and schedule over gloo, but its chunks only sleep: a forward
takes t_f / v and a backward t_b / v per chunk, so the work per stage and micro-batch is
fixed and known and everything else the stage spends is pipeline bubble (plus transfer
overhead, which the tolerance absorbs). Idle fraction of a stage = 1 - busy / step time.
Also reports the 1F1B -> interleaved speed-up at equal m, the in-run baseline.

    python bench/pipeline_bubble.py [--tf-ms 100 --tb-ms 200 --steps 2]

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
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.config import Config, ParallelConfig
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.launch import LaunchEnv
from megatron_lite.pipeline.engine import forward_backward
from megatron_lite.pipeline.p2p import StageComm
from megatron_lite.pipeline.schedule import stage_schedule

SHAPE = (8, 1, 16)  # [s, b, h]: tiny, so transfers cost little next to the sleeps


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each sleep a fixed time and count it as busy."""

    @staticmethod
    def forward(ctx, x: Tensor, chunk: SleepChunk) -> Tensor:
        ctx.chunk = chunk
        chunk.work(chunk.forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        ctx.chunk.work(ctx.chunk.backward_s)
        return grad.clone(), None


class SleepChunk(nn.Module):
    def __init__(self, pre_process: bool, post_process: bool, forward_s: float,
                 backward_s: float, busy: list[float]) -> None:
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.forward_s, self.backward_s, self.busy = forward_s, backward_s, busy
        self.weight = nn.Parameter(torch.ones(()))

    def work(self, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.busy[0] += time.perf_counter() - start

    def forward(self, x: Tensor, labels: Tensor | None = None) -> Tensor:
        h = self.weight * (torch.zeros(SHAPE) if self.pre_process else x)
        h = _Sleep.apply(h, self)
        return h.sum(-1).t() if self.post_process else h  # per-token "loss" [b, s]


def _measure(pstate, pp: int, v: int, m: int, tf: float, tb: float, steps: int) -> dict:
    busy = [0.0]
    chunks = [SleepChunk(pstate.pp_rank == 0 and c == 0, pstate.is_last_stage and c == v - 1,
                         tf / v, tb / v, busy) for c in range(v)]
    actions = stage_schedule(pp, pstate.pp_rank, m, v)
    comm = StageComm(pstate, SHAPE, torch.float32)
    batches = [{"tokens": torch.zeros(1, 8, dtype=torch.long), "labels": torch.zeros(1, 8)}
               for _ in range(m)]
    idles = []
    for _ in range(steps + 1):  # the first step warms up gloo connections
        dist.barrier()
        busy[0] = 0.0
        start = time.perf_counter()
        forward_backward(chunks, actions, batches, comm, lambda t, b: t.mean())
        dist.barrier()
        idles.append(1.0 - busy[0] / (time.perf_counter() - start))
    return {"idle": statistics.median(idles[1:])}


def _worker(rank: int, pp: int, init_file: str, rows: list, args, out_file: str) -> None:
    torch.set_num_threads(1)
    env = LaunchEnv(rank=rank, local_rank=rank, world_size=pp, local_world_size=pp,
                    master_addr="127.0.0.1", master_port=0, source="test", node_rank=0,
                    num_nodes=1)
    cfg = Config(parallel=ParallelConfig(pipeline_model_parallel_size=pp,
                                         distributed_backend="gloo"))
    pstate = parallel_state.initialize(cfg, env=env, init_method=f"file://{init_file}")
    results = []
    for m, v in rows:
        mine = _measure(pstate, pp, v, m, args.tf_ms / 1e3, args.tb_ms / 1e3, args.steps)
        gathered = [None] * pp
        dist.all_gather_object(gathered, mine["idle"])
        results.append({"pp": pp, "v": v, "m": m, "idle_per_stage": gathered})
    if rank == 0:
        Path(out_file).write_text(json.dumps(results))
    parallel_state.destroy(pstate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tf-ms", type=float, default=100.0, help="forward time per stage")
    parser.add_argument("--tb-ms", type=float, default=200.0, help="backward time per stage")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per row (median)")
    args = parser.parse_args()
    rows_out = []
    for pp in (2, 4):
        rows = [(m, v) for m in (4, 8, 16) for v in (1, 2)]
        with tempfile.TemporaryDirectory() as tmp:
            out_file = os.path.join(tmp, "out.json")
            mp.spawn(_worker, args=(pp, os.path.join(tmp, "rdzv"), rows, args, out_file),
                     nprocs=pp)
            rows_out += json.loads(Path(out_file).read_text())
    speedup = {}
    print(f"{'p':>2} {'v':>2} {'m':>3} {'theory':>7} {'worst stage':>11} {'mean':>6} "
          f"{'|err|':>6} ok")
    for row in rows_out:
        p, v, m = row["pp"], row["v"], row["m"]
        row["theory"] = (p - 1) / (v * m + p - 1)
        idle = row["idle_per_stage"]
        row["max_abs_error"] = max(abs(x - row["theory"]) for x in idle)
        row["within_0_05"] = row["max_abs_error"] <= 0.05
        worst = max(idle, key=lambda x: abs(x - row["theory"]))
        print(f"{p:>2} {v:>2} {m:>3} {row['theory']:7.3f} {worst:11.3f} "
              f"{statistics.mean(idle):6.3f} {row['max_abs_error']:6.3f} "
              f"{'yes' if row['within_0_05'] else 'NO'}")
        speedup.setdefault((p, m), {})[v] = 1 - statistics.mean(idle)
    ratios = [{"pp": p, "m": m, "interleaved_over_1f1b_utilisation": u[2] / u[1]}
              for (p, m), u in speedup.items()]
    for r in ratios:
        print(f"p={r['pp']} m={r['m']}: interleaved/1F1B busy fraction "
              f"{r['interleaved_over_1f1b_utilisation']:.3f}x")
    out = Path(__file__).resolve().parent / "results" / "pipeline_bubble.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows_out, "ratios": ratios},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
