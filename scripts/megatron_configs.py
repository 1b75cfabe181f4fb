"""Dry-run Megatron-LM's functional-test configs here, flags unchanged, and tabulate the result.

    python scripts/megatron_configs.py path/to/model_config.yaml ...
    python scripts/megatron_configs.py --git /path/to/Megatron-LM.git gpt3_mcore_te_tp1_pp4_swiglu
    python scripts/megatron_configs.py --git REPO --print-argv gpt3_mcore_reruns_persistent_2

Each file's MODEL_ARGS (and every MODEL_ARGS_<n> variant) becomes a command line the way
Megatron's test launcher writes one: `true` -> the bare switch, `false` -> omitted, a list ->
its items, anything else -> its text. What points outside this machine is swapped, nothing
else: the data flags (--data-path and the per-split ones, --data-cache-path) become
--mock-data; --vocab-file / --merge-file become a small GPT-2 byte-level BPE vocabulary built
in a scratch directory; --save, --load, --tensorboard-dir and any other ${VAR} path become
scratch directories (${REPEAT}, the test's repeat index, becomes 1), except --export-kd-cfg:
a scratch file holding ENV_VARS' DISTILL_CONFIG as YAML, which the test's BEFORE_SCRIPT
writes there (the distillation teacher's directory is an empty scratch one: the dry run plans
a teacher of the student's shape). Each runs
`pretrain.py --dry-run --world-size N` in its own process (N = 8, --world-size, or the
variant's MODEL_ENV_VARS GPUS_PER_NODE where the file sets one: those are 1- and 2-GPU tests
whose global batch is smaller than 8 ranks) and the table gives its exit status and first
error line. `--git` reads `tests/functional_tests/test_cases/gpt/NAME/
model_config.yaml` from a (bare) Megatron-LM clone's HEAD instead of files.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CASES = "tests/functional_tests/test_cases/gpt"

DATA_FLAGS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path",
              "--data-cache-path")
"""Flags naming the test cluster's data: replaced by --mock-data."""

SCRATCH_FLAGS = ("--save", "--load", "--tensorboard-dir")
"""Flags naming output or checkpoint directories: each gets an empty scratch directory."""

FILE_FLAGS = {"--export-kd-cfg": "distill_config.yaml"}
"""Flags naming a file the test's BEFORE_SCRIPT writes: a scratch file of that name."""

VARIANT = re.compile(r"MODEL_ARGS(_\d+)?$")
VAR = re.compile(r"\$\{(\w+)\}")


def gpt2_byte_chars() -> dict[int, str]:
    """Byte -> the printable character GPT-2's byte-level BPE writes it as: printable Latin-1
    bytes stand for themselves, the other 68 take code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def write_gpt2_bpe(directory: Path) -> tuple[Path, Path]:
    """A tiny GPT-2 style tokenizer: the 256 byte symbols, a few merges ("Ġt", "he", "Ġthe")
    and <|endoftext|> last, as vocab.json + merges.txt."""
    symbols = list(gpt2_byte_chars().values())
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    vocab = {s: i for i, s in enumerate([*symbols, *("".join(m) for m in merges),
                                         "<|endoftext|>"])}
    vocab_file, merge_file = directory / "vocab.json", directory / "merges.txt"
    vocab_file.write_text(json.dumps(vocab, ensure_ascii=False))
    merge_file.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return vocab_file, merge_file


def variants(text: str) -> list[tuple[str, dict, int | None]]:
    """(MODEL_ARGS key, its flags, its GPUS_PER_NODE or None) for MODEL_ARGS and every
    MODEL_ARGS_<n>, in file order."""
    doc = yaml.safe_load(text) or {}
    env = doc.get("MODEL_ENV_VARS") or {}
    return [(k, v, (env.get(k) or {}).get("GPUS_PER_NODE")) for k, v in doc.items()
            if VARIANT.match(k) and isinstance(v, dict)]


def _value(flag: str, value: object, scratch: Path, tokenizer: tuple[Path, Path]) -> str:
    if flag == "--vocab-file":
        return str(tokenizer[0])
    if flag == "--merge-file":
        return str(tokenizer[1])
    text = str(value)
    if text.strip() == "${REPEAT}":
        return "1"
    if flag in FILE_FLAGS:
        scratch.mkdir(parents=True, exist_ok=True)
        return str(scratch / FILE_FLAGS[flag])
    if flag in SCRATCH_FLAGS or VAR.search(text):
        path = scratch / flag.strip("-")
        path.mkdir(parents=True, exist_ok=True)
        return str(path)
    return text


def to_argv(flags: dict, scratch: Path, tokenizer: tuple[Path, Path]) -> list[str]:
    """MODEL_ARGS as Megatron's launcher turns it into a command line, with this machine's
    stand-ins (module docstring)."""
    argv: list[str] = []
    mock = False
    for flag, value in flags.items():
        if not str(flag).startswith("--") or value is False:
            continue
        if flag in DATA_FLAGS:
            mock = True
            continue
        if value is True or value is None:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, _value(flag, value, scratch, tokenizer)]
    if mock and "--mock-data" not in argv:
        argv.append("--mock-data")
    return argv


def write_before_script_files(text: str, argv: list[str]) -> None:
    """What the test's BEFORE_SCRIPT writes: ENV_VARS' DISTILL_CONFIG (YAML flow style) as
    the --export-kd-cfg file."""
    distill = ((yaml.safe_load(text) or {}).get("ENV_VARS") or {}).get("DISTILL_CONFIG")
    if "--export-kd-cfg" in argv and distill is not None:
        path = Path(argv[argv.index("--export-kd-cfg") + 1])
        path.write_text(yaml.safe_dump(yaml.safe_load(distill)))


def first_error(output: str) -> str:
    """The line a user reads first: `error: ...`, else the traceback's last line. An error
    that introduces a list (`...: ` then `- --flag value: why` lines) gets the flags listed."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith("error:") or "error: unrecognized" in line:
            if not line.endswith(":"):
                return line
            items = [item[2:].split(":")[0] for item in lines[i + 1:] if item.startswith("- ")]
            return f"{line} {', '.join(items)}"
    return lines[-1] if lines else ""


def dry_run(argv: list[str], world_size: int) -> tuple[int, str]:
    """(exit status, first error line) of `pretrain.py --dry-run --world-size N argv`."""
    cmd = [sys.executable, str(REPO / "pretrain.py"), "--dry-run", "--world-size",
           str(world_size), *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc.returncode, "" if proc.returncode == 0 else first_error(proc.stderr
                                                                        + proc.stdout)


def read_config(source: str, git: str | None) -> str:
    if git is None:
        return Path(source).read_text()
    return subprocess.run(["git", "-C", git, "show", f"HEAD:{CASES}/{source}/model_config.yaml"],
                          capture_output=True, text=True, check=True).stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("configs", nargs="+", help="model_config.yaml paths (names with --git)")
    ap.add_argument("--git", metavar="REPO", help="read the configs from this Megatron-LM "
                    f"clone's HEAD:{CASES}/NAME/model_config.yaml")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--print-argv", action="store_true",
                    help="print each variant's command line (JSON) instead of running it")
    args = ap.parse_args(argv)
    if not args.print_argv:
        print(f"{'config':<60} {'world':>5} {'rc':>3}  first error")
    rows = []
    with tempfile.TemporaryDirectory(prefix="megatron-configs-") as tmp:
        tokenizer = write_gpt2_bpe(Path(tmp))
        for source in args.configs:
            name = Path(source).parent.name if args.git is None else source
            text = read_config(source, args.git)
            for key, flags, gpus in variants(text):
                label = name if key == "MODEL_ARGS" else f"{name}[{key}]"
                cmd = to_argv(flags, Path(tmp) / label, tokenizer)
                write_before_script_files(text, cmd)
                world = gpus or args.world_size
                if args.print_argv:
                    print(f"{label} (world {world}): {json.dumps(cmd)}")
                    continue
                rc, error = dry_run(cmd, world)
                rows.append((label, rc, error))
                print(f"{label:<60} {world:>5} {rc:>3}  {error}", flush=True)
    if rows:
        ok = sum(rc == 0 for _, rc, _ in rows)
        print(f"{ok} of {len(rows)} dry runs exit 0")
    return 0 if all(rc == 0 for _, rc, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
