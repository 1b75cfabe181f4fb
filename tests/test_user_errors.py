"""User mistakes end in one `error:` line on stderr and exit status 2, no traceback, at every
entrypoint; --debug / MEGATRON_LITE_DEBUG=1 show the traceback; bugs keep theirs; on several
ranks an error shared by all is printed once (rank 0), a rank's own finding by that rank."""

from __future__ import annotations

import os
import runpy
import socket
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import pretrain
from megatron_lite import errors
from megatron_lite.checkpoint import CheckpointError
from megatron_lite.config import ConfigError
from megatron_lite.data.format import ShardWriter, shard_name, write_manifest
from tokenizer import TokenizerError
from tokenizer.train import main as train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 400


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A tokenizer, a good corpus and the bad inputs the mistakes below name."""
    d = tmp_path_factory.mktemp("inputs")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (d / "text.txt").write_text("".join((stdlib / f).read_text() for f in ("textwrap.py",
                                                                         "string.py")))
    assert train_tokenizer(["--input", str(d / "text.txt"), "--output-prefix", str(d / "tok"),
                            "--vocab-size", str(VOCAB), "--num-threads", "1"]) == 0
    for name in ("good", "corrupt"):
        w = ShardWriter(shard_name(d / name, 0), np.uint16)
        tokens = np.random.default_rng(0).integers(4, VOCAB, size=4000)
        w.add_documents(tokens, np.full(40, 100))
        write_manifest(d / f"{name}.manifest.json", {
            "shards": [w.finalize()], "total_documents": 40, "total_tokens": 4000,
            "tokenizer": {"vocab_size": VOCAB, "eod_id": 2}})
    idx = d / "corrupt_00000.idx"
    idx.write_bytes(b"NOTMEGAT\x00" + idx.read_bytes()[9:])  # the 9-byte magic
    (d / "junk.model").write_text("not a sentencepiece model\n")
    (d / "ckpt").mkdir()
    (d / "ckpt" / "latest").write_text("garbage\n")
    return d


def _run(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**_clean_env(), "OMP_NUM_THREADS": "1",
                                            "CUDA_VISIBLE_DEVICES": "", **env})


def _in_process(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                capfd: pytest.CaptureFixture) -> subprocess.CompletedProcess:
    """`python ARGV` run inside this process (a subprocess costs seconds of torch import):
    `-m module` and `script.py` are executed as `__main__` by runpy, exactly as the
    interpreter would, with `sys.argv` set, the environment of `_run` (no launcher or debug
    variables, CUDA hidden) and the output captured at the file descriptors."""
    for key in set(os.environ) - set(_clean_env()):
        monkeypatch.delenv(key)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # CUDA_VISIBLE_DEVICES=""
    module = argv[1] if argv[0] == "-m" else None
    args = argv[2:] if module else argv[1:]
    monkeypatch.setattr(sys, "argv", [module or argv[0], *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # scripts prepend the repository root
    monkeypatch.chdir(ROOT)
    capfd.readouterr()
    grad = torch.is_grad_enabled()  # scripts/generate.py turns autograd off for its process
    try:
        with warnings.catch_warnings():  # "found in sys.modules": it was imported already
            warnings.simplefilter("ignore", RuntimeWarning)
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        torch.set_grad_enabled(grad)
    out, err = capfd.readouterr()
    assert not torch.distributed.is_initialized()  # the entrypoint tore down what it set up
    return subprocess.CompletedProcess(argv, code, out, err)


def _pretrain_in_process(flags: list[str], monkeypatch: pytest.MonkeyPatch,
                         capfd: pytest.CaptureFixture) -> subprocess.CompletedProcess:
    """`pretrain.main(flags)`: what `python pretrain.py FLAGS` exits with, minus the process
    (its `__main__` block also enables faulthandler, which must not point at a capture file;
    `test_pretrain_process_exits_2_with_one_line` runs the real process)."""
    for key in set(os.environ) - set(_clean_env()):
        monkeypatch.delenv(key)
    capfd.readouterr()
    code = pretrain.main(flags)
    out, err = capfd.readouterr()
    assert not torch.distributed.is_initialized()
    return subprocess.CompletedProcess(["pretrain.py", *flags], code, out, err)


def _clean_env() -> dict[str, str]:
    """This environment without launcher or debug variables (the suite itself may run under
    torchrun or Slurm)."""
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", errors.DEBUG_ENV)
    return {k: v for k, v in os.environ.items()
            if k not in launch and not k.startswith(("SLURM_", "TORCHELASTIC_"))}


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def _assert_one_clean_line(proc: subprocess.CompletedProcess, expected: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = _error_lines(proc)
    assert len(lines) == 1 and expected in proc.stderr, out[-3000:]


# (flags after pretrain.py, with {d} = the inputs directory; text the message must hold)
PRETRAIN_MISTAKES = {
    "missing tokenizer": (["--data-path", "{d}/good", "--tokenizer-model", "/x.model"],
                          "--tokenizer-model /x.model: no such file; train one with"),
    "junk latest": (["--mock-data", "--load", "{d}/ckpt"],
                    "latest holds 'garbage', which is not a checkpoint directory"),
    "bad data path": (["--data-path", "{d}/nowhere/web", "--tokenizer-model", "{d}/tok.model"],
                      "nowhere/web: neither"),
    "corrupt shard": (["--data-path", "{d}/corrupt"], "corrupt_00000.idx: bad magic"),
    "layout does not divide": (["--mock-data", "--tensor-model-parallel-size", "3"],
                               "not divisible by --tensor-model-parallel-size 3"),
    "wrong load": (["--mock-data", "--load", "{d}/typo"], "typo: no checkpoint there"),
    "unreadable tokenizer": (["--data-path", "{d}/good", "--tokenizer-model", "{d}/junk.model"],
                             "junk.model: not a sentencepiece model"),
}


@pytest.mark.parametrize("mistake", PRETRAIN_MISTAKES)
def test_pretrain_mistake_is_one_line(inputs, mistake, monkeypatch, capfd) -> None:
    flags, expected = PRETRAIN_MISTAKES[mistake]
    proc = _pretrain_in_process(["--train-iters", "1", *(f.format(d=inputs) for f in flags)],
                                monkeypatch, capfd)
    _assert_one_clean_line(proc, expected)


@pytest.mark.quick
def test_pretrain_process_exits_2_with_one_line() -> None:
    """The real `python pretrain.py`: its exit status is main's 2, and stderr holds only the
    one `error:` line (the in-process cases above cannot see the interpreter's own output)."""
    flags, expected = PRETRAIN_MISTAKES["layout does not divide"]
    proc = _run(["pretrain.py", "--train-iters", "1", *flags])
    _assert_one_clean_line(proc, expected)
    assert proc.stderr.strip().splitlines()[0] == _error_lines(proc)[0], proc.stderr


# Every other entrypoint, one mistake each.
ENTRYPOINT_MISTAKES = {
    "preprocess": (["-m", "data_tools.preprocess", "--input", "{d}/missing.jsonl",
                    "--output-prefix", "{d}/out", "--tokenizer-model", "{d}/tok.model"],
                   "--input {d}/missing.jsonl: no such file"),
    "stage": (["-m", "data_tools.stage", "--manifest", "{d}/missing.manifest.json",
               "--local-dir", "{d}/local"], "missing.manifest.json: not a readable manifest"),
    "tokenizer": (["-m", "tokenizer.train", "--input", "{d}/missing.txt", "--output-prefix",
                   "{d}/t", "--vocab-size", "300"], "--input {d}/missing.txt: no such file"),
    "export": (["-m", "megatron_lite.export", "--load", "{d}/ckpt", "--output", "{d}/hf"],
               "latest holds 'garbage'"),
    "generate": (["scripts/generate.py", "--load", "{d}/typo", "--tokenizer-model",
                  "{d}/tok.model"], "--load {d}/typo: no checkpoint there"),
    "plan": (["scripts/plan.py", "--gpus", "8"], "give --preset or --num-layers"),
    "bench_collectives": (["scripts/bench_collectives.py", "--backend", "nccl"],
                          "--backend nccl needs CUDA"),
}


IN_PROCESS = {"export", "generate", "bench_collectives"}
"""The entrypoints that import torch run in this process (see `_in_process`); the others
start in a fraction of a second and run as real processes."""


@pytest.mark.parametrize("entrypoint", ENTRYPOINT_MISTAKES)
def test_every_entrypoint_reports_one_line(inputs, entrypoint, monkeypatch, capfd) -> None:
    argv, expected = ENTRYPOINT_MISTAKES[entrypoint]
    argv = [a.format(d=inputs) for a in argv]
    proc = _in_process(argv, monkeypatch, capfd) if entrypoint in IN_PROCESS else _run(argv)
    _assert_one_clean_line(proc, expected.format(d=inputs))


def test_debug_flag_shows_the_traceback(inputs) -> None:
    """A real process: the user error escapes main, so the interpreter prints its traceback
    and exits 1."""
    proc = _run(["pretrain.py", "--mock-data", "--load", str(inputs / "typo"), "--debug"])
    assert proc.returncode == 1 and not _error_lines(proc), proc.stderr[-3000:]
    assert "Traceback" in proc.stderr and "CheckpointError: --load" in proc.stderr


def test_debug_env_lets_the_error_escape(inputs, monkeypatch, capfd) -> None:
    """MEGATRON_LITE_DEBUG=1 does what --debug does (above: escaping main is the traceback and
    exit 1): the CheckpointError leaves main instead of an `error:` line."""
    for key in set(os.environ) - set(_clean_env()):
        monkeypatch.delenv(key)
    monkeypatch.setenv(errors.DEBUG_ENV, "1")
    with pytest.raises(CheckpointError, match=r"--load .*typo: no checkpoint there"):
        pretrain.main(["--mock-data", "--load", str(inputs / "typo")])
    assert not _error_lines(subprocess.CompletedProcess([], 1, *capfd.readouterr()))
    assert not torch.distributed.is_initialized()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_two_ranks(flags: list[str]) -> list[subprocess.Popen]:
    """pretrain.py as ranks 0 and 1 of a two-process job (RANK / WORLD_SIZE set as torchrun
    would), each with its own output, so that what each rank printed can be told apart."""
    common = {**_clean_env(), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
              "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    return [subprocess.Popen([sys.executable, "pretrain.py", *flags], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**common, "RANK": str(rank), "LOCAL_RANK": str(rank)})
            for rank in range(2)]


def _finish(procs: list[subprocess.Popen]) -> list[subprocess.CompletedProcess]:
    outs = [proc.communicate(timeout=180) for proc in procs]
    return [subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            for proc, (out, err) in zip(procs, outs)]


def test_on_two_ranks_a_shared_error_is_printed_once_and_a_found_one_by_each_rank(
        inputs) -> None:
    """Both two-rank jobs start at once (their own ports): their torch imports overlap."""
    shared = _start_two_ranks(["--mock-data", "--tensor-model-parallel-size", "3"])
    found = _start_two_ranks(["--mock-data", "--load", str(inputs / "typo")])
    rank0, rank1 = _finish(shared)
    _assert_one_clean_line(rank0, "world size 2 is not divisible")
    assert _error_lines(rank0) == ["error: invalid configuration:"]  # no rank: all found it
    assert rank1.returncode == 2 and not rank1.stderr.strip(), rank1.stderr[-3000:]
    for rank, proc in enumerate(_finish(found)):
        _assert_one_clean_line(proc, f"error: rank {rank}: --load {inputs / 'typo'}: no checkpoint")


# ---- the helper itself, in process ------------------------------------------------------------

def _raising(err: Exception):
    def main(argv: list[str]) -> int:
        raise err
    return main


def test_run_cli_turns_only_user_errors_into_exit_2(monkeypatch, capsys) -> None:
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", errors.DEBUG_ENV):
        monkeypatch.delenv(key, raising=False)
    assert errors.run_cli(_raising(ConfigError("--x 3: use 4")), []) == 2
    assert errors.run_cli(_raising(TokenizerError("tok.model: missing")), []) == 2
    assert capsys.readouterr().err == "error: --x 3: use 4\nerror: tok.model: missing\n"
    with pytest.raises(KeyError):  # a bug keeps its traceback
        errors.run_cli(_raising(KeyError("x")), [])
    with pytest.raises(ConfigError):
        errors.run_cli(_raising(ConfigError("y")), ["--debug"])
    monkeypatch.setenv(errors.DEBUG_ENV, "1")
    with pytest.raises(ConfigError):
        errors.run_cli(_raising(ConfigError("y")), [])


def test_which_rank_prints(monkeypatch, capsys) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert errors.run_cli(_raising(ConfigError("shared")), []) == 2
    assert capsys.readouterr().err == ""  # rank 0 prints what every rank computed
    with pytest.raises(ConfigError) as raised, errors.found_on_rank(3):
        raise ConfigError("only mine")
    assert errors.run_cli(_raising(raised.value), []) == 2
    assert capsys.readouterr().err == "error: rank 3: only mine\n"
    monkeypatch.setenv("RANK", "0")
    assert errors.run_cli(_raising(ConfigError("shared")), []) == 2
    assert capsys.readouterr().err == "error: shared\n"
    with pytest.raises(KeyError) as bug, errors.found_on_rank(3):
        raise KeyError("bug")
    assert not hasattr(bug.value, "found_on_rank")
