"""Load validation, safety (no unpickling, no secrets), crash during a save, async and keep-last.

Single process, in-process: each training run is a few steps of the tiny model.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import pickle
import signal
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_lite.checkpoint import CheckpointError
from megatron_lite.checkpoint import files as F
from megatron_lite.export import single_process_state
from tests.checkpoint.common import flip_tensor_byte, run_train

SHORT = ["--train-iters", "2", "--num-layers", "2"]


def _train(*flags: str) -> list[float]:
    return run_train(single_process_state(), [*SHORT, *flags])


@pytest.fixture
def ckpt(tmp_path) -> Path:
    _train("--save", str(tmp_path / "ck"))
    return tmp_path / "ck"


def _load(ckpt: Path, *flags: str) -> list[float]:
    return _train("--load", str(ckpt), "--save", str(ckpt.parent / "other"), *flags)


def test_model_change_lists_each_field(ckpt) -> None:
    with pytest.raises(CheckpointError) as e:
        _load(ckpt, "--hidden-size", "64", "--num-layers", "3", "--ffn-hidden-size", "64")
    msg = str(e.value)
    assert "--hidden-size: checkpoint 32, this run 64" in msg
    assert "--num-layers: checkpoint 2, this run 3" in msg
    assert "--ffn-hidden-size" not in msg  # unchanged fields are not listed


@pytest.mark.quick
def test_missing_and_truncated_shards_are_named(ckpt) -> None:
    model = ckpt / "iter_0000002" / F.model_file(0, 0)
    optim = ckpt / "iter_0000002" / F.optim_file(0, 0, 0)
    with open(optim, "r+b") as f:
        f.truncate(optim.stat().st_size - 7)
    with pytest.raises(CheckpointError, match=rf"{optim}.*truncated"):
        _load(ckpt)
    model.unlink()
    with pytest.raises(CheckpointError, match=rf"{model} is missing"):
        _load(ckpt)


def test_latest_missing_or_junk_and_newer_version(ckpt) -> None:
    latest = ckpt / "latest"
    latest.write_text("rm -rf /\n")
    with pytest.raises(CheckpointError, match=rf"{latest} holds 'rm -rf /'"):
        _load(ckpt)
    latest.unlink()
    with pytest.raises(CheckpointError, match=rf"{latest} is missing.*--ckpt-step 2"):
        _load(ckpt)
    _load(ckpt, "--ckpt-step", "2")  # the suggested fix works
    meta_path = ckpt / "iter_0000002" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = F.FORMAT_VERSION + 1
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="newer than the 1 this megatron_lite reads"):
        _load(ckpt, "--ckpt-step", "2")


def test_checksums_recorded_and_verified(tmp_path, capsys) -> None:
    """Every file's sha256 is in the metadata; a flipped bit fails an explicit --ckpt-step
    and the export with the file named, and `latest` falls back to the previous one."""
    ckpt = tmp_path / "ck"
    _train("--save", str(ckpt), "--save-interval", "1")
    newest = ckpt / "iter_0000002"
    meta = json.loads((newest / "metadata.json").read_text())
    assert sorted(meta["sha256"]) == sorted(meta["files"])
    for name, digest in meta["sha256"].items():
        assert hashlib.sha256((newest / name).read_bytes()).hexdigest() == digest, name
    victim = newest / F.model_file(0, 0)
    flip_tensor_byte(victim)
    with pytest.raises(CheckpointError, match=rf"{victim} is corrupt.*\nno older complete"):
        _load(ckpt, "--ckpt-step", "2")
    from megatron_lite.export import main as export_main

    capsys.readouterr()
    assert export_main(["--load", str(ckpt), "--output", str(tmp_path / "hf")]) == 2
    assert f"{victim} is corrupt" in capsys.readouterr().err
    assert len(_load(ckpt, "--train-iters", "3")) == 2  # iterations 2 and 3, from 1
    out = capsys.readouterr().out
    assert f"falling back to the previous checkpoint {ckpt / 'iter_0000001'}" in out
    assert "checkpoint: loaded iteration 1 " in out


def test_explicit_load_of_empty_dir_fails(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        _train("--load", str(tmp_path / "typo"))
    assert _train("--save", str(tmp_path / "fresh"))  # --save alone starts from scratch


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_payload_never_runs(ckpt, tmp_path) -> None:
    marker = tmp_path / "pwned"
    blob = pickle.dumps({"model": _Payload(marker)})
    target = ckpt / "iter_0000002" / F.model_file(0, 0)
    target.write_bytes(blob)
    meta_path = ckpt / "iter_0000002" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    # Consistent size and checksum pass verification: the parser itself must refuse.
    meta["files"][target.name] = len(blob)
    meta["sha256"][target.name] = hashlib.sha256(blob).hexdigest()
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        _load(ckpt)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32,
                                                "intermediate_size": 64, "vocab_size": 97,
                                                "num_hidden_layers": 1,
                                                "num_attention_heads": 4}))
    (hf / "pytorch_model.bin").write_bytes(blob)
    from megatron_lite.export import main as export_main

    assert export_main(["--from-hf", str(hf), "--save", str(tmp_path / "imp")]) == 2
    assert not marker.exists()


def test_no_secret_in_checkpoint(tmp_path, monkeypatch) -> None:
    secret, token = "wandb-secret-0123456789", "hf_token_abcdefghijkl"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("HF_TOKEN", token)
    # A secret pasted into a flag value is redacted too.
    _train("--save", str(tmp_path / "ck"), "--wandb-exp-name", f"run-{token}")
    files = [p for p in (tmp_path / "ck").rglob("*") if p.is_file()]
    assert len(files) >= 4
    for p in files:
        data = p.read_bytes()
        assert secret.encode() not in data and token.encode() not in data, p
    meta = json.loads((tmp_path / "ck" / "iter_0000002" / "metadata.json").read_text())
    assert meta["config"]["logging"]["wandb_exp_name"] == F.REDACTED


def _save_then_hang(save_dir: str, ready: str) -> None:
    """Child: iteration 2 saves normally; the save at 4 writes one file and then stalls."""
    import torch

    torch.set_num_threads(1)
    original = F.write_tensors

    def stalling(path: Path, tensors, meta, *pieces) -> int:
        size = original(path, tensors, meta, *pieces)
        if "iter_0000004" in str(path):
            Path(ready).touch()
            time.sleep(120)
        return size

    F.write_tensors = stalling
    run_train(single_process_state(), [*SHORT, "--train-iters", "4", "--save-interval", "2",
                                       "--save", save_dir])


def test_sigkill_during_save_keeps_previous(tmp_path) -> None:
    save, ready = tmp_path / "ck", tmp_path / "ready"
    proc = mp.get_context("spawn").Process(target=_save_then_hang, args=(str(save), str(ready)))
    proc.start()
    deadline = time.monotonic() + 120
    while not ready.exists() and time.monotonic() < deadline and proc.is_alive():
        time.sleep(0.05)
    assert ready.exists(), "the child never reached the second save"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert (save / "iter_0000004.tmp").is_dir() and not (save / "iter_0000004").exists()
    assert (save / "latest").read_text().strip() == "iter_0000002"
    resumed = _train("--train-iters", "4", "--save", str(save))
    assert len(resumed) == 2  # iterations 3 and 4, from the checkpoint at 2
    assert not (save / "iter_0000004.tmp").exists()
    assert (save / "latest").read_text().strip() == "iter_0000004"


def test_async_save_equals_sync_and_keep_last(tmp_path) -> None:
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    log = tmp_path / "metrics.jsonl"
    a = _train("--train-iters", "6", "--save-interval", "2", "--save", str(sync),
               "--log-jsonl", str(log))
    b = _train("--train-iters", "6", "--save-interval", "2", "--save", str(asyn),
               "--async-save", "--save-keep-last", "2")
    assert a == b
    assert F.list_iterations(sync) == [2, 4, 6]
    assert F.list_iterations(asyn) == [4, 6]
    saves = [r for r in map(json.loads, log.read_text().splitlines()) if "checkpoint_save_s" in r]
    assert [r["iteration"] for r in saves] == [2, 4, 6]  # every save reaches the metrics
    for r in saves:
        files = json.loads((sync / F.iter_dir_name(r["iteration"]) / "metadata.json")
                           .read_text())["files"]
        assert r["checkpoint_gbytes"] == sum(files.values()) / 1e9 and r["checkpoint_save_s"] > 0
    for name in json.loads((sync / "iter_0000004" / "metadata.json").read_text())["files"]:
        ta = load_file(sync / "iter_0000004" / name)
        tb = load_file(asyn / "iter_0000004" / name)
        assert all(ta[k].equal(tb[k]) for k in ta), name


def test_config_rejects_bad_values() -> None:
    from megatron_lite.config import CheckpointConfig, ConfigError

    with pytest.raises(ConfigError, match="--save-keep-last must be >= 1"):
        CheckpointConfig(save="x", save_keep_last=0)
    with pytest.raises(ConfigError, match="--async-save needs --save"):
        CheckpointConfig(async_save=True)
