"""Copy the shards one node needs from shared storage to node-local disk.

    python -m data_tools.stage --manifest OUT.manifest.json --local-dir DIR \\
        [--nodes N --node-rank R] [--gpus-per-node G] [--tensor-model-parallel-size T]
        [--pipeline-model-parallel-size P] [--jobs J]

Ranks are laid out as in megatron_lite (world = pp x dp x tp, tp innermost, consecutive ranks
on a node). Shard i belongs to data-parallel rank i % dp (`shards_for_dp_rank`); a node stages
the shards of every DP rank with a process on it, so with TP inside a node and PP across nodes
each node of a pipeline replica gets that replica's shards. Node count and rank default to
Slurm's SLURM_NNODES / SLURM_NODEID. Files already present with the right checksum are skipped
(resumable); copies go to temporary names and are verified before the rename. The manifest is
copied too, so `--data-path DIR/OUT` works on the node.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from data_tools.errors import add_debug_flag, run_cli
from megatron_lite.data.format import (
    ShardError,
    load_manifest,
    sha256_file,
    shards_for_dp_rank,
    write_manifest,
)


def _env_int(*names: str) -> int | None:
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m data_tools.stage", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", required=True, help="OUT.manifest.json on shared storage")
    p.add_argument("--local-dir", required=True, help="node-local destination directory")
    p.add_argument("--nodes", type=int, default=_env_int("SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
                   help="number of nodes (default: Slurm, else 1)")
    p.add_argument("--node-rank", type=int, default=_env_int("SLURM_NODEID"),
                   help="this node's index (default: Slurm, else 0)")
    p.add_argument("--gpus-per-node", type=int,
                   default=_env_int("SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE"),
                   help="training processes per node (default: Slurm)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--jobs", type=int, default=4, help="files copied in parallel")
    add_debug_flag(p)
    args = p.parse_args(argv)
    args.nodes = args.nodes or 1
    args.node_rank = args.node_rank or 0
    if not 0 <= args.node_rank < args.nodes:
        p.error(f"--node-rank {args.node_rank} must be in [0, --nodes {args.nodes})")
    if args.nodes > 1 and not args.gpus_per_node:
        p.error("--gpus-per-node is needed with --nodes > 1 (Slurm's SLURM_GPUS_ON_NODE unset)")
    return args


def dp_ranks_on_node(nodes: int, node_rank: int, gpus_per_node: int, tp: int, pp: int
                     ) -> tuple[list[int], int]:
    """(DP ranks with a process on this node, DP size) for rank = (pp_r * dp + dp_r) * tp + tp_r."""
    world = nodes * gpus_per_node
    if world % (tp * pp):
        raise ShardError(f"world size {world} (= --nodes {nodes} x --gpus-per-node "
                         f"{gpus_per_node}) is not divisible by TP {tp} x PP {pp}; pass the "
                         "training job's sizes")
    dp = world // (tp * pp)
    ranks = range(node_rank * gpus_per_node, (node_rank + 1) * gpus_per_node)
    return sorted({(r // tp) % dp for r in ranks}), dp


def _stage_file(src: Path, dst: Path, sha: str) -> str:
    """Copy one file unless a valid copy is there; returns "copied" or "skipped"."""
    if dst.is_file() and dst.stat().st_size == src.stat().st_size and sha256_file(dst) == sha:
        return "skipped"
    tmp = dst.with_name(f"{dst.name}.tmp{os.getpid()}")
    shutil.copyfile(src, tmp)
    got = sha256_file(tmp)
    if got != sha:
        tmp.unlink()
        raise ShardError(f"{src}: checksum {got[:16]}... does not match the manifest "
                         f"({sha[:16]}...); the shared copy is corrupt, regenerate it")
    os.replace(tmp, dst)
    return "copied"


def stage(args: argparse.Namespace) -> dict[str, list[str]]:
    manifest = load_manifest(args.manifest)
    if args.nodes == 1:
        shards = list(range(len(manifest.shards)))
        dp_ranks = None
    else:
        dp_ranks, dp = dp_ranks_on_node(args.nodes, args.node_rank, args.gpus_per_node,
                                        args.tensor_model_parallel_size,
                                        args.pipeline_model_parallel_size)
        shards = sorted(i for r in dp_ranks for i in shards_for_dp_rank(
            len(manifest.shards), r, dp))
    local = Path(args.local_dir)
    local.mkdir(parents=True, exist_ok=True)
    jobs = [(manifest.path.parent / manifest.shards[i][kind], local / manifest.shards[i][kind],
             manifest.shards[i][f"{kind}_sha256"]) for i in shards for kind in ("bin", "idx")]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        outcomes = list(pool.map(lambda job: _stage_file(*job), jobs))
    write_manifest(local / manifest.path.name, manifest.data)
    result: dict[str, list[str]] = {"copied": [], "skipped": []}
    for (src, _, _), outcome in zip(jobs, outcomes):
        result[outcome].append(src.name)
    who = "all DP ranks" if dp_ranks is None else f"DP ranks {dp_ranks}"
    print(f"node {args.node_rank}/{args.nodes} ({who}): shards {shards} -> {local}")
    for outcome in ("copied", "skipped"):
        print(f"  {outcome} {len(result[outcome])} files: {' '.join(result[outcome]) or '-'}")
    return result


def _main(argv: list[str]) -> int:
    stage(parse_args(argv))
    return 0


def main(argv: list[str] | None = None) -> int:
    """A bad manifest, corrupt source or impossible layout ends in one `error:` line, exit 2."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
