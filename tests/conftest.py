"""Shared pytest setup: tests run on CPU with one thread per process."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

torch.set_num_threads(1)

LONG_FILES = ("tests/test_readme.py", "tests/pipeline/test_zero_bubble_dry_run.py")
"""The files that take longest (minutes): collected first, so `pytest -n 2 --dist loadfile`
starts them while the rest fills the other worker instead of leaving them alone at the end."""


def pytest_collection_modifyitems(items: list) -> None:
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in LONG_FILES)  # stable
