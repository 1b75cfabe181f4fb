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

_MAX_BLOCK = 8192
"""Vocab columns per loop step of the Triton kernels: big enough to stream, small enough for
registers; a 128k-vocab row is 16 steps."""


def _tp_size(tp_group) -> int:
    if tp_group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(tp_group)


def _row_stats_reference(
    logits: Tensor, target: Tensor, vocab_start: int, vocab_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Local fp32 logits with padding at -inf, the row max, and the target logit (0 off-rank)."""
    logits_f = logits.float()
    v_local = logits.shape[-1]
    ids = torch.arange(vocab_start, vocab_start + v_local, device=logits.device)
    logits_f = logits_f.masked_fill(ids >= vocab_size, float("-inf"))
    row_max = logits_f.max(dim=-1).values
    local_t = target - vocab_start
    on_rank = (local_t >= 0) & (local_t < v_local)
    picked = logits_f.gather(-1, local_t.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    return logits_f, row_max, torch.where(on_rank, picked, torch.zeros_like(picked))


def _reference_forward(
    logits: Tensor, target: Tensor, vocab_start: int, vocab_size: int, tp_group, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """Loss [N] and gradient [N, V_local] (logits dtype) for 2-D logits, by plain torch ops."""
    logits_f, row_max, target_logit = _row_stats_reference(logits, target, vocab_start, vocab_size)
    if _tp_size(tp_group) > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
    exp = torch.exp(logits_f - row_max.unsqueeze(-1))
    sums = torch.stack((exp.sum(dim=-1), target_logit))
    if _tp_size(tp_group) > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
    sum_exp, target_logit = sums
    ignored = target == ignore_index
    loss = torch.log(sum_exp) + row_max - target_logit
    loss = loss.masked_fill(ignored, 0.0)
    grad = exp.div_(sum_exp.unsqueeze(-1))
    local_t = target - vocab_start
    on_rank = (local_t >= 0) & (local_t < logits.shape[-1]) & ~ignored
    rows = on_rank.nonzero().squeeze(-1)
    grad[rows, local_t[rows]] -= 1.0
    grad.masked_fill_(ignored.unsqueeze(-1), 0.0)
    return loss, grad


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
        if use_triton:
            grad = None
            if need_grad:
                grad = logits_2d if inplace_backward else torch.empty_like(logits_2d)
            loss = _triton_forward(logits_2d, target_1d, vocab_start, vocab_size, tp_group,
                                   ignore_index, grad)
        else:
            loss, grad = _reference_forward(logits_2d, target_1d, vocab_start, vocab_size,
                                            tp_group, ignore_index)
            if need_grad:
                grad = logits_2d.copy_(grad) if inplace_backward else grad.to(logits.dtype)
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
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size, tp_group,
                                            ignore_index, use_triton, inplace_backward)
