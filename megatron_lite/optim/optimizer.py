"""Mixed-precision AdamW over the model chunks of one rank, with data-parallel reduction.

Gradients are produced by a loss that is already divided by the global token count, so the
data-parallel reduction is a plain sum. The optimizer keeps fp32 master weights when the
model is bf16 (Adam's small updates vanish in bf16), applies decoupled weight decay to
weights with two or more dims only, and skips the step when the gradient norm is not finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron_lite.config import Config
from megatron_lite.optim.clip import clip_coefficient, counts_toward_norm, global_norm
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool


def unique_parameters(chunks: list[nn.Module]) -> list[nn.Parameter]:
    """Every trainable parameter of this rank once (a tied weight appears in two modules)."""
    seen: set[int] = set()
    params = []
    for chunk in chunks:
        for p in chunk.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


class Optimizer:
    """AdamW with fp32 master weights, global-norm clipping and DP gradient sums."""

    def __init__(self, cfg: Config, chunks: list[nn.Module], pstate: ParallelState) -> None:
        self.cfg, self.pstate = cfg, pstate
        self.params = unique_parameters(chunks)
        self.masters = [p if p.dtype == torch.float32 else
                        nn.Parameter(p.detach().float().clone()) for p in self.params]
        o = cfg.optim
        decay = [m for p, m in zip(self.params, self.masters) if p.ndim >= 2]
        no_decay = [m for p, m in zip(self.params, self.masters) if p.ndim < 2]
        self.adam = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def finalize_grads(self) -> None:
        """Sum partial gradients: SP norms over TP, tied embeddings over their group, DP."""
        ps = self.pstate
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if getattr(p, "sequence_parallel", False):
                comms.all_reduce_(p.grad, ps.tp_group)
            if getattr(p, "shared_embedding", False) and ps.pp_size > 1:
                comms.all_reduce_(p.grad, ps.embedding_group)
        if ps.dp_size > 1:
            flat = torch.cat([p.grad.reshape(-1).float() for p in self.params])
            comms.all_reduce_(flat, ps.dp_group)
            offset = 0
            for p in self.params:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p))
                offset += n

    def step(self, lr: float) -> StepResult:
        norm = global_norm((p.grad for p in self.params if counts_toward_norm(p, self.pstate)),
                           self.pstate, sharded_over_dp=False)
        norm_value = norm.item()
        if not torch.isfinite(norm):
            return StepResult(norm_value, skipped=True)
        coeff = clip_coefficient(norm, self.cfg.optim.clip_grad)
        for p, m in zip(self.params, self.masters):
            grad = p.grad.float() * coeff
            m.grad = grad if m is not p else grad.to(p.dtype)
        for group in self.adam.param_groups:
            group["lr"] = lr
        self.adam.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m)
                    m.grad = None
        return StepResult(norm_value, skipped=False)

    def state_dict(self) -> dict:
        return {"adam": self.adam.state_dict(),
                "masters": [m.detach() for m in self.masters]}

    def load_state_dict(self, state: dict) -> None:
        self.adam.load_state_dict(state["adam"])
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, state["masters"]):
                m.copy_(saved)
                if m is not p:
                    p.copy_(saved)
