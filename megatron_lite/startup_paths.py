"""Every path the user gave, checked before anything is built: existence, type (file or
directory) and writability, one message per path naming its flag and the fix.

Without it a bad path is found where it is first used: `--save` pointing at a file after the
whole run, `--save afile/ckpt` at the first save, `--log-jsonl <a directory>` at the first log
line, a missing `--tokenizer-model` never (with --mock-data). Checking here costs a few
`stat` calls. The tokenizer files are checked here only with --mock-data, which reads none
(a flag given is a flag meant); otherwise the tokenizer is loaded before the model and
names a bad one itself. A missing --load is found next, by checkpoint.apply_checkpoint_args,
still before the model is built (--load equal to --save may start empty). Node-local data
paths exist only on their node, so they are left to the rank that reads them (data.builder),
--data-cache-path to data.index (unwritable: a warning in one process, an error for a
preparing rank), and --dry-run checks none (a cluster you are not on).
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_lite.config import Config, ConfigError, parse_blend

MANIFEST_SUFFIX = ".manifest.json"  # as data.format's (config may not import data)


def _nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists (where a mkdir -p would start)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _creatable(flag: str, path: Path, what: str) -> str | None:
    """Why `path` (absent) cannot be created as a `what`, or None."""
    base = _nearest_existing(path.absolute().parent)
    if not base.is_dir():
        return (f"{flag} {path}: {base} is a file, so the {what} cannot be created under it; "
                "pass a path in a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        return f"{flag} {path}: {base} is not writable, so the {what} cannot be created"
    return None


def writable_dir_error(flag: str, value: str) -> str | None:
    """A directory this run writes into (created if missing)."""
    path = Path(value)
    if not path.exists():
        return _creatable(flag, path, "directory")
    if not path.is_dir():
        return f"{flag} {path}: is a file, not a directory; pass a directory (or remove the file)"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{flag} {path}: directory is not writable; fix its permissions or pass another"
    return None


def writable_file_error(flag: str, value: str) -> str | None:
    """A file this run appends to (created if missing)."""
    path = Path(value)
    if not path.exists():
        return _creatable(flag, path, "file")
    if path.is_dir():
        return f"{flag} {path}: is a directory; pass a file path inside it (e.g. {path}/log.jsonl)"
    if not os.access(path, os.W_OK):
        return f"{flag} {path}: file is not writable; fix its permissions or pass another"
    return None


def readable_error(flag: str, value: str, kind: str) -> str | None:
    """An input that must exist: kind "file", "directory" or "file or directory"."""
    path = Path(value)
    if not path.exists():
        return f"{flag} {path}: does not exist; check the path"
    if kind == "file" and not path.is_file():
        return f"{flag} {path}: is a directory, not a file"
    if kind == "directory" and not path.is_dir():
        return f"{flag} {path}: is a file, not a directory"
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        return f"{flag} {path}: is not readable; fix its permissions"
    return None


def data_path_error(flag: str, value: str) -> str | None:
    """A blend entry: a manifest (X or X.manifest.json) or a .bin/.idx pair."""
    if any(Path(p).is_file() for p in (value + MANIFEST_SUFFIX, value)
           if p.endswith(MANIFEST_SUFFIX)):
        return None
    missing = [p for p in (f"{value}.bin", f"{value}.idx") if not Path(p).is_file()]
    if not missing:
        return None
    return (f"{flag} {value}: neither {value}{MANIFEST_SUFFIX} nor {' and '.join(missing)} "
            "exists (a shard is a .bin/.idx pair, a corpus a manifest); check the path or run "
            "data_tools.preprocess")


def path_errors(cfg: Config) -> list[str]:
    """One message per bad path of `cfg` (see the module docstring)."""
    ck, lg, d = cfg.checkpoint, cfg.logging, cfg.data
    checks = [writable_dir_error(flag, value) for flag, value in (
        ("--save", ck.save), ("--tensorboard-dir", lg.tensorboard_dir),
        ("--profile-dir", lg.profile_dir), ("--wandb-save-dir", lg.wandb_save_dir)) if value]
    if lg.log_jsonl:
        checks.append(writable_file_error("--log-jsonl", lg.log_jsonl))
    if ck.load and Path(ck.load).exists():  # a missing one: apply_checkpoint_args says so
        checks.append(readable_error("--load", ck.load, "directory"))
    for flag, value, kind in (("--tokenizer-model", d.tokenizer_model, "file or directory"),
                              ("--vocab-file", d.vocab_file, "file"),
                              ("--merge-file", d.merge_file, "file")):
        if value and d.mock_data:  # else the tokenizer is loaded first thing, naming it
            checks.append(readable_error(flag, value, kind))
    if not d.mock_data and d.data_sharding == "global":
        for flag, paths in (("--data-path", d.data_path), ("--train-data-path", d.train_data_path),
                            ("--valid-data-path", d.valid_data_path),
                            ("--test-data-path", d.test_data_path)):
            checks += [data_path_error(flag, p) for _, p in parse_blend(paths, flag)]
    return [c for c in checks if c]


def check_paths(cfg: Config) -> None:
    """Raise one ConfigError listing every bad path (one line when there is one)."""
    errors = path_errors(cfg)
    if errors:
        raise ConfigError(errors[0] if len(errors) == 1 else
                          "bad paths:\n  - " + "\n  - ".join(errors))
