"""Multi-process test harness: run a function on N gloo ranks and collect the results.

`run_ranks(fn, world_size, tmp_path, **kwargs)` spawns `world_size` processes, initialises
torch.distributed through a file:// rendezvous in `tmp_path` (no ports, so xdist workers never
race), builds the `ParallelState` for the given parallel sizes, calls
`fn(pstate, **kwargs)` on every rank and returns the list of per-rank return values (which must
be picklable; tensors are fine). A failure on any rank is re-raised here with the rank number
and its traceback; a rank that does not finish within `timeout` seconds fails the test with
its rank named instead of hanging CI.

The ranks are forked from a server that imported torch and megatron_lite once (multiprocessing's
"forkserver"), not spawned: a spawned rank spends ~1.5 s of CPU importing them, and the suite
starts hundreds. Like spawned ones, they start from that fresh import (no state of the test
process) and get the test's environment, working directory, sys.path, stdout and stderr.
"""

from __future__ import annotations

import os
import pickle
import queue
import traceback
import uuid
from collections.abc import Callable
from multiprocessing import reduction
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from megatron_lite.config import Config, ParallelConfig
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.launch import LaunchEnv
from megatron_lite.parallel.state import ParallelState


class RankError(RuntimeError):
    """A spawned rank raised, timed out or died."""


_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload([
    "torch", "megatron_lite.training", "tests.distributed", "pytest"])  # what every rank imports


class _Stdio:
    """The test process's stdout and stderr (under pytest, the test's capture), sent to a rank:
    the fork server's own are those of whichever test started it."""

    def __reduce__(self) -> tuple:
        return tuple, ((reduction.DupFd(1), reduction.DupFd(2)),)


def _worker(rank: int, world_size: int, init_file: str, cfg: Config, fn: Callable,
            kwargs: dict, results: mp.Queue, environ: dict[str, str], stdio: tuple) -> None:
    for fd, inherited in enumerate(stdio, start=1):
        os.dup2(inherited.detach(), fd)
    os.environ.clear()  # the test's environment, not the fork server's
    os.environ.update(environ)
    torch.set_num_threads(1)
    os.environ.setdefault("MEGATRON_LITE_TEST_RANK", str(rank))
    os.environ["MEGATRON_LITE_TEST_RENDEZVOUS"] = init_file  # `relayout` starts its own
    env = LaunchEnv(rank=rank, local_rank=rank, world_size=world_size,
                    local_world_size=world_size, master_addr="127.0.0.1", master_port=0,
                    source="test", node_rank=0, num_nodes=1)
    pstate = None
    try:
        pstate = parallel_state.initialize(cfg, env=env, init_method=f"file://{init_file}")
        out = fn(pstate, **kwargs)
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt in a child
        results.put((rank, False, traceback.format_exc()))
    finally:
        if pstate is not None:
            parallel_state.destroy(pstate)


def run_ranks(fn: Callable[..., Any], world_size: int, tmp_path: Path, *,
              tp: int = 1, pp: int = 1, cfg: Config | None = None, timeout: float = 120.0,
              **kwargs: Any) -> list[Any]:
    """Run `fn(pstate, **kwargs)` on `world_size` gloo ranks; return results ordered by rank."""
    if cfg is None:
        cfg = Config(parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             distributed_backend="gloo"))
    cfg.parallel.distributed_backend = "gloo"
    cfg.parallel.distributed_timeout_minutes = max(timeout / 60, 0.5)
    init_file = str(Path(tmp_path) / f"rendezvous_{uuid.uuid4().hex}")  # fresh per call
    results: mp.Queue = _CONTEXT.Queue()
    procs = [_CONTEXT.Process(target=_worker, args=(r, world_size, init_file, cfg, fn, kwargs,
                                                    results, dict(os.environ), _Stdio()),
                              daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, payload = results.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise RankError(f"ranks {missing} did not finish within {timeout:.0f} s") from None
            if not ok:
                raise RankError(f"rank {rank} failed:\n{payload}")
            outputs[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [outputs[r] for r in range(world_size)]


_relayouts = 0
"""Layouts this rank built with `relayout` (every rank counts the same)."""


def relayout(world: ParallelState, cfg: Config) -> ParallelState:
    """`cfg`'s layout on the ranks `run_ranks` started, so that one spawn can run several
    layouts one after the other: this rank's groups are torn down and `cfg`'s built through
    `parallel_state.initialize` over a fresh file:// rendezvous, the path a new job takes.

    Why not keep the world and only add the new layout's groups: torch names a group after
    its ranks and how many groups the rank already holds, so ranks that made different numbers
    of groups for an earlier layout (the embedding group is the first and last stages' only)
    name the same new group differently and wait for each other forever; destroying the old
    groups does not help either, since the new ones then reuse names whose keys the old ones
    left in the store.
    """
    global _relayouts
    _relayouts += 1
    parallel_state.destroy(world)
    cfg.parallel.distributed_backend = "gloo"
    cfg.parallel.distributed_timeout_minutes = max(cfg.parallel.distributed_timeout_minutes, 5)
    env = LaunchEnv(rank=world.rank, local_rank=world.local_rank, world_size=world.world_size,
                    local_world_size=world.world_size, master_addr="127.0.0.1", master_port=0,
                    source="test", node_rank=0, num_nodes=1)
    init = f"{os.environ['MEGATRON_LITE_TEST_RENDEZVOUS']}.layout{_relayouts}"
    return parallel_state.initialize(cfg, env=env, init_method=f"file://{init}")
