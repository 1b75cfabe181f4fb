"""scripts/gpu_multirank.py proves something or fails: nothing is skipped, a failed layout or
probed op makes the exit status non-zero, and the table names every requested layout."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_multirank", ROOT / "scripts" /
                                               "gpu_multirank.py")
multirank = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(multirank)  # type: ignore[union-attr]

OK = {"status": "ok", "reason": "5/5 losses vs one process"}


def test_bf16_layouts_include_the_ring_and_run_by_default_on_cuda_only() -> None:
    assert "--bf16" in multirank.LAYOUTS["cp2_bf16"]
    assert "--context-parallel-size" in multirank.LAYOUTS["cp2_bf16"]  # the ring on CUDA
    assert multirank.dtype_of("cp2_bf16") == "bf16" and multirank.dtype_of("cp2") == "fp32"
    assert {"cp2_bf16", "tp2_sp_bf16"} <= set(multirank.DEFAULT_LAYOUTS["cuda"])
    assert not any(n.endswith("_bf16") for n in multirank.DEFAULT_LAYOUTS["cpu"])


def test_every_layout_runs_over_the_host_staged_backend() -> None:
    """No layout depends on what gloo can do with CUDA tensors: all of them, PP and the CP
    ring's send/recv included, go through staged-gloo on both devices."""
    launch = multirank.Launcher(argparse.Namespace(out=Path("."), device="cuda", iters=2),
                                multirank.staged.NAME)
    for name in multirank.LAYOUTS:
        cmd = launch.command(name)
        assert cmd[cmd.index("--distributed-backend") + 1] == "staged-gloo"


BROKEN = {"send_recv": {"status": "error", "detail": "rank 1: RuntimeError: no p2p"}}


@pytest.mark.parametrize("runs,ops,refused,device,code", [
    ({"pp2": OK, "cp2": OK}, {}, True, "cuda", 0),
    ({"pp2": OK, "cp2": {"status": "failed", "reason": "x"}}, {}, True, "cuda", 1),
    ({"pp2": OK}, BROKEN, True, "cuda", 1),  # a probed op failed: named, never skipped
    ({"pp2": OK}, {}, False, "cuda", 1),  # a CUDA run took a host tensor: it would not catch one
    ({"pp2": OK}, {}, False, "cpu", 0),  # on the CPU host tensors are the device's
    ({}, {}, True, "cuda", 1),  # nothing ran: nothing proven
])
def test_exit_code(runs: dict, ops: dict, refused: bool, device: str, code: int) -> None:
    assert multirank.exit_code(runs, ops, device, refused) == code


def test_one_table_of_ran_and_failed_layouts() -> None:
    runs = {"tp2_sp": OK,
            "zero3": {"status": "failed", "reason": "exit 1 (see multirank_zero3.log)"}}
    result = {"backend": "staged-gloo", "device": "cuda", "iters": 5, "flags": ["--x"],
              "probe": {"all_reduce": {"status": "ok", "detail": ""}},
              "host_tensor_refused": True, "runs": runs}
    text = "\n".join(multirank.report_lines(result))
    print(text)
    assert "staged through host memory over gloo, compute on the cuda" in text
    assert "  tp2_sp: ok: 5/5 losses vs one process" in text
    assert "  zero3: failed: exit 1 (see multirank_zero3.log)" in text
    assert text.endswith("2 layouts: 1 ran ok, 1 failed: FAILED")
    assert multirank.table_lines({})[-1].endswith("FAILED")


def test_bf16_tolerance_is_wider_than_fp32() -> None:
    losses, single = [2.0, 1.5], [2.0, 1.5 * (1 + 5e-3)]
    assert not multirank.compare(losses, single, 2)[0]
    ok, text = multirank.compare(losses, single, 2, multirank.BF16_TOLERANCE)
    assert ok and "tolerance 0.02" in text


def test_unknown_layout_is_a_usage_error(tmp_path) -> None:
    with pytest.raises(SystemExit) as err:
        multirank._main(["--out", str(tmp_path), "--layouts", "tp3"])
    assert err.value.code == 2
