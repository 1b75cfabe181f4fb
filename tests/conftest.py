"""Shared pytest setup: tests run on CPU with one thread per process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

torch.set_num_threads(1)

KERNEL_FREE = (
    # pure arithmetic on Python numbers: layouts, schedules, LR tables, launch environments
    "optim/test_buffers.py", "optim/test_lr.py", "pipeline/test_partition.py",
    "pipeline/test_schedule.py", "pipeline/test_zero_bubble.py", "parallel/test_launch.py",
    "parallel/test_launch_checks.py",
    # trains, but asserts only the LR, batch-size and iteration sequences (Python numbers)
    "optim/test_lr_megatron.py",
    # the meta device (rank dry runs, model builds): no kernel computes a number
    "optim/test_zero3_memory.py", "optim/test_zero3_peak_moments.py",
    "parallel/test_host_syncs.py", "parallel/test_nccl_order.py", "parallel/test_ring_planted.py",
    "pipeline/test_zero_bubble_dry_run.py", "model/test_tags.py",
)
"""Test files, under tests/, whose results cannot depend on which CPU kernels torch picks:
marked `kernel_free`, so .ci/run's ATEN_CPU_CAPABILITY=default pass skips them (every float
equivalence test stays in it). A file not listed runs in both passes."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).resolve().parent
    for item in items:
        path = item.path.resolve()  # through a symlinked tests/, as the README test's scratch
        if path.is_relative_to(tests) and path.relative_to(tests).as_posix() in KERNEL_FREE:
            item.add_marker(pytest.mark.kernel_free)
