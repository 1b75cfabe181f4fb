"""The rank dry run runs the whole iteration, not only `train_step`: the guard's checks and
decision, the log line's reductions, an evaluation, the checkpoint save path, the start-up
report and epoch plan, and document masks when asked. Each planted GPU-only bug below went
unnoticed when those parts did not run; now the dry run fails and names the op and the site.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import pretrain
from megatron_lite.arguments import parse_config
from megatron_lite.dry_run import PHASES, run_rank
from megatron_lite.layers import attention
from megatron_lite.model import llama
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel.audit import DeviceDisciplineError
from megatron_lite.reliability.guard import Guard

TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "32", "--vocab-size", "250",
        "--micro-batch-size", "1"]
TP2_PP2_CP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--context-parallel-size", "2", "--global-batch-size", "4"]
EVERYTHING = ["--reset-attention-mask", "--reset-position-ids", "--log-num-zeros-in-grad",
              "--log-params-norm", "--eval-interval", "1", "--save-interval", "1"]
WORLD = 8


def _cfg(tmp_path: Path, *extra: str):
    return parse_config([*TINY, *TP2_PP2_CP2, *EVERYTHING, "--save", str(tmp_path / "save"),
                         "--dry-run", *extra])


@pytest.mark.quick
def test_every_phase_runs_on_every_rank_and_the_ops_match(tmp_path, capsys) -> None:
    """The issue's must-show: TP2 x PP2 x CP2 with documents, both logging reductions, an
    evaluation and a save at every iteration; all 8 ranks match and each lists every phase."""
    jsonl = tmp_path / "dry.jsonl"
    argv = [*TINY, *TP2_PP2_CP2, *EVERYTHING, "--save", str(tmp_path / "save"), "--dry-run",
            "--world-size", str(WORLD), "--dry-run-ranks", "all", "--log-jsonl", str(jsonl)]
    assert pretrain.main(argv) == 0
    out = capsys.readouterr().out
    assert "collectives matched" in out
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["rank"] for r in records] == list(range(WORLD))
    for r in records:
        assert set(r["phases"]) == set(PHASES), r["rank"]
        assert r["phases"].index("train_step") < r["phases"].index("checkpoint")
    # the save path ran (rank 0 printed the commit) but wrote nothing where --save points
    assert "checkpoint: saved iteration 1 to" in out
    assert not (tmp_path / "save").exists()


def test_without_documents_or_save_the_phases_say_so(tmp_path) -> None:
    """`phases` lists what ran, not what could: no document flags, no `documents`; the save
    path runs without --save (into a scratch directory) and the state assembly copies
    nothing on the device."""
    cfg = parse_config([*TINY, "--dry-run", "--global-batch-size", "2", "--eval-iters", "0"])
    res = run_rank(cfg, 2, 1)
    assert res.phases == ["startup", "epoch_plan", "train_step", "log", "guard", "checkpoint"]
    assert res.save_growth_bytes == 0 and res.activation_bytes > 0


def test_documents_moved_to_the_host_fail_the_dry_run(tmp_path, monkeypatch) -> None:
    """`.cpu()` on the document ids with --reset-attention-mask (a device-to-host sync per
    layer on a GPU): the dry run refuses the read-back and names the line that does it."""
    real = attention.attention

    def host_documents(q, k, v, *, token_index, documents=None, ring=None, plan=None):
        if documents is not None:
            documents = documents.cpu()
        return real(q, k, v, token_index=token_index, documents=documents, ring=ring,
                    plan=plan)

    monkeypatch.setattr(llama, "attention", host_documents)
    with pytest.raises(DeviceDisciplineError) as err:
        run_rank(_cfg(tmp_path), WORLD, 0)
    text = str(err.value)
    assert "aten._to_copy" in text and "reads a meta tensor back to the host" in text
    assert "tests/test_dry_run_phases.py" in text and "(host_documents)" in text


def _on_host_in(monkeypatch, cls: type, method: str) -> None:
    """Plant the bug: `cls.method` makes its tensors on the host (its pstate says cpu)."""
    real = getattr(cls, method)

    def planted(self, *args):
        pstate = self.pstate
        self.pstate = dataclasses.replace(pstate, device=torch.device("cpu"))
        try:
            return real(self, *args)
        finally:
            self.pstate = pstate

    monkeypatch.setattr(cls, method, planted)


def test_a_host_tensor_in_the_guards_all_reduce_fails_the_dry_run(tmp_path, monkeypatch
                                                                    ) -> None:
    """The guard's per-step flags created on the host: NCCL has no backend for them."""
    _on_host_in(monkeypatch, Guard, "decide")
    with pytest.raises(DeviceDisciplineError) as err:
        run_rank(_cfg(tmp_path), WORLD, 3)
    text = str(err.value)
    assert text.startswith("all_reduce over ranks [0, 1, 2, 3, 4, 5, 6, 7]")
    assert "is on cpu" in text and "reliability/guard.py" in text and "(decide)" in text


def test_a_host_tensor_in_the_zero_gradient_count_fails_the_dry_run(tmp_path, monkeypatch
                                                                     ) -> None:
    """--log-num-zeros-in-grad counting into a host scalar: its first in-place add of a
    device count is refused (on a GPU a device mismatch), before its all-reduce would be."""
    _on_host_in(monkeypatch, Optimizer, "num_zeros_in_grad")
    with pytest.raises(DeviceDisciplineError) as err:
        run_rank(_cfg(tmp_path), WORLD, 5)
    text = str(err.value)
    assert text.startswith("aten.add_") and "a host tensor meets this run's meta" in text
    assert "optim/optimizer.py" in text and "(num_zeros_in_grad)" in text


def test_a_value_read_back_on_meta_is_named(tmp_path, monkeypatch) -> None:
    """Whatever reads a device value back without a dry-run path (here the params norm via
    `.item()`) fails naming the read and its site, instead of torch's bare meta error."""
    def item_norm(self):
        return torch.zeros((), device=self.pstate.device).item()

    monkeypatch.setattr(Optimizer, "params_norm", item_norm)
    with pytest.raises(DeviceDisciplineError) as err:
        run_rank(_cfg(tmp_path), WORLD, 0)
    text = str(err.value)
    assert "reads a meta tensor back to the host" in text
    assert "tests/test_dry_run_phases.py" in text and "(item_norm)" in text

