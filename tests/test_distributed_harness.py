"""tests/distributed.py's ranks come from a fork server started once, so check they still see
what a spawned rank would: the test's environment, working directory and captured stdout, and
none of the test process's state."""

from __future__ import annotations

import os

import pytest

import tests.distributed
from tests.distributed import run_ranks


def _rank(world) -> int:
    return world.rank


def _report(world) -> tuple[int, str | None, str, bool]:
    print(f"rank {world.rank} says hello", flush=True)
    return (world.rank, os.environ.get("HARNESS_PROBE"), os.getcwd(),
            hasattr(tests.distributed, "_set_by_the_test"))


@pytest.mark.quick
def test_ranks_get_the_tests_environment_cwd_and_stdout(tmp_path, monkeypatch, capfd) -> None:
    with capfd.disabled():  # the fork server runs, with other stdout, before the changes below
        run_ranks(_rank, 1, tmp_path)
    monkeypatch.setenv("HARNESS_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tests.distributed, "_set_by_the_test", True, raising=False)
    capfd.readouterr()
    out = run_ranks(_report, 2, tmp_path)
    assert out == [(r, "set after the server started", str(tmp_path), False) for r in (0, 1)]
    printed = capfd.readouterr().out
    assert "rank 0 says hello" in printed and "rank 1 says hello" in printed, printed
