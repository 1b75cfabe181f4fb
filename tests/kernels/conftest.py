"""Kernel tests run on CUDA when present, else on CPU under Triton's interpreter.

TRITON_INTERPRET must be set before a kernel module is first imported (Triton decides compiled
vs interpreted when a kernel is defined), so it is set here, at collection time.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def poison_new_buffers(monkeypatch):
    """Every torch.empty/empty_like made from Python during a test starts as NaN (or int max).

    The launchers allocate their outputs with these, so an element a kernel fails to write shows
    up as NaN in the comparison instead of passing by luck with leftover memory.
    """
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).max)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


@pytest.fixture
def gen() -> torch.Generator:
    """A generator with a fresh seed per test (printed, so a failure can be replayed by setting
    KERNEL_TEST_SEED)."""
    seed = int(os.environ.get("KERNEL_TEST_SEED", torch.seed() % 2**31))
    print(f"KERNEL_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)
