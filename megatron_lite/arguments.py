"""argparse generated from the config dataclasses.

The help text of each flag is the docstring written under its field in `config.py` (read with
`ast`, so docs live in one place). Flag names are the field names with dashes, which match
Megatron-LM's; `metadata={"flag": "--x"}` overrides a name, `metadata={"choices": [...]}` limits
values, `metadata={"aliases": [...]}` adds other spellings. Booleans are real flags: `--x` for a
default of False, `--x/--no-x` for True.

Every other flag of Megatron-LM is parsed too, from the table `megatron_flags.tsv`: a flag that
describes this model is taken when its value matches (`parse` reports it), any other is refused
by name with the flag that does the job here. So a Megatron script never meets argparse's
"unrecognized arguments"; a flag nobody defines gets that error plus the closest known flag.
"""

from __future__ import annotations

import argparse
import ast
import csv
import dataclasses
import difflib
import inspect
import itertools
import types
import typing
from functools import cache
from pathlib import Path

from megatron_lite import config as config_module
from megatron_lite.config import SECTIONS, Config, ConfigError, numeric_range_errors
from megatron_lite.errors import add_debug_flag

MEGATRON_TABLE = Path(__file__).with_name("megatron_flags.tsv")
_MEGATRON_DEST = "megatron:"

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
    group.add_argument(flag_name(f), *f.metadata.get("aliases", []), **kwargs)


@dataclasses.dataclass(frozen=True)
class MegatronFlag:
    """One row of megatron_flags.tsv."""

    flag: str
    aliases: tuple[str, ...]
    kind: str
    """ours (implemented under this name), fixed (accepted when `rule` holds) or refused."""
    nargs: str
    """0 for a switch, * for a flag with values."""
    rule: str
    note: str
    """fixed: what this model is; refused: why, or the flag to use instead."""
    megatron_default: str
    """Megatron's parser default, as a Python literal (`ast.literal_eval` reads it)."""

    @property
    def default(self) -> object:
        """The Megatron default as a value: None, a bool, a number, a string or a list."""
        return ast.literal_eval(self.megatron_default)


@cache
def megatron_flags() -> tuple[MegatronFlag, ...]:
    lines = [line for line in MEGATRON_TABLE.read_text().splitlines() if not line.startswith("#")]
    rows = list(csv.reader(lines, delimiter="\t"))[1:]
    return tuple(MegatronFlag(flag, tuple(filter(None, aliases.split(","))), kind, nargs, rule,
                              note, default)
                 for flag, aliases, kind, nargs, rule, note, default in rows)


class _MegatronAction(argparse.Action):
    """Records a table flag as written (option string, values) for `check_megatron_flags`."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, (option_string, list(values or [])))  # type: ignore


class _Parser(argparse.ArgumentParser):
    """argparse that adds "did you mean" to an unknown flag's error."""

    def error(self, message: str) -> typing.NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            known = [s for a in self._actions for s in a.option_strings]
            hints = []
            for token in message.removeprefix(prefix).split():
                close = difflib.get_close_matches(token.split("=")[0], known, n=1)
                if token.startswith("--") and close:
                    hints.append(f"(did you mean {close[0]}?)")
            message = " ".join([message, *hints])
        super().error(message)


def _add_megatron_group(parser: argparse.ArgumentParser) -> None:
    """The table's fixed and refused flags, as one short help section (each is hidden)."""
    table = [row for row in megatron_flags() if row.kind != "ours"]
    group = parser.add_argument_group(
        "other Megatron-LM flags",
        f"{len(table)} more flags of Megatron-LM's pretrain_gpt.py are understood; each one's "
        "class is in megatron_lite/megatron_flags.tsv. A flag that describes this model (e.g. "
        "--swiglu, --normalization RMSNorm, --rotary-percent 1.0) is accepted "
        "when its value matches; a feature not implemented here (e.g. --fp8-format) is "
        "refused by name, with the flag that does the job here where there is one.")
    for row in table:
        if any(s in parser._option_string_actions for s in (row.flag, *row.aliases)):
            continue  # implemented since the table was written: ours wins (a test flags the row)
        group.add_argument(row.flag, *row.aliases, dest=_MEGATRON_DEST + row.flag,
                           action=_MegatronAction, nargs=0 if row.nargs == "0" else "*",
                           default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _matches(rule: str, values: list[str]) -> bool:
    if rule in ("set", "any"):
        return True
    if len(values) != 1:
        return False
    value = values[0]
    for want in rule.removeprefix("in:").removeprefix("=").split(","):
        try:
            if float(value) == float(want):
                return True
        except ValueError:
            if value == want:
                return True
    return False


def check_megatron_flags(ns: argparse.Namespace, cfg: Config) -> list[str]:
    """The table flags given that describe this model, as written; raises ConfigError naming
    every other one (a value this model is not, or a feature not implemented here)."""
    by_flag = {row.flag: row for row in megatron_flags()}
    taken, problems = [], []
    for key, given in vars(ns).items():
        if not key.startswith(_MEGATRON_DEST):
            continue
        option, values = given
        row = by_flag[key.removeprefix(_MEGATRON_DEST)]
        written = " ".join([option, *values])
        if row.kind == "fixed" and _matches(row.rule, values):
            taken.append(written)
        elif row.kind == "fixed":
            want = row.rule.removeprefix("in:").removeprefix("=").replace(",", " or ")
            problems.append(f"{written}: this model takes only {option} {want}: {row.note}")
        else:
            problems.append(f"{option}: {row.note}")
    if problems:
        raise ConfigError("Megatron-LM flags this run cannot honour:\n  - "
                          + "\n  - ".join(problems))
    return taken


_NOT_MEGATRON_DEFAULT = {
    "--normalization": None, "--position-embedding-type": None, "--swiglu": "GeLU MLP",
    "--disable-bias-linear": "linear biases", "--hidden-dropout": None,
    "--attention-dropout": None,
}
"""The fixed flags where this model is not what Megatron builds by default: flag -> Megatron's
default in words (None: the table's megatron_default, for a flag with a value)."""


def _rerun_note(cfg: Config) -> str:
    """What this run does where Megatron's --rerun-mode validate_results would re-run a step."""
    rel = cfg.reliability
    if not rel.check_for_nan_in_loss_and_grad:
        return "no NaN/Inf check (--no-check-for-nan-in-loss-and-grad), no re-run"
    action = "skips the step on every rank" if rel.on_nan == "skip" else "stops the run"
    return f"a NaN/Inf loss or gradient {action} (--on-nan {rel.on_nan}), no re-run"


def startup_notes(ns: argparse.Namespace, cfg: Config) -> list[str]:
    """Lines start-up prints about Megatron's defaults and modes this run does not follow:
    the model's own choices for the flags not given, and --rerun-mode validate_results."""
    rows = {row.flag: row for row in megatron_flags()}
    given = {key.removeprefix(_MEGATRON_DEST): value for key, value in vars(ns).items()
             if key.startswith(_MEGATRON_DEST)}
    instead = []
    for flag, words in _NOT_MEGATRON_DEFAULT.items():
        if flag in given:
            continue
        ours = rows[flag].rule.removeprefix("=")
        instead.append(f"{flag} (Megatron: {words})" if words
                       else f"{flag} {ours} (Megatron: {rows[flag].default})")
    rerun = given.get("--rerun-mode")
    if rerun is None:
        instead.append(f"--rerun-mode: {_rerun_note(cfg)} (Megatron: validate_results)")
    notes = ["Megatron-LM defaults not taken (this model's instead): " + ", ".join(instead)]
    if rerun is not None and rerun[1] == ["validate_results"]:
        notes.append(f"--rerun-mode validate_results: {_rerun_note(cfg)}; Megatron's re-run of "
                     "the step to tell a faulty GPU from a real divergence is not done here")
    elif rerun is not None and cfg.reliability.on_nan == "skip":
        notes.append(f"--rerun-mode disabled: {_rerun_note(cfg)}, where Megatron stops the run "
                     "(--on-nan stop does that)")
    ignored = [flag for flag in ("--recompute-method", "--recompute-num-layers")
               if getattr(ns, "train." + flag[2:].replace("-", "_")) is not None]
    if ignored and cfg.train.recompute_granularity is None:
        notes.append(f"{' and '.join(ignored)} ignored: without --recompute-granularity "
                     "nothing is recomputed (as in Megatron)")
    model = cfg.model
    if not model.group_query_attention and model.num_query_groups != model.num_attention_heads:
        notes.append(f"--num-query-groups {model.num_query_groups} without "
                     "--group-query-attention: this run uses those K/V heads, where Megatron "
                     "ignores the flag (one K/V head per query head); add "
                     "--group-query-attention to make the script mean the same in both")
    return notes if instead else notes[1:]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pretrain.py", allow_abbrev=False,
        description="Pretrain a Llama-style decoder with tensor, sequence, pipeline and data "
        "parallelism. Launch with srun (one task per GPU), torchrun, or plain python.",
    )
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(_GROUP_TITLES.get(section, section))
        hints = typing.get_type_hints(cls, vars(config_module))
        docs = _field_docs(cls)
        for f in dataclasses.fields(cls):
            _add_field(group, section, f, hints[f.name], docs.get(f.name, ""))
    _add_megatron_group(parser)
    add_debug_flag(parser)  # how errors are shown, not part of the run: no Config field
    return parser


def args_to_config(ns: argparse.Namespace) -> Config:
    """Build (and locally check) the dataclasses from parsed flags."""
    per_section: dict[str, dict] = {name: {} for name in SECTIONS}
    for key, value in vars(ns).items():
        section, _, name = key.partition(".")
        if section in per_section:
            per_section[section][name] = value
    errors = [e for name, kw in per_section.items() for e in numeric_range_errors(name, kw)]
    if errors:  # before any dataclass divides by one of them
        raise ConfigError(errors[0] if len(errors) == 1 else
                          "invalid values:\n  - " + "\n  - ".join(errors))
    return Config(**{name: SECTIONS[name](**kw) for name, kw in per_section.items()})


def parse(argv: list[str] | None = None) -> tuple[Config, list[str]]:
    """(config, the Megatron-LM flags taken because they describe this model)."""
    cfg, taken, _ = parse_with_notes(argv)
    return cfg, taken


def parse_with_notes(argv: list[str] | None = None) -> tuple[Config, list[str], list[str]]:
    """`parse` plus the start-up lines of `startup_notes`."""
    ns = build_parser().parse_args(argv)
    cfg = args_to_config(ns)
    return cfg, check_megatron_flags(ns, cfg), startup_notes(ns, cfg)


def parse_config(argv: list[str] | None = None) -> Config:
    return parse(argv)[0]


def all_flags() -> list[str]:
    """Every option string of our own flags, sorted (the CLI snapshot test freezes this list;
    megatron_flags.tsv freezes the Megatron-only ones)."""
    parser = build_parser()
    flags = {s for a in parser._actions if not a.dest.startswith(_MEGATRON_DEST)
             for s in a.option_strings}
    return sorted(flags)
