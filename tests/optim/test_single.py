"""Single-process behaviour of the optimizer: AdamW math, NaN handling, bad call sequences.

The AdamW comparison is an equivalence test: float64 on both sides, weights and norms within
tests.numerics.EXACT of torch.optim.AdamW + clip_grad_norm_ after 10 clipped steps.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel.state import single_process_state
from megatron_lite.training import StepRunner, build_model, global_token_count
from tests.numerics import assert_close
from tests.optim.common import (
    OPTIM,
    assert_same_params,
    make_config,
    run_steps,
    step_batches,
    train_ours,
    train_reference,
)


@pytest.mark.parametrize("parallel", [{}, pytest.param(
    {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "ddp_bucket_size": 500},
    marks=pytest.mark.quick)])
def test_matches_torch_adamw_with_clipping(parallel: dict) -> None:
    ref = train_reference(steps=10)
    assert min(ref["norms"]) > OPTIM.clip_grad, "clipping must be active at every step"
    ours = train_ours(single_process_state(), make_config(micro=1, **parallel), steps=10)
    assert_same_params(ours["params"], ref["params"])
    assert_close(ours["norms"], ref["norms"], what="grad norms")


def test_nan_gradient_skips_step_and_reports() -> None:
    cfg, ps = make_config(micro=4), single_process_state()
    chunks = build_model(cfg, ps)
    opt = Optimizer(cfg, chunks, ps)
    before = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    opt.zero_grad()
    batches = step_batches(0, 0, 1, micro=4)
    StepRunner(cfg, ps, chunks)(batches, global_token_count(batches, ps))
    next(iter(chunks[0].parameters())).main_grad.view(-1)[0] = float("nan")
    opt.finalize_grads()
    result = opt.step(1e-2)
    assert result.skipped and result.grad_norm != result.grad_norm  # NaN
    for n, p in chunks[0].named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed on a skipped step"


def test_extra_backward_pass_with_overlap_is_an_error() -> None:
    cfg, ps = make_config(micro=4, overlap_grad_reduce=True), single_process_state()
    chunks = build_model(cfg, ps)
    opt = Optimizer(cfg, chunks, ps)
    opt.zero_grad()
    batches = step_batches(0, 0, 1, micro=4)
    StepRunner(cfg, ps, chunks)(batches, global_token_count(batches, ps))
    with pytest.raises(RuntimeError, match="more backward passes"):
        StepRunner(cfg, ps, chunks)(batches, global_token_count(batches, ps))


def test_overlap_param_gather_needs_distributed_optimizer() -> None:
    cfg = make_config(overlap_param_gather=True)
    with pytest.raises(ValueError, match="--use-distributed-optimizer"):
        Optimizer(cfg, build_model(cfg, single_process_state()), single_process_state())


def test_state_dict_round_trip_and_layout_check() -> None:
    cfg, ps = make_config(micro=2), single_process_state()
    straight = train_ours(ps, cfg, steps=4)
    chunks = build_model(cfg, ps)
    opt = Optimizer(cfg, chunks, ps)
    run_steps(chunks, opt, ps, cfg, range(2))
    saved = opt.state_dict()
    model_saved = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    chunks2 = build_model(cfg, ps)
    with torch.no_grad():
        for n, p in chunks2[0].named_parameters():
            p.copy_(model_saved[n])
    opt2 = Optimizer(cfg, chunks2, ps)
    opt2.load_state_dict(saved)
    resumed = run_steps(chunks2, opt2, ps, cfg, range(2, 4))
    assert_same_params(resumed["params"], straight["params"], tol=0.0)
    bad = {**saved, "dp_size": 2}
    with pytest.raises(ValueError, match="dp_size: saved 2, running 1"):
        opt2.load_state_dict(bad)


def test_reload_model_params_after_loading_weights() -> None:
    cfg, ps = make_config(micro=2), single_process_state()
    other = make_config(micro=2)
    other.train.seed = 99
    expected = train_ours(ps, other, steps=2)["params"]
    chunks = build_model(cfg, ps)
    opt = Optimizer(cfg, chunks, ps)
    chunks[0].load_state_dict(build_model(other, ps)[0].state_dict())
    opt.reload_model_params()
    assert_same_params(run_steps(chunks, opt, ps, cfg, range(2))["params"], expected, tol=0.0)
