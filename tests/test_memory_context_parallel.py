"""Activation memory under context parallelism: each CP rank saves for backward what one
s/cp-token sequence needs (ring attention keeps only its local q, k, v, out, log-sum-exp),
measured by `memory.measure_saved_bytes` (the start-up memory report's number) within 5% of
`planner.estimate_memory`, and about 1/cp of CP=1's."""

from __future__ import annotations

import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.memory import measure_saved_bytes
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.planner import estimate_memory
from megatron_lite.training import build_model
from tests.distributed import run_ranks

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "256",
         "--vocab-size", "1000", "--make-vocab-size-divisible-by", "64",
         "--micro-batch-size", "2", "--mock-data"]


def _measure(pstate: ParallelState, flags: list[str]) -> tuple[int, float]:
    cfg = parse_config(flags)
    chunks = build_model(cfg, pstate)
    est = estimate_memory(cfg, pstate.world_size, stage=pstate.pp_rank, fused_kernels=False,
                          device_type="cpu")
    return measure_saved_bytes(chunks, cfg, pstate), est.activation_bytes_per_microbatch


def test_activation_bytes_per_cp_rank(tmp_path) -> None:
    base, base_est = _measure(single_process_state(), MODEL)
    assert base_est == pytest.approx(base, rel=0.05)
    for cp in (2, 4):
        flags = [*MODEL, "--context-parallel-size", str(cp)]
        for rank, (saved, est) in enumerate(run_ranks(_measure, cp, tmp_path,
                                                      cfg=parse_config(flags), flags=flags)):
            print(f"cp {cp} rank {rank}: measured {saved} B, planner {est:.0f} B, "
                  f"CP=1 measured {base} B (x{saved / base:.3f})")
            assert est == pytest.approx(saved, rel=0.05), (cp, rank)
            assert saved == pytest.approx(base / cp, rel=0.05), (cp, rank)
