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

from megatron_lite.arguments import parse_config
from megatron_lite.config import ConfigError
from megatron_lite.dry_run import dry_run
from megatron_lite.parallel.launch import detect_launch_env
from megatron_lite.training import run


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_config(argv)
        if cfg.train.dry_run:
            return dry_run(cfg, cfg.parallel.world_size or detect_launch_env().world_size)
        run(cfg)
    except ConfigError as err:
        print(f"pretrain.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)  # a native crash prints every thread's Python stack
    sys.exit(main())
