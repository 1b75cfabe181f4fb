"""Shared pieces of the optimizer tests: a tiny model, per-step data, and the references.

The reference is the plainest possible training step on one process: the same model and
loss normalisation, `.grad` accumulation, `torch.nn.utils.clip_grad_norm_` and
`torch.optim.AdamW` (decay on >= 2-D weights only). Distributed runs must land on its weights.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from megatron_lite.config import Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from megatron_lite.layers import tags
from megatron_lite.layers.init import unshard
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel.state import ParallelState, single_process_state
from megatron_lite.training import StepRunner, build_model, global_token_count
from tests.numerics import EXACT, assert_all_close

# GQA, ffn not a power of two, vocab divisible by 8 so TP=1/2 pad it the same way.
MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=48, seq_length=8, vocab_size=104,
                    make_vocab_size_divisible_by=4)
# Small clip threshold: clipping is active at every step (checked by the tests).
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.05, adam_beta2=0.95)
GLOBAL_BATCH = 4


def make_config(*, tp: int = 1, pp: int = 1, global_batch: int = GLOBAL_BATCH, micro: int = 1,
                bf16: bool = False, fp64: bool | None = None, lr: float | None = None,
                **parallel: object) -> Config:
    """The tests' config; float64 (exact math, tests/numerics.py) unless bf16 or fp64=False."""
    return Config(model=replace(MODEL),
                  parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                          pipeline_model_parallel_size=pp,
                                          distributed_backend="gloo", **parallel),
                  optim=replace(OPTIM, lr=lr or OPTIM.lr),
                  train=TrainConfig(micro_batch_size=micro, global_batch_size=global_batch,
                                    seed=11, bf16=bf16,
                                    fp64=(not bf16) if fp64 is None else fp64))


def step_batches(step: int, dp_rank: int, dp_size: int, micro: int,
                 global_batch: int = GLOBAL_BATCH) -> list[dict[str, Tensor]]:
    """This DP rank's micro-batches of the global batch of `step` (same data for any layout)."""
    g = torch.Generator().manual_seed(1000 + step)
    seq = MODEL.seq_length
    tokens = torch.randint(0, MODEL.vocab_size, (global_batch, seq + 1), generator=g)
    per_rank = global_batch // dp_size
    mine = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [{"tokens": mine[i:i + micro, :-1], "labels": mine[i:i + micro, 1:],
             "loss_mask": torch.ones(min(micro, per_rank - i), seq)}
            for i in range(0, per_rank, micro)]


def train_ours(pstate: ParallelState, cfg: Config, steps: int, reverse: bool = False) -> dict:
    """`steps` steps through `Optimizer`; params (local shards), norms, traffic, memory.
    `reverse` feeds each rank's micro-batches in reverse order (dtype tests' floors)."""
    chunks = build_model(cfg, pstate)
    opt = Optimizer(cfg, chunks, pstate)
    out = run_steps(chunks, opt, pstate, cfg, range(steps), reverse=reverse)
    out["memory"] = opt.memory()
    out["buckets"] = sum(len(b.layout.buckets) for b in opt.buffers)
    out["padding"] = sum(b.layout.padding for b in opt.buffers)
    return out


def run_steps(chunks: list, opt: Optimizer, pstate: ParallelState, cfg: Config,
              steps: range, reverse: bool = False) -> dict:
    norms, calls, sent, losses = [], [], [], []
    runner = StepRunner(cfg, pstate, chunks)
    for step in steps:
        batches = step_batches(step, pstate.dp_rank, pstate.dp_size, cfg.train.micro_batch_size,
                               cfg.train.global_batch_size)
        if reverse:
            batches.reverse()
        opt.traffic.reset()
        opt.zero_grad()
        losses.append(runner(batches, global_token_count(batches, pstate)).item())
        opt.finalize_grads()
        result = opt.step(cfg.optim.lr)
        opt.finish_param_sync()
        assert not result.skipped
        norms.append(result.grad_norm)
        calls.append(dict(opt.traffic.calls))
        sent.append(opt.traffic.total_bytes)
    with opt.gathered_params():  # ZeRO-3 keeps only shards between forwards
        params = model_parameters(chunks)
    return {"params": params, "norms": norms, "calls": calls, "bytes": sent,
            "losses": losses,
            "splits": {n: tags.tp_split(p) for n, p in chunks[0].named_parameters()}}


def single_process_name(chunk, name: str) -> str:
    """A chunk's parameter name as the single process spells it (global layer numbers)."""
    parts = name.split(".")
    if parts[0] == "layers":
        parts[1] = str(chunk.layer_ids[int(parts[1])])
    return ".".join(parts)


def model_parameters(chunks: list) -> dict[str, Tensor]:
    """This rank's weights under their single-process names (global layer numbers; the last
    stage's copy of a tied embedding under the embedding's name)."""
    out = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            key = ("embedding.weight" if tags.is_shared_embedding(p)
                   else single_process_name(chunk, name))
            out[key] = p.detach().clone()
    return out


def train_reference(steps: int, global_batch: int = GLOBAL_BATCH, lr: float | None = None,
                    fp64: bool = True, round_grads: torch.dtype | None = None) -> dict:
    """One process, `.grad` accumulation, torch clip + AdamW; float64 unless fp64=False.
    `round_grads` rounds the running gradient sum to that dtype after every micro-batch, as a
    gradient buffer of that dtype would (a dtype test's floor).

    Micro-batches of one sample, like the DP ranks', so the only difference left is the order
    in which per-sample gradients are summed (in fp32 a [2, s] matmul does not round like two
    [1, s] ones, and Adam turns that into ~1e-5 weight differences within 10 steps; in float64
    ~1e-15).
    """
    cfg = make_config(micro=1, global_batch=global_batch, lr=lr, fp64=fp64)
    pstate = single_process_state()
    model = build_model(cfg, pstate)[0]
    params = list(model.parameters())
    o = cfg.optim
    adam = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                              {"params": [p for p in params if p.ndim < 2],
                               "weight_decay": 0.0}],
                             lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                             weight_decay=o.weight_decay)
    if round_grads is not None:
        def round_sum(q: Tensor) -> None:
            q.grad.copy_(q.grad.to(round_grads))

        for p in params:
            p.register_post_accumulate_grad_hook(round_sum)
    norms, losses, grads = [], [], []
    runner = StepRunner(cfg, pstate, [model])
    for step in range(steps):
        batches = step_batches(step, 0, 1, micro=1, global_batch=global_batch)
        adam.zero_grad(set_to_none=True)
        losses.append(runner(batches, global_token_count(batches, pstate)).item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        norms.append(torch.nn.utils.clip_grad_norm_(params, o.clip_grad).item())
        adam.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "norms": norms, "losses": losses, "grads": grads}


def full_params(ranks: list[dict], tp: int) -> dict[str, Tensor]:
    """Unshard the TP pieces of DP rank 0's model (ranks ordered dp-major, tp-minor)."""
    first = ranks[:tp]
    return {n: unshard([r["params"][n] for r in first], first[0]["splits"][n])
            for n in first[0]["params"]}


def assert_same_params(got: dict[str, Tensor], ref: dict[str, Tensor], tol: float = EXACT
                       ) -> float:
    """Every weight within `tol` (float64 runs: tests/numerics.EXACT); returns the worst."""
    return assert_all_close(got, ref, tol)
