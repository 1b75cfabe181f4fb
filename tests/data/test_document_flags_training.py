"""--reset-attention-mask / --reset-position-ids through pretrain's path on real shards (EOD
from the manifest): the flags change the loss, and CP=2 with them equals one process. All runs
are float64 (--fp64), so "equals" is EXACT (1e-10 relative): only summation order differs."""

from __future__ import annotations

from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.training import train
from tests.data.test_training_data import _cfg, _corpus
from tests.distributed import run_ranks
from tests.numerics import EXACT, assert_close


def _losses(pstate: ParallelState, data_path: str, documents: bool, cp: int = 1) -> list[float]:
    cfg = _cfg(data_path)
    cfg.train.fp64 = True
    cfg.parallel.context_parallel_size = cp
    cfg.data.reset_attention_mask = cfg.data.reset_position_ids = documents
    cfg.train.eval_iters = 0
    return train(cfg, pstate).losses


def test_document_flags_change_the_loss_and_compose_with_cp(tmp_path) -> None:
    data = _corpus(tmp_path / "c", 2)
    plain = _losses(single_process_state(), data, documents=False)
    masked = _losses(single_process_state(), data, documents=True)
    assert all(abs(a - b) > 1e-4 for a, b in zip(plain, masked, strict=True)), (plain, masked)
    cfg = _cfg(data)
    cfg.parallel.context_parallel_size = 2
    cfg.train.fp64 = True
    for rank, rank_losses in enumerate(run_ranks(_losses, 2, tmp_path, cfg=cfg, data_path=data,
                                                 documents=True, cp=2)):
        err = assert_close(rank_losses, masked, EXACT, f"CP2 rank {rank} losses vs one process")
        print(f"CP2 rank {rank} vs one process, document masks: losses relative error {err:.1e}")
