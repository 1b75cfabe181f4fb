"""User mistakes end in one line: `error: <message>` on stderr, exit status 2, no traceback.

The project's errors about what the user gave derive from `UserError`: ConfigError (flags,
layout), LaunchError (torchrun / Slurm variables), ShardError (data paths, shards, manifests)
and CheckpointError (--load, `latest`, checkpoint files); the tokenizer's TokenizerError (model
files, training inputs) is one too, although tokenizer/ cannot import this module. Their
messages name the flag or file and the fix, so a traceback around them would only tell the user
that the program crashed. Any other exception is a bug and keeps its traceback, and so do these
with --debug or MEGATRON_LITE_DEBUG=1.

On several ranks (torchrun, srun): an error raised before the process groups exist comes from
the same command line and the same files on every rank, so rank 0 alone prints it and the others
exit 2 quietly. One raised later can be a single rank's finding (its shards, its share of a
checkpoint), so `training.run` marks it with `found_on_rank` and each rank that raised it prints
`error: rank R: <message>`; so is a missing --load found before them (a node-local disk).

Stdlib only: config.py imports it, so it sits below everything else.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

DEBUG_ENV = "MEGATRON_LITE_DEBUG"


USER_ERROR_EXIT_CODE = 2
"""Exit status of a user mistake (argparse's too); kept for those alone."""


class UserError(Exception):
    """Something the user gave cannot work; the message names it and the fix."""

    exit_code = USER_ERROR_EXIT_CODE
    """What `run_cli` exits with; a subclass that is no mistake of the user's (a lost peer)
    keeps the one-line report and sets its own, so a launcher can tell them apart."""

    same_on_every_rank = False
    """Every rank raises it together, after agreeing (e.g. the skip-limit stop): rank 0 alone
    prints it, as before the process groups exist."""


def is_user_error(err: BaseException) -> bool:
    # Imported here: tokenizer/ loads sentencepiece, which config.py (importing us) must not.
    from tokenizer import TokenizerError

    return isinstance(err, (UserError, TokenizerError))


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """The --debug flag every entrypoint accepts (run_cli reads it from the command line)."""
    parser.add_argument("--debug", action="store_true",
                        help=f"show the Python traceback of a user mistake too ({DEBUG_ENV}=1)")


@contextmanager
def found_on_rank(rank: int) -> Iterator[None]:
    """Mark the user errors raised inside as this rank's own finding: it reports them itself."""
    try:
        yield
    except Exception as err:
        if is_user_error(err) and not getattr(err, "same_on_every_rank", False):
            err.found_on_rank = rank  # type: ignore[attr-defined]
        raise


def _rank_and_world_size() -> tuple[int, int]:
    """From torchrun's variables, else srun's (parallel/launch.py's order), else one process."""
    env = os.environ
    for rank, world in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if env.get(rank, "").isdigit() and env.get(world, "").isdigit():
            return int(env[rank]), int(env[world])
    return 0, 1


def report(err: BaseException) -> None:
    """Print a user error as one `error:` line (see the module docstring for which rank)."""
    rank, world_size = _rank_and_world_size()
    found = getattr(err, "found_on_rank", None)
    if world_size > 1 and found is not None:
        print(f"error: rank {found}: {err}", file=sys.stderr, flush=True)
    elif rank == 0:
        print(f"error: {err}", file=sys.stderr, flush=True)


def run_cli(main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """`main(argv)` (argv: the command line after the program name, default sys.argv[1:]),
    with a user mistake reported by `report` and its `exit_code` (2) instead of a traceback."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        return main(argv)
    except Exception as err:
        if not is_user_error(err) or "--debug" in argv or os.environ.get(DEBUG_ENV) == "1":
            raise
        report(err)
        return getattr(err, "exit_code", USER_ERROR_EXIT_CODE)
