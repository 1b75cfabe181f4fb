"""Vocab-parallel cross-entropy: per-token loss from logits split over the tensor-parallel ranks.

Each TP rank holds logits for global ids [vocab_start, vocab_start + V_local). With m the global
row max, S = sum_j exp(z_j - m) and t the target's logit (Megatron-LM's
`vocab_parallel_cross_entropy`, Shoeybi et al. 2019, §3):
    loss = log(S) + m - z_t;   dloss/dz_j = softmax_j - [j == t]
Only per-row scalars cross ranks: one all-reduce(MAX) of m, one all-reduce(SUM) of (S, z_t);
full-vocab logits are never gathered. The gradient is computed in the forward pass (softmax needs
S, which is already at hand) and saved, so the backward is a local scale by dL/dloss: no
collective, no recompute. With `inplace_backward` it is written over the logits buffer (Liger-
Kernel's trick), so no second vocab-sized tensor exists; the caller must not reuse the logits.
Global ids >= vocab_size are padding: masked to -inf, so they never win and get zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_lite.kernels._launch import load_triton_module, row_block_and_warps, rows_per_program
from megatron_lite.kernels._precision import upcast

_MAX_BLOCK = 8192
"""Vocab columns per loop step of the Triton kernels: big enough to stream, small enough for
registers; a 128k-vocab row is 16 steps."""


def _tp_size(tp_group) -> int:
    if tp_group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(tp_group)


def _reference_forward(
    logits: Tensor, target: Tensor, vocab_start: int, vocab_size: int, tp_group,
    ignore_index: int, grad_out: Tensor | None,
) -> Tensor:
    """Loss [N] for 2-D logits by plain torch ops; writes the gradient into `grad_out` if given.

    Padding ids are the tail of a rank's slice, so the math runs on the valid columns only (no
    -inf mask) and the tail's gradient is zero. Five passes over the valid logits (max; shift
    and exp, in the output; sum; divide), plus a cast when the logits are not fp32.
    """
    n_rows, v_local = logits.shape
    n_valid = max(0, min(v_local, vocab_size - vocab_start))
    x = upcast(logits[:, :n_valid])
    local_t = (target - vocab_start).clamp(0, max(n_valid - 1, 0)).unsqueeze(-1)
    on_rank = (target >= vocab_start) & (target < vocab_start + n_valid)
    if n_valid:
        row_max = x.amax(dim=-1)
        target_logit = torch.where(on_rank, x.gather(-1, local_t).squeeze(-1), 0.0)
    else:  # this rank holds only padding
        row_max = x.new_full((n_rows,), float("-inf"))
        target_logit = x.new_zeros(n_rows)
    if _tp_size(tp_group) > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
    fp32_out = grad_out is not None and grad_out.dtype == x.dtype
    probs = (grad_out if fp32_out else logits.new_empty(logits.shape, dtype=x.dtype))
    probs = probs[:, :n_valid]
    torch.sub(x, row_max.unsqueeze(-1), out=probs).exp_()
    sums = torch.stack((probs.sum(dim=-1), target_logit))
    if _tp_size(tp_group) > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
    sum_exp, target_logit = sums
    ignored = target == ignore_index
    loss = (torch.log(sum_exp) + row_max - target_logit).masked_fill(ignored, 0.0)
    if grad_out is None:
        return loss
    # softmax - onehot; ignored rows divide by inf, which zeroes them without another pass.
    probs.div_(sum_exp.masked_fill(ignored, float("inf")).unsqueeze(-1))
    if n_valid:
        hit = (on_rank & ~ignored).to(x.dtype).unsqueeze(-1)
        probs.scatter_add_(-1, local_t, hit.neg())
    if not fp32_out:
        grad_out[:, :n_valid].copy_(probs)
    grad_out[:, n_valid:] = 0.0
    return loss


def _triton_forward(
    logits: Tensor, target: Tensor, vocab_start: int, vocab_size: int, tp_group,
    ignore_index: int, grad_out: Tensor | None,
) -> Tensor:
    """Loss [N] for 2-D logits; writes the gradient into `grad_out` (may be `logits`) if given.

    Pass 1 reads each row once for its local (max, sum-exp, target logit); the ranks then agree on
    the global max, rescale their sums to it and add them; pass 2 writes softmax - onehot.
    """
    kernels = load_triton_module("cross_entropy", logits.device)
    n_rows, n_cols = logits.shape
    n_valid = max(0, min(n_cols, vocab_size - vocab_start))
    block, num_warps = row_block_and_warps(min(n_cols, _MAX_BLOCK))
    block_rows = rows_per_program(block, n_rows)
    grid = (-(-n_rows // block_rows),)
    stats = torch.empty(3, n_rows, device=logits.device, dtype=torch.float32)
    local_max, sum_exp, target_logit = stats
    kernels._ce_row_stats_kernel[grid](
        logits, target, local_max, sum_exp, target_logit, logits.stride(0), n_rows, n_valid,
        vocab_start, BLOCK_ROWS=block_rows, BLOCK_SIZE=block, num_warps=num_warps,
    )
    row_max = local_max
    if _tp_size(tp_group) > 1:
        row_max = local_max.clone()
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
        sums = torch.stack((sum_exp * torch.exp(local_max - row_max), target_logit))
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
        sum_exp, target_logit = sums
    loss = (torch.log(sum_exp) + row_max - target_logit).masked_fill(target == ignore_index, 0.0)
    if grad_out is not None:
        kernels._ce_grad_kernel[grid](
            logits, grad_out, target, row_max, sum_exp, logits.stride(0), grad_out.stride(0),
            n_rows, n_cols, n_valid, vocab_start, ignore_index, BLOCK_ROWS=block_rows,
            BLOCK_SIZE=block, num_warps=num_warps,
        )
    return loss


def _traceable_cross_entropy(logits: Tensor, target: Tensor, vocab_size: int,
                             ignore_index: int) -> Tensor:
    """The one-rank loss as differentiable ops, for torch.compile.

    Inductor fuses the forward into one reduction over the logits and derives a one-pass
    backward (softmax - onehot, scaled), which beats the autograd.Function's saved gradient.
    The padding columns are sliced off, so their gradient is zero.
    """
    x = upcast(logits[..., :vocab_size])
    picked = x.gather(-1, target.clamp(0, vocab_size - 1).unsqueeze(-1)).squeeze(-1)
    return (torch.logsumexp(x, dim=-1) - picked).masked_fill(target == ignore_index, 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Loss forward that saves its own gradient; backward scales it by dL/dloss."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, tp_group, ignore_index, use_triton,
                inplace_backward):
        shape = target.shape
        logits_2d = logits.reshape(-1, logits.shape[-1])
        if logits_2d.stride(-1) != 1:
            logits_2d = logits_2d.contiguous()
        target_1d = target.reshape(-1).contiguous()
        need_grad = ctx.needs_input_grad[0]
        if need_grad and inplace_backward and logits.is_leaf:
            raise ValueError("inplace_backward=True would overwrite a leaf tensor's data; pass "
                             "logits produced by an op (the output layer's matmul)")
        grad = None
        if need_grad:
            grad = logits_2d if inplace_backward else torch.empty_like(logits_2d)
        forward = _triton_forward if use_triton else _reference_forward
        loss = forward(logits_2d, target_1d, vocab_start, vocab_size, tp_group, ignore_index,
                       grad)
        if not need_grad:
            return loss.view(shape)
        if grad.data_ptr() == logits.data_ptr():
            # The gradient now lives in the caller's logits. Bumping their version makes any
            # other op that saved them fail loudly in backward instead of reading gradients.
            torch.autograd.graph.increment_version(logits)
            grad = logits
        ctx.save_for_backward(grad)
        ctx.logits_shape = logits.shape
        ctx.used = False
        return loss.view(shape)

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.used:
            raise RuntimeError("vocab_parallel_cross_entropy scales its saved gradient in place, "
                               "so its backward can run only once (no retain_graph re-use)")
        ctx.used = True
        (grad,) = ctx.saved_tensors
        grad = grad.view(-1, grad.shape[-1])
        grad.mul_(grad_loss.reshape(-1, 1))
        return grad.view(ctx.logits_shape), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    vocab_start: int,
    vocab_size: int,
    tp_group=None,
    ignore_index: int = -100,
    use_triton: bool = False,
    inplace_backward: bool = False,
) -> Tensor:
    """Per-token fp32 loss [...] from this rank's logits [..., V_local] and global target ids [...].

    `vocab_size` is the true (unpadded) vocabulary; ids at or past it are padding. Rows whose target
    is `ignore_index` get loss 0 and zero gradient. `tp_group` None or of size 1 means no
    communication. `inplace_backward=True` overwrites `logits` with the gradient (saves a
    vocab-sized tensor); only pass it when nothing else reads the logits afterwards.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be target {tuple(target.shape)} + "
                         "[V_local]")
    if torch.compiler.is_compiling() and not use_triton and _tp_size(tp_group) == 1:
        return _traceable_cross_entropy(logits, target, vocab_size, ignore_index)
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, tp_group,
                                            ignore_index, use_triton, inplace_backward)
