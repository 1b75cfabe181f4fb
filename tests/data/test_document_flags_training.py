"""--reset-attention-mask / --reset-position-ids through pretrain's path on real shards (EOD
from the manifest): the flags change the loss, and CP=2 with them equals one process."""

from __future__ import annotations

from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.training import train
from tests.data.test_training_data import _cfg, _corpus
from tests.distributed import run_ranks


def _losses(pstate: ParallelState, data_path: str, documents: bool, cp: int = 1) -> list[float]:
    cfg = _cfg(data_path)
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
    for rank_losses in run_ranks(_losses, 2, tmp_path, cfg=cfg, data_path=data, documents=True,
                                 cp=2):
        assert all(abs(a - b) <= 1e-5 for a, b in zip(rank_losses, masked, strict=True)), \
            (rank_losses, masked)
