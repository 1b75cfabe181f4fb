"""The README's contract: every command it shows runs, as written or in a cheap form.

`readme_commands` finds them: each line of the ```bash blocks (continuations joined, comments
dropped) and each inline `python ...` / `bash ...` / `torchrun ...` span of the prose. COMMANDS
gives every one the form run here: the command itself, with its placeholder (`...` or `[...]`)
replaced by `fill`, or `fill` appended (argparse keeps the last value of a repeated flag, so an
appended flag overrides the README's), and `env` put in front: --help, tiny sizes, a dry run or
a smoke flag where the real run is long. They run in README order, so the data commands feed
each other, in one scratch directory that links the repository's files (outputs stay there) and
holds a tiny corpus; on the CPU, inside a fake one-node Slurm allocation (tests/scripts/
slurm_stubs: `srun` starts its tasks here), node-local `/local/...` paths inside the scratch
directory. A README command with no entry fails the first test, naming it. The sbatch launch
scripts are run under the same stubs by tests/scripts/test_launch_scripts.py.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
STUBS = ROOT / "tests" / "scripts" / "slurm_stubs"
TIMEOUT_S = 120
PLACEHOLDER = re.compile(r"\.\.\.|\[[^\]]*\]")
LAUNCHER = re.compile(r'(?:[A-Z_]+=(?:"[^"]*"|\S+)\s+)*(?:python|bash|torchrun|srun|pytest)\s')


class Cheap(NamedTuple):
    """How one README command runs here (see the module docstring); its output must contain
    `expect` and its exit status be `returncode`."""

    expect: str
    fill: str = ""
    env: str = ""
    returncode: int = 0


LAYOUT_1024 = ("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 "
               "--num-attention-heads 8 --global-batch-size 256")
HELP = Cheap("usage:", "--help")

COMMANDS: dict[str, Cheap] = {
    # CI runs `bash scripts/demo.sh --quick` itself, after the suite.
    "bash scripts/demo.sh": Cheap("usage: bash scripts/demo.sh", "--help"),
    "DEMO_ITERS=300 bash scripts/demo.sh --bf16": Cheap("usage: bash scripts/demo.sh", "--help"),
    "bash scripts/demo.sh --moe": Cheap("usage: bash scripts/demo.sh", "--help"),
    # .venv set-up (a no-op unless the requirements changed), then pytest's --help.
    "bash scripts/test.sh": Cheap("usage: python -m pytest", "--help"),
    "bash scripts/test.sh --quick": Cheap("usage: python -m pytest", "--help"),
    "bash scripts/test.sh --slow": Cheap("usage: python -m pytest", "--help"),
    "python pretrain.py --mock-data --train-iters 20": Cheap("iter     20/20"),
    "torchrun --standalone --nproc_per_node=2 pretrain.py --tensor-model-parallel-size 2 "
    "--sequence-parallel --mock-data --train-iters 20": Cheap(  # the run: tests/test_pretrain.py
        "launch: torchrun, world size 2", "--train-iters 2 --eval-iters 1"),
    "srun python pretrain.py ...": Cheap("launch: slurm, world size 1",
                                         "--mock-data --train-iters 2 --eval-iters 10"),
    "python pretrain.py --dry-run --world-size 1024 ...": Cheap(
        "world size 1024 = pp 2 x dp 64 x tp 8", LAYOUT_1024),
    "python pretrain.py --dry-run --world-size 1024 --dry-run-ranks 0 1023 ...": Cheap(
        "2 of 1024 ranks were dry-run", LAYOUT_1024),
    "python -m tokenizer.train --input corpus/ --output-prefix tok --vocab-size 32000": Cheap(
        "wrote tok.model", "--vocab-size 1000 --num-threads 1"),
    "python -m data_tools.preprocess --input corpus/*.jsonl.gz --output-prefix data/web "
    "--tokenizer-model tok.model --workers 8 --num-shards 64 --append-eod": Cheap(
        "64 shards -> data/web.manifest.json", "--workers 2"),
    "srun --ntasks-per-node=1 python -m data_tools.stage --manifest data/web.manifest.json "
    "--local-dir /local/nvme/web ...": Cheap("copied 128 files"),
    "python pretrain.py --data-path /local/nvme/web/web --tokenizer-model tok.model "
    "--split 969,30,1 ...": Cheap("checkpoint: saved iteration 2",
                                  "--train-iters 2 --eval-iters 1 --save ckpt/"),
    "python -m megatron_lite.export --load ckpt/ --output hf/ --tokenizer-model tok.model": Cheap(
        "-> hf/"),
    "python -m megatron_lite.export --from-hf hf/ --save ckpt2/": Cheap("imported hf/"),
    'python scripts/generate.py --load ckpt/ --tokenizer-model tok.model --prompt "def "': Cheap(
        "def ", "--max-new-tokens 4"),
    # The layout's planner report only: the three ranks on meta take ~30 s (tests/test_dry_run).
    'DRY_RUN="0 7 1023" bash scripts/pretrain_llama_70b.sh': Cheap(
        "world size 1024 = pp 8 x dp 16 x tp 8", env="EXTRA_ARGS=--dry-run-ranks"),
    "python pretrain.py --help": Cheap("--tensor-model-parallel-size"),
    "python bench/dry_run.py": HELP,
    "python scripts/plan.py --preset 8B --gpus 8": Cheap("pretrain.py flags for #1"),
    "python scripts/plan.py --preset 70B --gpus 1024": Cheap("pretrain.py flags for #1"),
    # The pictures go to the scratch directory (the appended --out / --timeline wins), not over
    # the committed ones; a tiny run stands in for the demo's.
    "python scripts/plot_run.py demo/metrics.jsonl --out docs/images/demo_curves.png": Cheap(
        "wrote curves.png (1 run)", "--out curves.png",
        env="python pretrain.py --mock-data --train-iters 4 --eval-interval 2 --eval-iters 1 "
            "--log-interval 1 --log-jsonl demo/metrics.jsonl > /dev/null &&"),
    "python scripts/plan.py --preset 8B --gpus 32 --pp 4 --timeline "
    "docs/images/pipeline_schedules.png --timeline-microbatches 8": Cheap(
        "wrote schedules.png", "--timeline schedules.png"),
    "torchrun --standalone --nproc_per_node=4 pretrain.py --context-parallel-size 2 "
    "--tensor-model-parallel-size 2 --sequence-parallel --mock-data --train-iters 20": Cheap(
        "--context-parallel-size N", "--help"),  # the run itself: test_pretrain_context_parallel
    "python scripts/plan.py --preset 8B --seq-length 131072 --global-batch-size 32 --gpus 64":
        Cheap("--context-parallel-size 16"),
    "python scripts/plan.py --preset 70B --seq-length 32768 --global-batch-size 128 --gpus 512":
        Cheap("--context-parallel-size 4"),
    "python bench/context_parallel.py": HELP,
    "pytest -m gpu": Cheap("skipped", "tests/kernels"),  # the GPU tests are all there
    "python bench/kernels.py": HELP,
    "bash scripts/gpu_check.sh OUT_DIR": Cheap("no CUDA device visible", returncode=1),
    "python -m tests.kernels.aot_compile": HELP,
    "OMP_NUM_THREADS=1 bash scripts/shakespeare_char_cpu.sh [--bf16 --compile]": Cheap(
        "validation loss at iteration 12",
        "--input shakespeare.txt --train-iters 12 --eval-interval 6 --eval-iters 1"),
    "python bench/model_overhead.py --steps 20 --repeats 3": HELP,
    'python bench/shakespeare.py --steps 20 --repeats 6 --threads 1 --settings "reference fp32 '
    'eager" "ours fp32 eager" "ours bf16 eager" "ours bf16 compiled"': HELP,
    "python bench/zero1.py --steps 20": HELP,
    "python bench/sharding.py --dp 2 4 --steps 10": HELP,
    "python bench/pipeline_bubble.py": HELP,
    "python bench/preprocess.py --mb 20 --repeats 3": HELP,
    "python bench/index_build.py": HELP,
    "python bench/loader.py": HELP,
    "python bench/scaling.py --steps 5 --warmup 2 --repeats 3": HELP,
    "torchrun --standalone --nproc_per_node=2 scripts/bench_collectives.py": Cheap(
        "wrote coll.json", "--ops all_reduce --max-bytes 8192 --max-iters 5 --json coll.json"),
    "bash scripts/demo.sh --quick": Cheap("usage: bash scripts/demo.sh", "--help"),
    "python -m tests.test_regression --regenerate": HELP,
}
# Spans that read like commands but are pieces of one, named in the prose.
NOT_COMMANDS = {
    "torchrun --max-restarts N": "a torchrun flag, named in the reliability table",
    "pytest -n 2 --dist loadfile": "the pytest flags inside scripts/test.sh",
}


def _normalize(text: str) -> str:
    return " ".join(text.split())


def readme_commands(text: str) -> list[str]:
    """The commands of a README, normalized, in order, each once."""
    found: list[str] = []
    for part in re.split(r"(^```.*?^```)", text, flags=re.M | re.S):
        if part.startswith("```bash"):
            block = part.split("\n", 1)[1].rsplit("```", 1)[0].replace("\\\n", " ")
            found += [_normalize(re.sub(r"\s#.*$", "", line)) for line in block.splitlines()]
        elif not part.startswith("```"):
            found += [c for c in map(_normalize, re.findall(r"`([^`]+)`", part))
                      if LAUNCHER.match(c)]
    return list(dict.fromkeys(c for c in found if c))


def missing_entries(commands: list[str]) -> list[str]:
    return [c for c in commands if c not in COMMANDS and c not in NOT_COMMANDS]


def cheap_form(command: str) -> str:
    cheap = COMMANDS[command]
    line, filled = PLACEHOLDER.subn(cheap.fill, command, count=1)
    if not filled:
        line = f"{line} {cheap.fill}"
    return _normalize(f"{cheap.env} {line}").replace(" /local/", " local/")


def make_scratch(path: Path) -> Path:
    """A directory that looks like the repository (its tracked top-level entries and .venv,
    linked) and holds what the README commands read: corpus/ and shakespeare.txt."""
    path.mkdir()
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    for name in sorted({p.split("/")[0] for p in tracked} | {".venv"}):
        if (ROOT / name).exists():
            (path / name).symlink_to(ROOT / name)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(stdlib.glob("*.py"))[:120]
    (path / "corpus").mkdir()
    for i in range(2):
        with gzip.open(path / "corpus" / f"part{i}.jsonl.gz", "wt") as f:
            for source in sources[i::2]:
                f.write(json.dumps({"text": source.read_text(errors="replace")}) + "\n")
    (path / "shakespeare.txt").write_text((stdlib / "textwrap.py").read_text() +
                                          (stdlib / "string.py").read_text())
    return path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(PATH=f"{Path(sys.executable).parent}:{STUBS}:{env['PATH']}",
               PYTHON=sys.executable, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               WANDB_MODE="disabled", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="127.0.0.1",
               SLURM_NNODES="1", FAKE_SLURM_HOSTS="127.0.0.1")
    return env


def _verdict(command: str, line: str, returncode: int, out: str) -> str | None:
    cheap = COMMANDS[command]
    if returncode == cheap.returncode and cheap.expect in out:
        return None
    return (f"README command `{command}`, run as `{line}`: exit {returncode} (want "
            f"{cheap.returncode}), {cheap.expect!r} {'' if cheap.expect in out else 'not '}"
            f"printed; the end of its output:\n{out[-2500:]}")


def run_command(command: str, scratch: Path) -> str | None:
    """None when the README command's cheap form passes in `scratch`, else what went wrong."""
    line = cheap_form(command)
    with subprocess.Popen(["bash", "-c", line], cwd=scratch, env=_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun's workers too
            out, _ = proc.communicate()
    return _verdict(command, line, proc.returncode, out)


def forkable(command: str) -> bool:
    """A `python ... --help` form, run by run_help_commands instead of its own interpreter."""
    cheap = COMMANDS[command]
    return cheap.fill == "--help" and not cheap.env and command.startswith("python ")


def run_help_commands(commands: list[str], scratch: Path,
                      preload: str = "torch,numpy") -> list[str]:
    """run_command's verdicts on `forkable` commands, each forked from one interpreter that
    imported `preload` once (tests/readme_help.py; which also has each command's other flags
    parse before its --help prints); only the failures."""
    lines = [cheap_form(c) for c in commands]
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "readme_help.py"), preload,
                           json.dumps([shlex.split(line) for line in lines])],
                          cwd=scratch, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-2500:] + proc.stderr[-2500:]
    results = json.loads(proc.stdout)
    return [failure for c, line, (code, out) in zip(commands, lines, results, strict=True)
            if (failure := _verdict(c, line, code, out))]


def test_every_readme_command_has_a_cheap_form() -> None:
    commands = readme_commands(README.read_text())
    missing = missing_entries(commands)
    assert not missing, ("README commands with no entry in COMMANDS (tests/test_readme.py); add "
                         "one (as written, or with --help, tiny flags, a dry run):\n  "
                         + "\n  ".join(missing))
    stale = [c for c in [*COMMANDS, *NOT_COMMANDS] if c not in commands]
    assert not stale, "entries for commands the README no longer has:\n  " + "\n  ".join(stale)
    assert all(len(PLACEHOLDER.findall(c)) <= 1 for c in COMMANDS)


def test_a_new_readme_command_needs_an_entry() -> None:
    text = ("Train:\n```bash\npython pretrain.py --mock-data --train-iters 20   # fine\n"
            "python pretrain.py --new-flag \\\n    --mock-data    # not in COMMANDS\n```\n"
            "and `python bench/new.py --fast` inline, `--save DIR` is no command.\n")
    commands = readme_commands(text)
    assert commands == ["python pretrain.py --mock-data --train-iters 20",
                        "python pretrain.py --new-flag --mock-data", "python bench/new.py --fast"]
    assert missing_entries(commands) == commands[1:]


QUICKSTART = ("python pretrain.py --mock-data --train-iters 20", "python pretrain.py --help")
"""Run by the quick test; every other README command by test_readme_commands_run."""


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return make_scratch(tmp_path_factory.mktemp("readme") / "repo")


def _run_all(commands: list[str], scratch: Path) -> None:
    """The forkable --help forms first (they read and write nothing), then the rest in order."""
    forked = [c for c in commands if forkable(c)]
    failures = run_help_commands(forked, scratch) if forked else []
    failures += [failure for c in commands
                 if c not in forked and (failure := run_command(c, scratch))]
    assert not failures, "\n\n".join(failures)


@pytest.mark.quick
def test_readme_quickstart_commands_run(scratch: Path) -> None:
    commands = readme_commands(README.read_text())
    assert all(c in commands for c in QUICKSTART)
    _run_all(list(QUICKSTART), scratch)


@pytest.mark.slow
def test_readme_commands_run(scratch: Path) -> None:
    """Every other README command, in README order (the data commands feed each other)."""
    _run_all([c for c in readme_commands(README.read_text())
              if c in COMMANDS and c not in QUICKSTART], scratch)


def test_a_broken_readme_command_is_reported(tmp_path) -> None:
    """With scripts/generate.py renamed, the runner names the README command that broke."""
    scratch = make_scratch(tmp_path / "repo")
    (scratch / "scripts").unlink()
    shutil.copytree(ROOT / "scripts", scratch / "scripts")
    (scratch / "scripts" / "generate.py").rename(scratch / "scripts" / "sample.py")
    command = next(c for c in COMMANDS if "scripts/generate.py" in c)
    failure = run_command(command, scratch)
    assert failure is not None and failure.startswith(f"README command `{command}`")
    assert "can't open file" in failure and "generate.py" in failure
