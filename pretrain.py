"""Pretrain a Llama-style decoder: the single entrypoint.

    python pretrain.py --mock-data --train-iters 20                       # one CPU process
    python pretrain.py --dry-run --world-size 1024 --dry-run-ranks 0 ...   # check a layout
    torchrun --standalone --nproc_per_node=2 pretrain.py --tensor-model-parallel-size 2 ...
    srun python pretrain.py ...                                             # one task per GPU

`python pretrain.py --help` lists every flag (names follow Megatron-LM).
"""

from __future__ import annotations

import faulthandler
import sys

from megatron_lite.arguments import parse_with_notes
from megatron_lite.errors import run_cli
from megatron_lite.parallel.launch import detect_launch_env


def _main(argv: list[str]) -> int:
    cfg, taken, notes = parse_with_notes(argv)
    # torch only after the flags parse: `--help` and a flag mistake answer in a blink
    from megatron_lite.dry_run import dry_run
    from megatron_lite.training import run

    if detect_launch_env().rank == 0:
        if taken:
            print("Megatron-LM flags taken (they describe this model): " + " ".join(taken),
                  flush=True)
        for note in notes:
            print(note, flush=True)
    if cfg.train.dry_run:
        return dry_run(cfg, cfg.parallel.world_size or detect_launch_env().world_size)
    run(cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    """A user mistake (bad flag value, path, shard, checkpoint) ends in one `error:` line and
    exit status 2; --debug shows its traceback (megatron_lite/errors.py)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)  # a native crash prints every thread's Python stack
    sys.exit(main())
