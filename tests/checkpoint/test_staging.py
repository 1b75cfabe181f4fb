"""Saving copies live tensors straight into reused host buffers, never into device copies.

Single process, in-process: a Checkpointer built by hand around the tiny model, so the test
can step, save, step and save again and look at the buffers in between.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_lite.arguments import parse_config
from megatron_lite.checkpoint import files as F
from megatron_lite.checkpoint.checkpointer import Checkpointer, HostStaging
from megatron_lite.checkpoint.reshard import (
    KINDS,
    fill_optimizer_state,
    is_tied_copy,
    model_parameters,
)
from megatron_lite.data.builder import build_data_loaders
from megatron_lite.export import single_process_state
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.training import StepRunner, build_model, train_step
from tests.checkpoint.common import FLAGS


def run_with_checkpointer(save: Path, *flags: str) -> tuple:
    """One process's model, optimizer, loader, checkpointer and step runner for `flags`."""
    cfg = parse_config([*FLAGS, "--num-layers", "2", "--save", str(save), *flags])
    ps = single_process_state()
    torch.manual_seed(cfg.train.seed)
    chunks = build_model(cfg, ps)
    opt = Optimizer(cfg, chunks, ps)
    loader, _ = build_data_loaders(cfg, ps.dp_rank, ps.dp_size)
    ckpt = Checkpointer(cfg, ps, chunks, opt, loader)
    runner = StepRunner(cfg, ps, chunks)
    return ps, chunks, opt, loader, ckpt, runner


def _expected(chunks: list, opt: Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """What the model and optimizer files must hold right now (copies of the live state)."""
    weights = {name: p.detach().clone() for name, local, p in model_parameters(chunks, True)
               if not is_tied_copy(local, True)}
    optim = {f"tensors.{k}": v.clone() for k, v in opt.state_dict()["tensors"].items()}
    return {F.model_file(0, 0): weights, F.optim_file(0, 0, 0): optim}


@pytest.mark.parametrize("async_save", [False, True])
def test_consecutive_saves_reuse_host_buffers(tmp_path, async_save: bool) -> None:
    flags = ["--async-save"] if async_save else []
    ps, chunks, opt, loader, ckpt, runner = run_with_checkpointer(tmp_path / "ck", *flags)
    expected, pointers = {}, []
    for iteration in (1, 2):
        train_step(runner, opt, loader, ps, lr=2e-3)
        expected[iteration] = _expected(chunks, opt)
        ckpt.save(iteration)
        held = ckpt.staging.buffers if async_save else {"staging": ckpt.staging.buffer}
        pointers.append({k: v.data_ptr() for k, v in held.items()})
    ckpt.wait()
    opt.close()
    # --async-save: one host copy per saved tensor; a plain save streams through the one
    # staging buffer and keeps no copies. The same memory both times, never the live tensors.
    assert pointers[0] == pointers[1]
    assert len(pointers[0]) == (sum(len(t) for t in expected[1].values()) if async_save else 1)
    assert async_save or not ckpt.staging.buffers
    live = {t.data_ptr() for t in opt.state_dict()["tensors"].values()}
    live |= {p.data_ptr() for c in chunks for p in c.parameters()}
    assert not live & set(pointers[0].values())
    # Each checkpoint holds the state of its own iteration, although the buffers were reused.
    assert not torch.equal(expected[1][F.optim_file(0, 0, 0)]["tensors.0.exp_avg"],
                           expected[2][F.optim_file(0, 0, 0)]["tensors.0.exp_avg"])
    for iteration, files in expected.items():
        for name, tensors in files.items():
            saved = load_file(tmp_path / "ck" / F.iter_dir_name(iteration) / name)
            assert sorted(saved) == sorted(tensors), name
            for key, value in tensors.items():
                assert torch.equal(saved[key], value), (iteration, name, key)


def test_optimizer_state_dict_is_the_live_state() -> None:
    cfg = parse_config([*FLAGS, "--num-layers", "2"])
    ps = single_process_state()
    opt = Optimizer(cfg, build_model(cfg, ps), ps)
    tensors = opt.state_dict()["tensors"]
    for i, shard in enumerate(opt.shards):
        for kind in KINDS:
            t, live = tensors[f"{i}.{kind}"], getattr(shard, kind)
            assert t.untyped_storage().data_ptr() == live.untyped_storage().data_ptr()
            assert t.data_ptr() == live.data_ptr() and t.shape == live.shape
    opt.close()


def test_filling_a_state_leaves_the_live_template_alone() -> None:
    """Resharding builds a new host state; the template's tensors are the live buffers."""
    cfg = parse_config([*FLAGS, "--num-layers", "2"])
    ps = single_process_state()
    chunks = build_model(cfg, ps)
    opt = Optimizer(cfg, chunks, ps)
    template = opt.state_dict()
    before = {k: v.clone() for k, v in template["tensors"].items()}

    def ones(name: str) -> dict[str, torch.Tensor]:
        shape = {n: p.shape for n, _, p in model_parameters(chunks, True)}[name]
        return {k: torch.ones(shape) for k in KINDS}

    state = fill_optimizer_state(template, chunks, ps, True, ones)
    for k, v in template["tensors"].items():
        assert torch.equal(v, before[k]) and v is getattr(opt.shards[0], k.split(".")[1])
        assert state["tensors"][k].data_ptr() != v.data_ptr()
    opt.load_state_dict(state)
    assert torch.equal(opt.shards[0].exp_avg, state["tensors"]["0.exp_avg"])
    opt.close()


def test_meta_tensors_pass_through_staging() -> None:
    staging = HostStaging()
    meta, cpu = torch.empty(3, 4, device="meta"), torch.arange(5.0)
    out = staging.stage("f", {"meta": meta, "cpu": cpu})
    staging.finish()
    assert out["meta"] is meta
    assert list(staging.buffers) == [("f", "cpu")]
    assert torch.equal(out["cpu"], cpu) and out["cpu"].data_ptr() != cpu.data_ptr()
    # A changed shape gets a new buffer; the same shape reuses the old one.
    again = staging.stage("f", {"cpu": cpu + 1})["cpu"]
    assert again.data_ptr() == out["cpu"].data_ptr() and torch.equal(again, cpu + 1)
    assert staging.stage("f", {"cpu": torch.zeros(2)})["cpu"].shape == (2,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_stage_through_a_pinned_buffer() -> None:
    """The copy is pageable host memory; only the bounded staging buffer is pinned."""
    staging = HostStaging(limit_bytes=1000)
    src = torch.randn(1000, device="cuda")
    out = staging.stage("f", {"x": src})["x"]
    staging.finish()
    assert out.device.type == "cpu" and not out.is_pinned()
    assert staging.buffer is not None and staging.buffer.is_pinned()
    assert staging.buffer.numel() == 1000
    assert torch.equal(out, src.cpu())
