"""The planner with context parallelism: activations divide by cp, the ring's K/V traffic is
charged beyond the attention it hides behind, and the search offers CP for long sequences only."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_lite.config import Config, ParallelConfig, TrainConfig
from megatron_lite.planner import (
    PRESETS,
    Cluster,
    Layout,
    Recompute,
    _stage_time,
    estimate_memory,
    layouts,
    pretrain_flags,
    search,
)

MODEL_8B = PRESETS["8B"][1]


def _cfg(cp: int, seq: int = 32768) -> Config:
    return Config(model=dataclasses.replace(MODEL_8B, seq_length=seq,
                                            max_position_embeddings=seq),
                  parallel=ParallelConfig(tensor_model_parallel_size=4, context_parallel_size=cp,
                                          sequence_parallel=True,
                                          use_distributed_optimizer=True),
                  train=TrainConfig(micro_batch_size=1, global_batch_size=16, bf16=True))


@pytest.mark.quick
def test_activations_divide_by_cp_and_zero1_shards_over_dp_x_cp() -> None:
    one = estimate_memory(_cfg(1), 64)
    for cp in (2, 4, 8):
        est = estimate_memory(_cfg(cp), 64)
        assert est.activation_bytes_per_microbatch == pytest.approx(
            one.activation_bytes_per_microbatch / cp, rel=1e-6)
        assert est.optimizer_bytes == pytest.approx(one.optimizer_bytes, rel=1e-3)  # dp x cp = 16


def test_ring_traffic_is_charged_only_beyond_the_attention() -> None:
    model = dataclasses.replace(MODEL_8B, seq_length=131072, max_position_embeddings=131072)
    lay = Layout(2, 1, 4, 1, 1, True, Recompute(), True, None, 8)
    fast = Cluster(gpus=64)
    slow = dataclasses.replace(fast, intra_node_gbps=1.0, inter_node_gbps=1.0)
    assert _stage_time(model, lay, fast, 32, 0)[2] == 0.0  # hidden behind attention
    assert _stage_time(model, lay, slow, 32, 0)[2] > 0.0
    no_cp = dataclasses.replace(lay, cp=1, dp=32)
    assert _stage_time(model, no_cp, fast, 32, 0)[0] == pytest.approx(
        8 * _stage_time(model, lay, fast, 32, 0)[0])


def test_cp_offered_for_long_sequences_only() -> None:
    assert all(lay.cp == 1 for lay in layouts(MODEL_8B, Cluster(gpus=64), 512))
    long = dataclasses.replace(MODEL_8B, seq_length=131072, max_position_embeddings=131072)
    assert {lay.cp for lay in layouts(long, Cluster(gpus=64), 32)} == {1, 2, 4, 8, 16}
    best = search(long, Cluster(gpus=64), 32, 1e11)[0]
    assert best.fits and best.layout.cp > 1
    flags = pretrain_flags(long, best, 32)
    assert flags[flags.index("--context-parallel-size") + 1] == str(best.layout.cp)
