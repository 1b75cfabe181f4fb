"""argparse generated from the config dataclasses.

The help text of each flag is the docstring written under its field in `config.py` (read with
`ast`, so docs live in one place). Flag names are the field names with dashes, which match
Megatron-LM's; `metadata={"flag": "--x"}` overrides a name, `metadata={"choices": [...]}` limits
values. Booleans are real flags: `--x` for a default of False, `--x/--no-x` for True.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import types
import typing
from functools import cache

from megatron_lite import config as config_module
from megatron_lite.config import SECTIONS, Config

_GROUP_TITLES = {
    "model": "model shape",
    "parallel": "parallelism",
    "optim": "optimizer and learning rate",
    "train": "training",
    "data": "data",
    "logging": "logging and monitoring",
}


@cache
def _field_docs(cls: type) -> dict[str, str]:
    """Map field name -> the string literal written right under it in the class body."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in itertools.pairwise(body):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docs[prev.target.id] = " ".join(node.value.value.split()).replace("%", "%%")
    return docs


def _resolve(annotation: object) -> tuple[type, bool, bool]:
    """(scalar type, is optional, is list) of a field annotation."""
    hints_origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if hints_origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        base, _, is_list = _resolve(inner[0])
        return base, True, is_list
    if hints_origin is list:
        return args[0], False, True
    return annotation, False, False  # type: ignore[return-value]


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def _add_field(group: argparse._ArgumentGroup, section: str, f: dataclasses.Field,
               hint: object, doc: str) -> None:
    base, _optional, is_list = _resolve(hint)
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    kwargs: dict = {"dest": f"{section}.{f.name}", "default": default, "help": doc}
    if base is bool:
        if default:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["action"] = "store_true"
    else:
        kwargs["type"] = base
        if is_list:
            kwargs["nargs"] = "*"
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if default not in (None, [], ""):
            kwargs["help"] = f"{doc} (default: {default})"
        if "choices" not in f.metadata:
            kwargs["metavar"] = {int: "N", float: "X"}.get(base, "STR")
    group.add_argument(flag_name(f), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain.py",
        description="Pretrain a Llama-style decoder with tensor, sequence, pipeline and data "
        "parallelism. Launch with srun (one task per GPU), torchrun, or plain python.",
    )
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(_GROUP_TITLES.get(section, section))
        hints = typing.get_type_hints(cls, vars(config_module))
        docs = _field_docs(cls)
        for f in dataclasses.fields(cls):
            _add_field(group, section, f, hints[f.name], docs.get(f.name, ""))
    return parser


def args_to_config(ns: argparse.Namespace) -> Config:
    """Build (and locally check) the dataclasses from parsed flags."""
    per_section: dict[str, dict] = {name: {} for name in SECTIONS}
    for key, value in vars(ns).items():
        section, _, name = key.partition(".")
        if section in per_section:
            per_section[section][name] = value
    return Config(**{name: SECTIONS[name](**kw) for name, kw in per_section.items()})


def parse_config(argv: list[str] | None = None) -> Config:
    return args_to_config(build_parser().parse_args(argv))


def all_flags() -> list[str]:
    """Every option string, sorted (the CLI snapshot test freezes this list)."""
    parser = build_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    return sorted(flags)
