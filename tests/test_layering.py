"""Imports flow one way: config -> parallel -> kernels/layers -> model -> pipeline/optim ->
training -> pretrain.py. This test parses every module's imports and fails on a back-edge,
naming the file, line and the edge. A new top-level module must be added to ALLOWED."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# component -> megatron_lite components it may import (itself is always allowed)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),  # UserError and how entrypoints report it: below everything, stdlib only
    # the schedule table and the layout arithmetic: leaves every layer may read
    "schedules": set(),
    "sharding": set(),
    "layout": {"schedules"},
    "config": {"errors", "schedules", "layout", "sharding"},
    "provenance": set(),
    # the accelerators' datasheets and the CPU's measured peaks: a leaf
    "devices": set(),
    "arguments": {"config", "errors"},
    "parallel": {"config", "errors"},
    "kernels": set(),
    "layers": {"config", "parallel", "kernels"},
    "model": {"config", "parallel", "kernels", "layers"},
    "pipeline": {"config", "parallel", "kernels", "layers", "model", "schedules", "layout"},
    # optim reads the parameter tags that layers/tags.py declares (split, SP, shared copies)
    "optim": {"config", "parallel", "layers", "layout", "sharding"},
    "data": {"config", "errors"},
    # the model's parameter list (names, shapes, TP splits): read by the planner and export
    "structure": {"config"},
    "planner": {"config", "plan_time", "schedules", "structure", "sharding"},
    "plan_time": {"errors", "config", "structure", "devices"},
    "memory": {"config", "parallel", "pipeline", "planner", "data"},
    # the run across Slurm jobs (stdlib only: the launch scripts call it between launches)
    "unattended": set(),
    "metrics": {"config", "parallel", "planner", "unattended", "devices"},
    "checkpoint": {"config", "parallel", "layers", "model", "optim", "data", "pipeline",
                   "provenance", "errors"},
    "export": {"config", "parallel", "layers", "model", "checkpoint", "kernels", "errors",
               "structure", "export_moe"},
    # export's Mixtral / Qwen3-MoE naming, config and refusals
    "export_moe": {"config", "checkpoint"},
    "reliability": {"config", "parallel", "errors", "devices"},
    "profiling": {"config"},
    "startup_paths": {"config", "errors"},
    # distillation: a teacher model from a checkpoint and its losses, used by training
    "distill": {"config", "parallel", "kernels", "model", "checkpoint", "metrics"},
    "training": {"config", "arguments", "parallel", "kernels", "layers", "model", "pipeline",
                 "optim", "data", "planner", "metrics", "checkpoint", "reliability", "memory",
                 "provenance", "errors", "profiling", "startup_paths", "unattended", "distill"},
    # the dry run composes the same pieces training does (the whole iteration, on meta)
    "dry_run": {"config", "parallel", "kernels", "optim", "data", "planner", "memory",
                "checkpoint", "training", "metrics", "profiling", "reliability", "distill"},
}
NO_TORCH = ("tokenizer", "data_tools")


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)]
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def _component(path: Path) -> str:
    rel = path.relative_to(ROOT / "megatron_lite")
    return rel.parts[0].removesuffix(".py")


@pytest.mark.quick
def test_megatron_lite_imports_flow_one_way() -> None:
    problems = []
    for path in sorted((ROOT / "megatron_lite").rglob("*.py")):
        if path.name == "__init__.py" and path.parent == ROOT / "megatron_lite":
            continue
        comp = _component(path)
        if comp not in ALLOWED:
            problems.append(f"{path}: component {comp!r} is not in tests/test_layering.py")
            continue
        for line, name in _imports(path):
            parts = name.split(".")
            if parts[0] != "megatron_lite" or len(parts) < 2:
                continue
            target = parts[1]
            if target != comp and target in ALLOWED and target not in ALLOWED[comp]:
                problems.append(f"{path.relative_to(ROOT)}:{line}: {comp} -> {target}")
    assert not problems, "imports going the wrong way:\n" + "\n".join(problems)


def test_tokenizer_and_data_tools_stay_light() -> None:
    problems = []
    for pkg in NO_TORCH:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for line, name in _imports(path):
                top = name.split(".")[0]
                bad = top == "torch" or (
                    top == "megatron_lite" and not name.startswith("megatron_lite.data.format")
                    and name != "megatron_lite.data")
                if pkg == "tokenizer" and top == "megatron_lite":
                    bad = True
                if bad:
                    problems.append(f"{path.relative_to(ROOT)}:{line}: imports {name}")
    assert not problems, "\n".join(problems)


def test_back_edge_is_detected(tmp_path: Path) -> None:
    """The checker itself can fail: a layers -> training import is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from megatron_lite.training import run\n")
    names = [n for _, n in _imports(bad)]
    assert "megatron_lite.training" in names
    assert "training" not in ALLOWED["layers"]
