"""megatron_lite/schedules.py is the only place a pipeline schedule's name is spelled: every
other module reads the schedule's facts (chunks, placement, split backward, head stage,
bubble, preconditions) from its row, so adding a schedule is a table row, not a hunt."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron_lite import schedules
from megatron_lite.config import ParallelConfig
from megatron_lite.schedules import SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "megatron_lite" / "schedules.py"


def _name_literals(path: Path) -> list[str]:
    """'file:line' of every string constant that is exactly a schedule name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in SCHEDULES]


@pytest.mark.quick
def test_schedule_names_live_only_in_the_table() -> None:
    sources = [p for folder in ("megatron_lite", "scripts", "bench")
               for p in sorted((ROOT / folder).rglob("*.py")) if p != TABLE]
    assert len(sources) > 50  # the scan saw the package, not an empty folder
    found = [hit for path in sources for hit in _name_literals(path)]
    assert not found, f"schedule names spelled outside megatron_lite/schedules.py: {found}"
    assert len(_name_literals(TABLE)) == len(SCHEDULES)  # and the scan finds them there


@pytest.mark.quick
def test_flag_choices_are_the_table() -> None:
    field = ParallelConfig.__dataclass_fields__["pipeline_schedule"]
    assert field.metadata["choices"] == ["1f1b", "interleaved", "zb-h1", "zbv"]
    assert list(schedules.NAMES) == field.metadata["choices"]
    # the facts the pipeline code relied on when it compared names
    assert [(s.stage_chunks(3), s.v_shape, s.split_backward, s.head_stage(4))
            for s in SCHEDULES.values()] == [(1, False, False, 3), (3, False, False, 3),
                                             (1, False, True, 3), (2, True, True, 0)]
    assert schedules.get(None, 1).name == "1f1b" and schedules.get(None, 2).name == "interleaved"
