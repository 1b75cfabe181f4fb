"""Vocab-parallel cross-entropy (Triton and reference) against torch's cross_entropy in float64,
single process and TP=2 over gloo. The bound is a small multiple of the error torch's own fp32
cross_entropy makes on the same logits (its gradient rounded to the logits' dtype), measured in
each test (tests/kernels/util.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.kernels.cross_entropy import (
    _traceable_cross_entropy,
    vocab_parallel_cross_entropy,
)
from tests.distributed import run_ranks
from tests.kernels.util import within_reference_floor
from tests.numerics import assert_close

IGNORE = -100
DTYPES = [torch.float32, torch.bfloat16]
# (leading shape, padded vocab, true vocab): one row; ragged 3-D; a row longer than one block.
CASES = [((1,), 17, 17), ((2, 3), 300, 291), ((5,), 9000, 8999)]


def _problem(lead, v_padded, v_true, gen, scale=4.0):
    logits = torch.randn(*lead, v_padded, generator=gen) * scale
    target = torch.randint(0, v_true, lead, generator=gen)
    if target.numel() > 1:
        target.view(-1)[1] = IGNORE
    weight = torch.rand(lead, generator=gen)
    return logits, target, weight


def _torch_ce(logits, target, weight, v_true, dtype):
    """torch's cross_entropy on the real columns in `dtype`; padding columns get zero gradient."""
    x = logits.detach().to(dtype).requires_grad_()
    flat = x[..., :v_true].reshape(-1, v_true)
    loss = F.cross_entropy(flat, target.reshape(-1), ignore_index=IGNORE, reduction="none")
    loss = loss.view(target.shape)
    (loss * weight.to(dtype)).sum().backward()
    return loss.detach(), x.grad


class Expected:
    """The float64 answer, and torch's fp32 one (the floor) for logits of dtype `dtype`."""

    def __init__(self, logits, target, weight, v_true, dtype):
        self.loss, self.grad = _torch_ce(logits, target, weight, v_true, torch.float64)
        self.loss32, grad32 = _torch_ce(logits, target, weight, v_true, torch.float32)
        self.grad_ref, self.dtype = grad32.to(dtype), dtype
        # loss = logsumexp - z_t: both terms are rounded to fp32 before the (cancelling)
        # subtraction, so no fp32 algorithm can beat eps x (|lse| + |z_t|) / |loss|. With a
        # single row that bound, not torch's (possibly lucky) error on one value, is the floor.
        x = logits.detach().double()[..., :v_true]
        picked = x.gather(-1, target.clamp(0, v_true - 1).unsqueeze(-1)).squeeze(-1)
        lse = torch.logsumexp(x, -1).abs()[target != IGNORE]
        scale = lse + picked.abs()[target != IGNORE]
        eps = torch.finfo(torch.float32).eps
        self.loss_min = eps * (scale.norm() / self.loss.norm()).item()
        # dlogits = w (exp(z - lse) - onehot): lse rounded to fp32 moves every exponent by up to
        # eps |lse| / 2, a relative error exp passes on to each probability w p, plus exp's and
        # the product's own roundings; against |dlogits| that grows where p_target ~ 1 cancels.
        # On one row torch's fp32 gradient may dodge all that by luck, and its error is then no
        # floor (1% of seeds put a correct kernel at 1-2.3 ulps above it).
        probs = torch.softmax(x, -1) * weight.double().unsqueeze(-1)
        ratio = (probs[target != IGNORE].norm() / self.grad[..., :v_true].norm()).item()
        self.grad_min = eps * (0.5 * lse.square().mean().sqrt().item() + 1.0) * ratio

    def check(self, loss, grad, what="", cols=slice(None)):
        assert loss.dtype == torch.float32, f"loss{what} is {loss.dtype}"
        within_reference_floor(loss.cpu(), self.loss32, self.loss, f"loss{what}", self.loss_min)
        within_reference_floor(grad.cpu(), self.grad_ref[..., cols], self.grad[..., cols],
                               f"dlogits{what}", self.grad_min if self.dtype == torch.float32
                               else 0.0)


def _run(logits, target, weight, v_true, dtype, use_triton, inplace, vocab_start=0, group=None):
    """Loss and logits gradient from our function on a fresh leaf copy of `logits`."""
    x = logits.to(dtype, copy=True).requires_grad_()
    loss = vocab_parallel_cross_entropy(x * 1.0, target, vocab_start, v_true, tp_group=group,
                                        ignore_index=IGNORE, use_triton=use_triton,
                                        inplace_backward=inplace)
    (loss * weight.to(loss.device)).sum().backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_matches_torch(case, dtype, use_triton, inplace, device, gen):
    logits, target, weight = _problem(*case, gen)
    logits = logits.to(dtype).float()  # the bf16 run and the fp32 expectation see equal inputs
    expected = Expected(logits, target, weight, case[2], dtype)
    loss, grad = _run(logits.to(device), target.to(device), weight, case[2], dtype, use_triton,
                      inplace)
    expected.check(loss, grad)
    assert (loss[target == IGNORE] == 0).all()


def test_inplace_refuses_logits_another_op_still_needs(device, gen):
    """tanh saves its output; overwriting it must fail loudly in backward, not corrupt grads."""
    x = torch.randn(3, 10, generator=gen).to(device).requires_grad_()
    loss = vocab_parallel_cross_entropy(torch.tanh(x), torch.tensor([1, 2, 3], device=device),
                                        0, 10, use_triton=True, inplace_backward=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.sum().backward()


@pytest.mark.quick
def test_no_grad_leaves_logits_untouched(device, gen):
    logits = torch.randn(4, 33, generator=gen).to(device)
    before = logits.clone()
    target = torch.tensor([0, 5, IGNORE, 32], device=device)
    loss = vocab_parallel_cross_entropy(logits, target, 0, 33, use_triton=True,
                                        inplace_backward=True)
    torch.testing.assert_close(logits, before, rtol=0, atol=0)
    exact = F.cross_entropy(before.double(), target, ignore_index=IGNORE, reduction="none")
    fp32 = F.cross_entropy(before, target, ignore_index=IGNORE, reduction="none")
    within_reference_floor(loss, fp32, exact, "loss")


def _tp_rank(pstate, problems):
    """This rank's slice of the padded vocab, through both paths, with the real TP group."""
    out = []
    for logits, target, weight, v_true, dtype in problems:
        v_local = logits.shape[-1] // pstate.tp_size
        start = pstate.tp_rank * v_local
        local = logits[..., start : start + v_local]
        out.append({use_triton: _run(local, target, weight, v_true, dtype, use_triton,
                                     use_triton, start, pstate.tp_group)
                    for use_triton in (True, False)})
    return out


def test_tensor_parallel_2_matches_single_process(tmp_path, gen):
    """One spawn covers fp32 and bf16, and a vocab so small that rank 1 holds only padding."""
    problems = []
    for dtype, v_true in ((torch.float32, 62), (torch.bfloat16, 62), (torch.float32, 30)):
        logits, target, weight = _problem((3, 4), 64, v_true, gen)
        target[0, 0], target[0, 2] = 0, v_true - 1  # the first and the last real id
        problems.append((logits.to(dtype).float(), target, weight, v_true, dtype))
    results = run_ranks(_tp_rank, 2, tmp_path, tp=2, problems=problems)
    for i, (logits, target, weight, v_true, dtype) in enumerate(problems):
        expected = Expected(logits, target, weight, v_true, dtype)
        for rank in range(2):
            for use_triton, (loss, grad) in results[rank][i].items():
                expected.check(loss, grad, f", vocab {v_true} {dtype} rank {rank} "
                               f"triton={use_triton}", slice(rank * 32, (rank + 1) * 32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_cuda_sizes(dtype, gen):
    test_matches_torch(((2048,), 128256, 128256), dtype, True, True, torch.device("cuda"), gen)


def test_reference_keeps_float64(gen):
    """Float64 logits (--fp64 runs) stay float64 through the reference path, loss and gradient,
    and match torch's float64 cross_entropy to ~1e-16 (an fp32 step anywhere would show 1e-8)."""
    logits, target, weight = _problem((2, 3), 300, 291, gen)
    logits = logits.double()
    loss, grad = _run(logits, target, weight.double(), 291, torch.float64, False, False)
    assert loss.dtype == grad.dtype == torch.float64
    loss_ref, grad_ref = _torch_ce(logits, target, weight, 291, torch.float64)
    assert_close(loss, loss_ref, 1e-14, "float64 loss")
    assert_close(grad, grad_ref, 1e-14, "float64 dlogits")


def test_inplace_on_a_leaf_is_refused():
    logits = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(ValueError, match="leaf"):
        vocab_parallel_cross_entropy(logits, torch.tensor([1, 2]), 0, 8, inplace_backward=True)


def test_backward_twice_is_refused(device, gen):
    x = torch.randn(2, 8, generator=gen).to(device).requires_grad_()
    loss = vocab_parallel_cross_entropy(x * 2.0, torch.tensor([1, 2], device=device), 0, 8,
                                        use_triton=True)
    loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.sum().backward()


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiles_without_graph_breaks(dtype, gen, monkeypatch):
    """Under torch.compile (TP 1) the loss traces into one graph (fullgraph: Dynamo refuses a
    break whatever the backend), padding and ignore included, and AOTAutograd's traced forward
    and backward give the right numbers. The aot_eager backend runs those graphs without
    Inductor's C++ code generation (a 20-70 s cold compile here); Inductor on the whole model,
    this loss included, is tests/test_compile.py's."""
    monkeypatch.undo()  # Inductor's own pattern setup allocates bool tensors the poison rejects
    logits, target, weight = _problem((2, 3), 300, 291, gen)
    logits = logits.to(dtype).float()
    expected = Expected(logits, target, weight, 291, dtype)
    compiled = torch.compile(vocab_parallel_cross_entropy, fullgraph=True, backend="aot_eager")
    x = logits.to(dtype, copy=True).requires_grad_()
    loss = compiled(x * 1.0, target, 0, 291, ignore_index=IGNORE)
    (loss * weight).sum().backward()
    # The traced graph computes softmax - onehot from logsumexp, not torch's fused kernel: its
    # floor is the same ops run eagerly (measured ~2 ulps, torch's fused backward ~0.3).
    eager = logits.to(dtype, copy=True).requires_grad_()
    (_traceable_cross_entropy(eager * 1.0, target, 291, IGNORE) * weight).sum().backward()
    within_reference_floor(loss.detach(), expected.loss32, expected.loss, "loss",
                           expected.loss_min)
    within_reference_floor(x.grad, eager.grad, expected.grad, "dlogits")
    assert (loss[target == IGNORE] == 0).all()
