"""Shared pieces of the checkpoint tests: a tiny model's flags and full-state comparisons."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_lite.arguments import parse_config
from megatron_lite.checkpoint import CheckpointReader
from megatron_lite.parallel.state import ParallelState
from megatron_lite.training import train

# 4 layers (PP=4, or PP=2 x v=2), GQA, a vocab that needs padding at TP=1 and TP=2.
FLAGS = ["--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads",
         "4", "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "16",
         "--vocab-size", "97", "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "1",
         "--global-batch-size", "4", "--lr", "2e-3", "--lr-warmup-iters", "1",
         "--train-iters", "6", "--eval-iters", "0", "--peak-tflops", "1", "--log-interval", "100"]

LAYOUTS = {
    "single": ([], 1, 1, 1),
    "tp2": (["--tensor-model-parallel-size", "2"], 2, 2, 1),
    "pp2-v2": (["--pipeline-model-parallel-size", "2",
                "--num-layers-per-virtual-pipeline-stage", "1"], 2, 1, 2),
    "pp4": (["--pipeline-model-parallel-size", "4"], 4, 1, 4),
    "dp2-zero1": (["--use-distributed-optimizer"], 2, 1, 1),
    "tp2-pp2": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
                4, 2, 2),
}
"""name -> (extra flags, world size, tp, pp)."""


def run_train(pstate: ParallelState, flags: list[str]) -> list[float]:
    return train(parse_config([*FLAGS, *flags]), pstate).losses


def run_sequence(pstate: ParallelState, runs: list[list[str]]) -> list[list[float]]:
    """Several training runs one after the other in the same ranks (one spawn)."""
    return [run_train(pstate, flags) for flags in runs]


def full_state(ckpt_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every weight and its optimizer state, gathered to full tensors (layout-free)."""
    reader = CheckpointReader(ckpt_dir)
    return {name: {"weight": reader.full_weight(name), **reader.full_optimizer(name)}
            for name in reader.where}


def assert_same_state(a: Path, b: Path) -> None:
    sa, sb = full_state(a), full_state(b)
    assert sorted(sa) == sorted(sb)
    for name in sa:
        for kind in sa[name]:
            assert torch.equal(sa[name][kind], sb[name][kind]), (name, kind)


def flip_tensor_byte(path: Path) -> None:
    """Flip one bit in the middle of the tensor data (past the safetensors header), which
    leaves the file a valid safetensors file of the right size: only a checksum sees it."""
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[(header + len(data)) // 2] ^= 0x10
    path.write_bytes(bytes(data))
