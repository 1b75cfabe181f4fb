"""bench/kernels.py runs on a GPU only, so its steps are exercised here on CPU at tiny sizes
(Triton under the interpreter): every step of every kernel runs forward and backward, and the
script itself exits 0 with a clear message when there is no GPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TINY = {"hidden": 48, "heads": 4, "kv_heads": 2, "head_dim": 12, "ffn": 40, "vocab": 67}


def _bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "bench/kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernels load compiled; "
                    "run bench/kernels.py itself there")
@pytest.mark.quick
def test_every_benchmark_step_runs_forward_and_backward():
    bench = _bench()
    specs, ce_elements = bench.cases(6, torch.float32, "cpu", TINY)
    assert [name for name, _, _ in specs] == ["rmsnorm+residual", "rope", "swiglu",
                                              "cross_entropy"]
    assert ce_elements == 6 * TINY["vocab"]
    for _name, nbytes, make in specs:
        assert nbytes > 0
        for impl in ("triton", "eager"):
            step = make(impl)
            step()
            step()  # twice: the in-place cross-entropy step must survive reusing its buffer


def test_sink_passes_values_and_drops_gradients():
    bench = _bench()
    x = torch.randn(3, requires_grad=True)
    y = bench._Sink.apply(x)
    assert torch.equal(y, x) and y.grad_fn is not None
    (y * 2).sum().backward()
    assert x.grad is None


def test_without_cuda_it_says_so_and_exits_0():
    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, "bench/kernels.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "needs a CUDA GPU" in proc.stdout
