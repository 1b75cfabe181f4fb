"""scripts/gpu_multirank.py proves something or fails: a skipped layout makes the exit status
non-zero, and the table names every requested layout with its status and reason."""

from __future__ import annotations

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


def test_a_probe_failure_skips_the_layouts_that_need_the_op() -> None:
    ops = {"send_recv": {"status": "error", "detail": "rank 1: RuntimeError: no p2p"}}
    reason = multirank.skip_reason("cp2_bf16", ops, "cuda")
    assert reason == ("gloo cannot run send_recv on cuda tensors here: error "
                      "(rank 1: RuntimeError: no p2p)")
    assert multirank.skip_reason("tp2_sp", ops, "cuda") is None


@pytest.mark.parametrize("runs,refused,device,code", [
    ({"pp2": OK, "cp2": OK}, True, "cuda", 0),
    ({"pp2": OK, "cp2": {"status": "skipped", "reason": "x"}}, True, "cuda", 3),
    ({"pp2": {"status": "failed", "reason": "x"}, "cp2": {"status": "skipped", "reason": "x"}},
     True, "cuda", 1),
    ({"pp2": OK}, False, "cuda", 1),  # cuda:gloo took a host tensor: it would not catch one
    ({"pp2": OK}, False, "cpu", 0),  # plain gloo takes host tensors by design
    ({}, True, "cuda", 3),  # nothing ran: nothing proven
])
def test_exit_code(runs: dict, refused: bool, device: str, code: int) -> None:
    assert multirank.exit_code(runs, device, refused) == code


def test_one_table_of_ran_failed_and_skipped_layouts() -> None:
    runs = {"tp2_sp": OK,
            "zero3": {"status": "failed", "reason": "exit 1 (see multirank_zero3.log)"},
            "cp2_bf16": {"status": "skipped", "reason": "gloo cannot run send_recv"}}
    result = {"backend": "cuda:gloo", "device": "cuda", "iters": 5, "flags": ["--x"],
              "probe": {"all_reduce": {"status": "ok", "detail": ""}},
              "host_tensor_refused": True, "runs": runs}
    text = "\n".join(multirank.report_lines(result))
    print(text)
    assert "  tp2_sp: ok: 5/5 losses vs one process" in text
    assert "  zero3: failed: exit 1 (see multirank_zero3.log)" in text
    assert "  cp2_bf16: skipped: gloo cannot run send_recv" in text
    assert text.endswith("3 layouts: 1 ran ok, 1 failed, 1 skipped: FAILED")
    skipped_only = multirank.table_lines({"tp2_sp": OK, "cp2_bf16": runs["cp2_bf16"]})
    assert skipped_only[-1].endswith("INCOMPLETE: a skipped layout proves nothing")


def test_bf16_tolerance_is_wider_than_fp32() -> None:
    losses, single = [2.0, 1.5], [2.0, 1.5 * (1 + 5e-3)]
    assert not multirank.compare(losses, single, 2)[0]
    ok, text = multirank.compare(losses, single, 2, multirank.BF16_TOLERANCE)
    assert ok and "tolerance 0.02" in text


def test_unknown_layout_is_a_usage_error(tmp_path) -> None:
    with pytest.raises(SystemExit) as err:
        multirank._main(["--out", str(tmp_path), "--layouts", "tp3"])
    assert err.value.code == 2
