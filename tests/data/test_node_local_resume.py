"""Node-local data resumed at another DP size (after losing nodes).

DP 4 -> 2: each new rank continues two old ranks' sample streams, so every global batch holds
the same samples as in the uninterrupted DP-4 run and the losses agree; at the streams' own
size they are the ranks' own datasets again. The training runs are float64 (--fp64), so "the
losses agree" is EXACT (1e-10): only the summation order differs between DP 4 and DP 2.
DP 1 -> 2 or 2 -> 4 (the new size does not divide the old): the shards are re-assigned and the
start-up says that the data order changes."""

from __future__ import annotations

import contextlib
import io
from collections import Counter

import numpy as np
import pytest

from megatron_lite.config import CheckpointConfig, Config, ModelConfig, ParallelConfig
from megatron_lite.data.loader import MicroBatchLoader
from megatron_lite.training import train
from tests.data.test_training_data import _corpus
from tests.distributed import run_ranks
from tests.numerics import EXACT, assert_close

GBS, MB, ITERS = 8, 2, 8


class _Stream:
    """Old DP rank q's dataset: item i is a sample of 9 tokens all equal to q * 1000 + i."""

    def __init__(self, q: int) -> None:
        self.q = q

    def __len__(self) -> int:
        return 500

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(9, self.q * 1000 + i, dtype=np.int64)


def _step_samples(loaders: list[MicroBatchLoader]) -> Counter:
    """The multiset of samples (their first token) of one global step over all ranks."""
    seen: Counter = Counter()
    for loader in loaders:
        for batch in loader.next_step():
            seen.update(batch["tokens"][:, 0].tolist())
    return seen


@pytest.mark.parametrize(("old", "new"), [(4, 2), (4, 1), (8, 2), (4, 4)])
def test_taken_over_streams_give_the_same_global_batches(old: int, new: int) -> None:
    consumed = 3 * GBS * old // 4  # a few steps in (a multiple of the global batch)
    before = [MicroBatchLoader(_Stream(q), micro_batch_size=MB, global_batch_size=GBS * old // 4,
                               dp_rank=q, dp_size=old, consumed_samples=consumed,
                               node_local=True) for q in range(old)]
    after = []
    for r in range(new):
        own = _Stream(r if old == new else 100 + r)  # unused when streams are taken over
        loader = MicroBatchLoader(own, micro_batch_size=MB,
                                  global_batch_size=GBS * old // 4, dp_rank=r, dp_size=new,
                                  node_local=True, stream_factory=lambda q, s: _Stream(q))
        loader.load_state_dict({"consumed_samples": consumed, "stream_dp": old})
        assert loader.stream_dp == old and len(loader.streams) == old // new
        assert (loader.resume_note is None) == (old == new)
        after.append(loader)
    for _ in range(3):
        assert _step_samples(before) == _step_samples(after)
    assert after[0].state_dict() == {"consumed_samples": consumed + 3 * GBS * old // 4,
                                     "stream_dp": old}


@pytest.mark.quick
def test_growing_dp_reassigns_shards_and_says_so() -> None:
    loader = MicroBatchLoader(_Stream(7), micro_batch_size=MB, global_batch_size=GBS,
                              dp_rank=1, dp_size=4, node_local=True,
                              stream_factory=lambda q, s: _Stream(q))
    loader.load_state_dict({"consumed_samples": 40, "stream_dp": 2})
    assert loader.stream_dp == 4 and [s.q for s in loader.streams] == [7]
    assert "4 does not divide 2" in loader.resume_note
    assert "starts its new sample order at sample 10" in loader.resume_note
    assert _step_samples([loader]) == Counter(range(7010, 7012))


# ---------------------------------------------------------------- through training, on gloo


def _cfg(data: str, tmp: str, save: str, load: str | None = None, step: int | None = None,
         exit_at: int | None = None) -> Config:
    cfg = Config(model=ModelConfig(seq_length=16, vocab_size=128, num_layers=2, hidden_size=32,
                                   num_attention_heads=4),
                 parallel=ParallelConfig(distributed_backend="gloo"),
                 checkpoint=CheckpointConfig(save=f"{tmp}/{save}", load=load and f"{tmp}/{load}",
                                             ckpt_step=step, save_interval=4,
                                             exit_interval=exit_at))
    cfg.data.data_path, cfg.data.split, cfg.data.data_sharding = [data], "100,0,0", "node-local"
    cfg.train.train_iters, cfg.train.eval_iters = ITERS, 0
    cfg.train.micro_batch_size, cfg.train.global_batch_size = MB, GBS
    cfg.train.fp64 = True
    cfg.logging.peak_tflops, cfg.logging.log_interval = 1.0, 1
    return cfg


def _train(pstate, runs: list[dict]) -> list[tuple[list[float], str]]:
    results = []
    for kwargs in runs:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            losses = train(_cfg(**kwargs), pstate).losses
        results.append((losses, out.getvalue()))
    return results


def _single(cfg: Config) -> tuple[list[float], str]:
    from megatron_lite.parallel import state as parallel_state
    from megatron_lite.parallel.launch import LaunchEnv

    env = LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1,
                    master_addr="127.0.0.1", master_port=0, source="test", node_rank=0,
                    num_nodes=1)
    pstate = parallel_state.initialize(cfg, env=env)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            return train(cfg, pstate).losses, out.getvalue()
    finally:
        parallel_state.destroy(pstate)


def _plan_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("data: ") and " planned " in line]


def test_node_local_resume_dp4_to_dp2(tmp_path) -> None:
    data = _corpus(tmp_path / "c", 4)  # shard i -> DP rank i % 4 (i % 2 at DP 2)
    common = {"data": data, "tmp": str(tmp_path)}
    (a, a_out), = run_ranks(_train, 4, tmp_path, runs=[{**common, "save": "a"}])[0]
    _single(_cfg(**common, save="e", exit_at=4))  # a DP-1 run to grow from
    (b, b_out), (f, f_out) = run_ranks(_train, 2, tmp_path, runs=[
        {**common, "save": "b", "load": "a", "step": 4},
        {**common, "save": "f", "load": "e", "step": 4}])[0]
    assert len(a) == ITERS and len(b) == len(f) == ITERS - 4
    print("DP4 losses 5-8:", [round(x, 6) for x in a[4:]])
    print("DP2 from DP4@4:", [round(x, 6) for x in b])
    # the same samples in every global batch: the losses of the uninterrupted run
    err = assert_close(b, a[4:], EXACT, "DP2 losses resumed from DP4 vs the uninterrupted run")
    print(f"DP4->2 resume vs uninterrupted losses: relative error {err:.1e}")
    assert "streams were made for DP 4, this run has DP 2: DP rank r continues the " \
        "streams of the old ranks r, r+2" in b_out
    plan = _plan_lines(a_out)
    print(plan[0])
    # every rank's shards together, and each rank's own repetition of its shards
    assert plan[0].startswith("data: 64 training samples planned (8 steps) over ")
    assert "; node-local: each of the 4 DP ranks reads its own shards, " in plan[0]
    # the same corpus and plan at DP 2
    assert _plan_lines(b_out)[0].split(";")[0] == plan[0].split(";")[0]
    assert "this run has DP 2 (2 does not divide 1): the shards are re-assigned" in f_out
    assert "The data order changes from here" in f_out
    assert all(np.isfinite(f))
