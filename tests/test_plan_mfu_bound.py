"""The planner's headline MFU counts causal attention over the time its model charges, so no
layout's MFU (or HFU) beats the largest efficiency the time model allows, however long the
sequence; the non-causal count (the log's `mfu`) does at 128K tokens and more."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_lite import plan_time
from megatron_lite.planner import (
    PRESETS,
    Cluster,
    Recompute,
    efficiency_bound,
    evaluate,
    layouts,
)


@pytest.mark.parametrize("seq", [131072, 1048576])
def test_no_layout_beats_the_efficiency_the_model_allows(seq: int) -> None:
    model = dataclasses.replace(PRESETS["8B"][1], seq_length=seq, max_position_embeddings=seq)
    h100 = plan_time.PRESETS["h100-sxm"]
    # the GEMM curve alone, and with a measured attention kernel faster than the GEMMs' e_max
    for c in (Cluster.from_hardware(16, h100),
              Cluster.from_hardware(16, h100, attention_tflops=0.7 * h100.peak_tflops)):
        bound = efficiency_bound(c)
        assert bound == max(h100.gemm_efficiency, c.attention_tflops / c.peak_tflops)
        above = 0
        for lay in layouts(model, c, 16):
            for rc in (Recompute(), Recompute("full")):
                plan = evaluate(model, dataclasses.replace(lay, recompute=rc), c, 16, 1e9)
                assert 0 < plan.mfu <= plan.hfu <= bound, (lay, rc, plan.mfu, plan.hfu)
                assert plan.mfu < plan.mfu_noncausal
                above += plan.mfu_noncausal > bound
        assert above  # counted non-causally, long sequences "beat" the hardware
