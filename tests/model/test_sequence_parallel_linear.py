"""The sequence-parallel column linear (layers/linear.py) against gather-then-F.linear.

It must give the same output and gradients (float64: within EXACT; bf16: within a measured
floor) while saving only the local [s/t, b, h] shard, keep
doing so under selective and full recompute, and run on meta tensors over a fake group (the
dry run), where no value is ever read.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config import ModelConfig
from megatron_lite.layers.context import LayerContext
from megatron_lite.layers.linear import column_parallel_linear
from megatron_lite.model.llama import LlamaChunk
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState
from tests.conftest import ROOT
from tests.distributed import run_ranks
from tests.numerics import assert_all_close, assert_close, rel_err, within_floor


def _gather_then_linear(x: torch.Tensor, w: torch.Tensor, group: comms.Group) -> torch.Tensor:
    return F.linear(comms.gather_from_sequence_region(x, group, kind="tp"), w)


def _both_paths(pstate: ParallelState, dtype: torch.dtype, paths, source: torch.dtype | None
                = None) -> dict:
    """Output and gradients of `paths` on this rank, plus what each saves for backward. The
    inputs are rounded to `source` (default `dtype`) first, so that a float64 run of bf16
    inputs gives the exact answer for them."""
    g = torch.Generator().manual_seed(pstate.tp_rank)
    source = source or dtype
    # [b, s/t, h] transposed: a non-contiguous sequence-first input, as a permute would give
    x0 = torch.randn(3, 4, 16, generator=g).to(source).to(dtype).transpose(0, 1)
    w0 = torch.randn(10, 16, generator=torch.Generator().manual_seed(9)).to(source).to(dtype)
    grad_out = torch.randn(4 * pstate.tp_size, 3, 10, generator=g).to(source).to(dtype)
    out = {}
    for name, fn in paths:
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        saved: list[int] = []  # elements of each saved tensor (F.linear saves a 2-D view)

        def pack(t: torch.Tensor, saved=saved, w=w) -> torch.Tensor:
            if t.untyped_storage().data_ptr() != w.untyped_storage().data_ptr():
                saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = fn(x, w)
        y.backward(grad_out)
        out[name] = {"y": y.detach(), "dx": x.grad, "dw": w.grad, "saved": saved}
    return out


def _exact(pstate: ParallelState, dtype: torch.dtype) -> dict:
    """Float64 gradients of the gather-then-linear path on this rank: the exact answer the
    bf16 paths are measured against."""
    return _both_paths(pstate, torch.float64, (("old", _gather_then_linear_of(pstate)),),
                       source=dtype)["old"]


def _gather_then_linear_of(pstate: ParallelState):
    return lambda x, w: _gather_then_linear(x, w, pstate.tp_group)


def _column_of(pstate: ParallelState):
    return lambda x, w: column_parallel_linear(x, w, pstate.tp_group, True)


SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=64, seq_length=16, vocab_size=64)
RECOMPUTE = {"none": {}, "selective": dict(recompute_granularity="selective"),
             "full": dict(recompute_granularity="full", recompute_num_layers=1)}


def _recompute_grads(pstate: ParallelState) -> dict:
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    out = {}
    for option, kw in RECOMPUTE.items():
        ctx = LayerContext.from_state(pstate, seed=3, sequence_parallel=True,
                                      dtype=torch.float64, **kw)
        model = LlamaChunk(ModelConfig(**SHAPE), ctx, range(2), pre_process=True,
                           post_process=True)
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        loss.backward()
        out[option] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    return out


def _everything(pstate: ParallelState) -> dict:
    """One 2-rank job for every test of this module."""
    paths = (("new", _column_of(pstate)), ("old", _gather_then_linear_of(pstate)))
    return {"linear": {dtype: _both_paths(pstate, dtype, paths)
                       for dtype in (torch.float64, torch.bfloat16)},
            "exact": _exact(pstate, torch.bfloat16),
            "recompute": _recompute_grads(pstate)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(_everything, 2, tmp_path_factory.mktemp("sp"), tp=2)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float64, marks=pytest.mark.quick),
                                   torch.bfloat16])
def test_matches_gather_then_linear_and_saves_the_shard(ranks: list[dict],
                                                        dtype: torch.dtype) -> None:
    """float64: dx and dw within EXACT. bf16 (the dtype is the point: the weight gradient
    stays in the parameter dtype): each path's error against the float64 answer of the same
    bf16 inputs, the new one within 4x of the old one's (the measured floor)."""
    for rank, out in enumerate(ranks):
        new, old = out["linear"][dtype]["new"], out["linear"][dtype]["old"]
        assert new["saved"] == [4 * 3 * 16], rank  # the local [s/t, b, h] shard only
        assert old["saved"] == [8 * 3 * 16], rank  # autograd's choice: the gathered input
        for key in ("y", "dx", "dw"):
            assert new[key].dtype == dtype, (rank, key)  # weight grad in the parameter dtype
        assert torch.equal(new["y"], old["y"]), rank  # the same F.linear on the same gather
        for key in ("dx", "dw"):
            if dtype == torch.float64:
                assert_close(new[key], old[key], what=f"rank {rank} {key}")
                continue
            exact = out["exact"][key]
            floor = rel_err(old[key], exact)
            print(f"bf16 {key}: new {rel_err(new[key], exact):.2e}, floor {floor:.2e}")
            within_floor(rel_err(new[key], exact), floor, f"rank {rank} bf16 {key}")


def test_tp2_sp_recompute_matches_no_recompute(ranks: list[dict]) -> None:
    """The Function reruns its all-gather when a checkpointed layer is recomputed: float64
    loss and gradients within EXACT of storing everything."""
    for rank, out in enumerate(ranks):
        ref_loss, ref_grads = out["recompute"]["none"]
        for option in ("selective", "full"):
            loss, grads = out["recompute"][option]
            assert_close(loss, ref_loss, what=f"rank {rank} {option} loss")
            assert_all_close(grads, ref_grads, what=f"rank {rank} {option}: ")


def test_runs_on_meta_over_a_fake_group() -> None:
    """The dry run's setting: shapes only, no host reads; in a child so that no process group
    leaks into this one."""
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from megatron_lite.layers.linear import column_parallel_linear
        dist.init_process_group("meta:fake", store=FakeStore(), rank=1, world_size=4)
        x = torch.empty(4, 3, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(8, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
        y = column_parallel_linear(x, w, dist.group.WORLD, True)
        y.sum().backward()
        print(tuple(y.shape), tuple(x.grad.shape), tuple(w.grad.shape), x.grad.device)
        dist.destroy_process_group()
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "(16, 3, 8) (4, 3, 16) (8, 16) meta"
