"""No function in the code a newcomer reads is over 60 lines (issue 29): a longer one reads as
several steps without names, and is split by meaning into named, documented sub-steps."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ("megatron_lite", "pretrain.py", "scripts", "bench")
LIMIT = 60


def _sources() -> list[Path]:
    files: list[Path] = []
    for name in TREES:
        path = ROOT / name
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return files


def long_functions(paths: list[Path], root: Path = ROOT) -> list[str]:
    """`path:line name (N lines)` of every function or method, nested ones included, whose
    def line through its last line spans more than LIMIT lines (decorators not counted)."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LIMIT:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} "
                                 f"({lines} lines)")
    return found


def test_a_long_function_is_found(tmp_path: Path) -> None:
    """The check can fail: a nested function of 61 lines (and so its parent) is named, a
    method of exactly 60 lines is not."""
    def body(n: int, indent: str) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    (tmp_path / "probe.py").write_text(
        "def outer():\n    def inner():\n" + body(LIMIT - 1, " " * 8) + "        return 1\n"
        "    return inner\n\n\nclass A:\n    def fine(self):\n" + body(LIMIT - 2, " " * 8)
        + "        return 1\n")
    assert long_functions([tmp_path / "probe.py"], tmp_path) == [
        f"probe.py:1 outer ({LIMIT + 3} lines)", f"probe.py:2 inner ({LIMIT + 1} lines)"]


@pytest.mark.quick
def test_no_function_over_60_lines() -> None:
    assert long_functions(_sources()) == []


CLASS_LIMIT = 250
"""optim/'s classes (issue 29): the optimizer grew into one 491-line class before its split."""


def long_classes(paths: list[Path], root: Path = ROOT) -> list[str]:
    """`path:line name (N lines)` of every class spanning more than CLASS_LIMIT lines."""
    return [f"{path.relative_to(root)}:{node.lineno} {node.name} "
            f"({node.end_lineno - node.lineno + 1} lines)"
            for path in paths for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.ClassDef)
            and node.end_lineno - node.lineno + 1 > CLASS_LIMIT]


def test_a_long_class_is_found(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(CLASS_LIMIT))
    (tmp_path / "probe.py").write_text("class Big:\n" + body)
    assert long_classes([tmp_path / "probe.py"], tmp_path) == [
        f"probe.py:1 Big ({CLASS_LIMIT + 1} lines)"]


def test_no_class_over_250_lines_in_optim() -> None:
    assert long_classes(sorted((ROOT / "megatron_lite" / "optim").glob("*.py"))) == []
