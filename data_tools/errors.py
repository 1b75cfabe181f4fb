"""The data tools end on a user mistake as megatron_lite's entrypoints do (megatron_lite/errors.py):
one `error: <message>` line on stderr, exit status 2, the traceback only with --debug or
MEGATRON_LITE_DEBUG=1. A copy of its few lines, since data_tools imports only
megatron_lite.data.format; other exceptions are bugs and keep their traceback."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from data_tools.encode import BadInputError
from megatron_lite.data.format import ShardError
from tokenizer.tokenizer import TokenizerError

USER_ERRORS = (BadInputError, ShardError, TokenizerError)


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="show the Python traceback of a user mistake too "
                        "(MEGATRON_LITE_DEBUG=1)")


def run_cli(main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """`main(argv)` with a user mistake printed as one `error:` line and exit status 2."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        return main(argv)
    except USER_ERRORS as err:
        if "--debug" in argv or os.environ.get("MEGATRON_LITE_DEBUG") == "1":
            raise
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
