"""Run several `python SCRIPT ARGS --help` / `python -m MODULE ARGS --help` commands as fresh
interpreters would, each forked from this one after it imported the heavy third-party modules
once (tests/test_readme.py: a dozen README commands that each spent ~2 s of CPU importing torch
to print a usage line).

    python tests/readme_help.py PRELOAD JSON    # in the README command's working directory

PRELOAD is a comma-separated list of modules to import first ("" for none), JSON a list of
argv lists starting with "python". Each child gets the argv, sys.path[0] and `__main__` the
command line would (the script's directory, or the working directory for -m), none of the
repository's modules (only the preloaded third-party ones are already imported), and its
stdout and stderr at the file-descriptor level; it is stricter than the command: before the
`--help` prints, the command's other flags must parse (argparse ignores unknown ones in front
of --help), so a README flag a script lost fails. Prints a JSON list of [exit status, output].
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import sys
import tempfile
import traceback


def _strict_parse_args(real):
    """ArgumentParser.parse_args that first parses the command line without its --help."""
    def parse_args(self, args=None, namespace=None):
        given = sys.argv[1:] if args is None else list(args)
        if "--help" in given:
            real(self, [a for a in given if a != "--help"], namespace)
        return real(self, args, namespace)
    return parse_args


def _run(argv: list[str]) -> int:
    """What `python ARGS...` exits with, run in this (forked) process."""
    if argv[:1] != ["python"] or len(argv) < 2 or (argv[1] == "-m" and len(argv) < 3):
        print(f"not a `python SCRIPT` or `python -m MODULE` command: {argv}", file=sys.stderr)
        return 2
    argparse.ArgumentParser.parse_args = _strict_parse_args(argparse.ArgumentParser.parse_args)
    try:
        if argv[1] == "-m":
            sys.path[0] = os.getcwd()
            sys.argv = [argv[2], *argv[3:]]
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))
            sys.argv = argv[1:]
            runpy.run_path(os.path.abspath(argv[1]), run_name="__main__")  # __file__ too
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def run_forked(argv: list[str]) -> tuple[int, str]:
    """(exit status, stdout and stderr together) of one command, run in a forked child."""
    with tempfile.TemporaryFile() as out:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                code = _run(argv)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        return os.waitstatus_to_exitcode(status), out.read().decode(errors="replace")


def main() -> None:
    preload, commands = sys.argv[1], json.loads(sys.argv[2])
    for name in filter(None, preload.split(",")):
        importlib.import_module(name)
    print(json.dumps([run_forked(argv) for argv in commands]))


if __name__ == "__main__":
    main()
