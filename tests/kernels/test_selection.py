"""--triton-kernels resolution, and that importing megatron_lite does not import triton."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_lite.kernels import KERNEL_NAMES, resolve_use_triton


@pytest.mark.quick
def test_auto_follows_the_device():
    assert resolve_use_triton("auto", torch.device("cpu")) is False
    assert resolve_use_triton("auto", torch.device("cuda", 0)) is True
    assert resolve_use_triton("off", torch.device("cuda", 0)) is False


def test_on_with_cpu_selects_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert resolve_use_triton("on", torch.device("cpu")) is True
    assert os.environ["TRITON_INTERPRET"] == "1"


def test_unknown_mode_names_the_flag():
    with pytest.raises(ValueError, match="--triton-kernels"):
        resolve_use_triton("yes", torch.device("cpu"))


def test_kernel_names_are_listed():
    assert {"rmsnorm", "rope", "swiglu", "vocab_parallel_cross_entropy"} <= set(KERNEL_NAMES)


def test_import_and_reference_paths_do_not_load_triton():
    code = ("import sys, torch, megatron_lite.kernels as k\n"
            "k.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-5)\n"
            "k.swiglu(torch.ones(3), torch.ones(3))\n"
            "assert 'triton' not in sys.modules, 'triton was imported'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
