"""Training on real shards through pretrain's path: single process, and DP=2 node-local with
uneven shards (every rank must make the same number of steps, so nothing hangs)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_lite.config import Config, ModelConfig, ParallelConfig
from megatron_lite.data.format import ShardWriter, shard_name, write_manifest
from megatron_lite.training import train
from tests.distributed import run_ranks


def _corpus(prefix, shards, vocab=128):
    rng = np.random.default_rng(0)
    entries = []
    for s in range(shards):
        w = ShardWriter(shard_name(prefix, s), np.uint16)
        for _ in range(30 + 20 * s):  # uneven shard sizes
            doc = np.append(rng.integers(3, 20, size=int(rng.integers(5, 40))), 2)
            w.add_documents(doc, np.array([len(doc)]))
        entries.append(w.finalize())
    write_manifest(f"{prefix}.manifest.json", {
        "shards": entries, "total_documents": sum(e["documents"] for e in entries),
        "total_tokens": sum(e["tokens"] for e in entries),
        "tokenizer": {"vocab_size": vocab, "eod_id": 2}})
    return str(prefix)


def _cfg(data_path, sharding="global"):
    cfg = Config(model=ModelConfig(seq_length=16, vocab_size=128),
                 parallel=ParallelConfig(distributed_backend="gloo"))
    cfg.data.data_path, cfg.data.split, cfg.data.data_sharding = [data_path], "90,10,0", sharding
    cfg.data.eod_mask_loss = True
    cfg.train.train_iters, cfg.train.eval_iters, cfg.train.eval_interval = 4, 2, 2
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 2, 8
    return cfg


def _train(pstate, data_path, sharding):
    result = train(_cfg(data_path, sharding), pstate)
    return result.losses, result.eval_losses


@pytest.mark.quick
def test_single_process(tmp_path):
    from megatron_lite.parallel import state as parallel_state
    from megatron_lite.parallel.launch import LaunchEnv

    cfg = _cfg(_corpus(tmp_path / "c", 2))
    env = LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1,
                    master_addr="127.0.0.1", master_port=0, source="test", node_rank=0,
                    num_nodes=1)
    pstate = parallel_state.initialize(cfg, env=env)
    try:
        result = train(cfg, pstate)
    finally:
        parallel_state.destroy(pstate)
    assert len(result.losses) == 4 and all(math.isfinite(x) for x in result.losses)
    assert len(result.eval_losses) == 2


def test_dp2_node_local_uneven_shards(tmp_path):
    prefix = _corpus(tmp_path / "c", 3)  # rank 0 reads shards 0 and 2, rank 1 shard 1
    out = run_ranks(_train, 2, tmp_path, data_path=prefix, sharding="node-local")
    (l0, e0), (l1, e1) = out
    assert len(l0) == len(l1) == 4 and len(e0) == len(e1) == 2
    assert all(math.isfinite(x) for x in l0 + l1)
