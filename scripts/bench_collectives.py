"""Collective bandwidth: all-reduce, all-gather, reduce-scatter and send/recv over message sizes.

Run it the way training runs, so it measures the same fabric and the same launch path:

    torchrun --standalone --nproc_per_node=8 scripts/bench_collectives.py           # one node
    srun --ntasks-per-node=8 --gpus-per-node=8 python scripts/bench_collectives.py  # Slurm

nccl on GPU, gloo on CPU. Bus bandwidth follows the nccl-tests convention so the numbers compare
with theirs and with the link speed: all-reduce moves 2(n-1)/n of the buffer over each link,
all-gather and reduce-scatter (n-1)/n of the full (gathered) buffer, send/recv (a ring: every rank
sends to the next) the whole message. The time of one call is the slowest rank's mean. As a
baseline measured in the same run, each row also shows a local device copy of the same size.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.config import ConfigError
from megatron_lite.errors import add_debug_flag, run_cli
from megatron_lite.parallel.launch import (
    check_devices_per_node,
    check_port_free,
    detect_launch_env,
)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
KIB, MIB = 1024, 1024 * 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {OPS}")
    p.add_argument("--min-bytes", type=int, default=4 * KIB)
    p.add_argument(
        "--max-bytes",
        type=int,
        default=None,
        help="largest message; default 512 MiB on GPU, 16 MiB on CPU (gloo is slow and the box "
        "is shared; raise it explicitly)",
    )
    p.add_argument("--step-factor", type=int, default=4, help="size multiplier between rows")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per size")
    p.add_argument(
        "--time-budget", type=float, default=0.2, help="target seconds of timed calls per row"
    )
    p.add_argument("--max-iters", type=int, default=200)
    p.add_argument("--timeout-minutes", type=float, default=5.0, help="collective timeout")
    p.add_argument("--json", default="bench/results/bench_collectives.json", help="output file")
    add_debug_flag(p)
    return p.parse_args(argv)


def init(args: argparse.Namespace) -> tuple[torch.device, str]:
    """Rendezvous from torchrun or Slurm variables (the same code path as training)."""
    env = detect_launch_env()
    use_cuda = torch.cuda.is_available() and args.backend != "gloo"
    backend = "nccl" if use_cuda else "gloo"
    if args.backend == "nccl" and not use_cuda:
        raise ConfigError("--backend nccl needs CUDA; this machine has none (use --backend gloo)")
    if use_cuda:
        check_devices_per_node(env, torch.cuda.device_count())
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    # Under torchrun the agent already listens on MASTER_PORT; only srun ranks open it themselves.
    if env.source == "slurm" and env.rank == 0:
        check_port_free(env.master_addr, env.master_port)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(minutes=args.timeout_minutes),
        **({"device_id": device} if use_cuda else {}),
    )
    return device, backend


def make_op(name: str, nbytes: int, dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    """One call of collective ``name`` on a message of ``nbytes`` (the nccl-tests 'size')."""
    n, rank = dist.get_world_size(), dist.get_rank()
    elems = nbytes // torch.tensor([], dtype=dtype).element_size()
    elems -= elems % n  # gather/scatter shards must be equal
    full = torch.ones(elems, dtype=dtype, device=device)
    shard = torch.ones(elems // n, dtype=dtype, device=device)
    if name == "all_reduce":
        return lambda: dist.all_reduce(full)
    if name == "all_gather":
        return lambda: dist.all_gather_single(full, shard)
    if name == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(shard, full)
    recv = torch.empty_like(full)

    def send_recv() -> None:
        ops = [
            dist.P2POp(dist.isend, full, (rank + 1) % n),
            dist.P2POp(dist.irecv, recv, (rank - 1) % n),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return send_recv


def bus_factor(name: str, n: int) -> float:
    """Bytes over the busiest link per byte of message (nccl-tests PERFORMANCE.md convention)."""
    if name == "all_reduce":
        return 2 * (n - 1) / n
    if name in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_calls(fn: Callable[[], None], args: argparse.Namespace, device: torch.device) -> float:
    """Mean seconds per call, the slowest rank's; every rank runs the same number of calls."""
    for _ in range(args.warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    probe = _max_over_ranks(time.perf_counter() - start, device)
    iters = int(min(args.max_iters, max(3, args.time_budget / max(probe, 1e-7))))
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return _max_over_ranks((time.perf_counter() - start) / iters, device)


def local_copy_gbps(nbytes: int, dtype: torch.dtype, device: torch.device) -> float:
    """The same-run baseline: one device-local copy of the message, in GB/s (read + write)."""
    src = torch.ones(nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype)
    src, dst = src.to(device), torch.empty_like(src, device=device)
    dst.copy_(src)
    _sync(device)
    iters, start = 5, time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes / ((time.perf_counter() - start) / iters) / 1e9


def fmt_bytes(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def run(args: argparse.Namespace) -> None:
    device, backend = init(args)
    rank, n = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    max_bytes = args.max_bytes or (512 * MIB if device.type == "cuda" else 16 * MIB)
    sizes, size = [], args.min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= args.step_factor
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = set(ops) - set(OPS)
    if unknown:
        raise ConfigError(f"--ops: unknown {sorted(unknown)}; choose from {OPS}")
    if n < 2 and "send_recv" in ops:
        ops.remove("send_recv")  # a ring of one would send to itself
        if rank == 0:
            print("# send_recv skipped: it needs at least 2 ranks", flush=True)
    rows = []
    header = f"{'op':<15}{'size':>10}{'time (us)':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"
    header += f"{'copy GB/s':>11}{'bus/copy':>10}"
    if rank == 0:
        print(f"# {backend}, {n} ranks, {args.dtype}, device {device.type}", flush=True)
        print(header, flush=True)
    for name in ops:
        for nbytes in sizes:
            seconds = time_calls(make_op(name, nbytes, dtype, device), args, device)
            algbw = nbytes / seconds / 1e9
            busbw = algbw * bus_factor(name, n)
            copy = local_copy_gbps(nbytes, dtype, device)
            row = {"op": name, "bytes": nbytes, "time_us": seconds * 1e6, "algbw_gbps": algbw}
            row.update(busbw_gbps=busbw, local_copy_gbps=copy, bus_over_copy=busbw / copy)
            rows.append(row)
            if rank == 0:
                print(
                    f"{name:<15}{fmt_bytes(nbytes):>10}{seconds * 1e6:>12.1f}{algbw:>12.3f}"
                    f"{busbw:>12.3f}{copy:>11.2f}{busbw / copy:>10.3f}",
                    flush=True,
                )
    hosts: list[str | None] = [None] * n
    dist.all_gather_object(hosts, socket.gethostname())
    if rank == 0:
        meta = {"backend": backend, "world_size": n, "dtype": args.dtype, "device": device.type}
        meta.update(torch=torch.__version__, hosts=sorted(set(hosts)))
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {out}", flush=True)
    dist.destroy_process_group()


def _main(argv: list[str]) -> int:
    run(parse_args(argv))
    return 0


def main(argv: list[str] | None = None) -> int:
    """A bad flag or launch environment ends in one `error:` line and exit status 2."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
