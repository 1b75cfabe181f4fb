"""Seconds per rank of the meta-device dry run, at the 1B, 8B, 70B and 405B launch layouts.

For each shape, the first and the last rank of the job (first and last pipeline stage) are
dry-run: real model, optimizer and one training step on the meta device under a fake process
group (megatron_lite/dry_run.py). The in-run baseline is the planner-only `--dry-run` report
of the same layout (pure arithmetic): the ratio says what checking the real code costs over
predicting it. Target: < 30 s per 70B rank on a 2-core machine.

    python bench/dry_run.py [--shapes 1B 8B 70B 405B] [--repeats 1]

Prints a table and writes bench/results/dry_run.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.arguments import parse_config
from megatron_lite.dry_run import run_rank
from megatron_lite.memory import dry_run_report

LAYOUTS: dict[str, tuple[int, str]] = {
    "1B": (16, "--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --num-query-groups 8 "
               "--ffn-hidden-size 8192 --seq-length 4096 --rotary-base 500000 --bf16 "
               "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
               "--micro-batch-size 4 --global-batch-size 256"),
    "8B": (64, "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 "
               "--ffn-hidden-size 14336 --seq-length 8192 --rotary-base 500000 "
               "--untie-embeddings-and-output-weights --bf16 --tensor-model-parallel-size 2 "
               "--sequence-parallel --use-distributed-optimizer --overlap-grad-reduce "
               "--overlap-param-gather --micro-batch-size 1 --global-batch-size 128"),
    "70B": (1024, "--num-layers 80 --hidden-size 8192 --num-attention-heads 64 "
                  "--num-query-groups 8 --ffn-hidden-size 28672 --seq-length 4096 "
                  "--rotary-base 500000 --untie-embeddings-and-output-weights --bf16 "
                  "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 "
                  "--num-layers-per-virtual-pipeline-stage 2 --sequence-parallel "
                  "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
                  "--micro-batch-size 1 --global-batch-size 1024"),
    "405B": (2048, "--num-layers 126 --hidden-size 16384 --num-attention-heads 128 "
                   "--num-query-groups 8 --ffn-hidden-size 53248 --seq-length 8192 "
                   "--rotary-base 500000 --untie-embeddings-and-output-weights --bf16 "
                   "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 "
                   "--decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 7 "
                   "--sequence-parallel --use-distributed-optimizer --overlap-grad-reduce "
                   "--overlap-param-gather --micro-batch-size 1 --global-batch-size 2048"),
}
"""shape -> (world size, flags): scripts/pretrain_llama_{1b,8b,70b}.sh's layouts (vocab
128256); 405B as Llama 3 trained it at 8K (TP8, PP16 with lighter first and last stages)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        world, flags = LAYOUTS[shape]
        cfg = parse_config([*flags.split(), "--vocab-size", "128256", "--dry-run"])
        start = time.perf_counter()
        dry_run_report(cfg, world)
        planner_s = time.perf_counter() - start
        for rank in (0, world - 1):
            times, result = [], None
            for _ in range(args.repeats):
                result = run_rank(cfg, world, rank)
                times.append(result.seconds)
            rows.append({"shape": shape, "world_size": world, "rank": rank,
                         "pp_rank": result.pp_rank, "seconds": statistics.median(times),
                         "planner_report_seconds": planner_s,
                         "ops": result.collectives + result.p2p_ops,
                         "activation_ratio": result.activation_bytes
                         / result.planner_activation_bytes})
            print(f"{shape} rank {rank}: {rows[-1]['seconds']:.1f} s", flush=True)
    print(f"\n{'shape':>5} {'world':>6} {'rank':>5} {'stage':>5} {'s/rank':>7} "
          f"{'planner s':>9} {'x planner':>9} {'comm ops':>8} {'act./planner':>12}")
    for r in rows:
        print(f"{r['shape']:>5} {r['world_size']:>6} {r['rank']:>5} {r['pp_rank']:>5} "
              f"{r['seconds']:>7.1f} {r['planner_report_seconds']:>9.3f} "
              f"{r['seconds'] / r['planner_report_seconds']:>9.0f} {r['ops']:>8} "
              f"{r['activation_ratio']:>12.3f}")
    out = Path(__file__).resolve().parent / "results" / "dry_run.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
