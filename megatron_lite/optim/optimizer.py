"""Mixed-precision AdamW over the parameter slices this rank owns, with the gradient sync
chosen once by --data-parallel-sharding-strategy.

Per step the training loop calls `zero_grad()`, runs every micro-batch's backward (the
strategy's hooks take the gradients), `finalize_grads()` and `step(lr)`:

- `finalize_grads()` (Megatron's finalize_model_grads): the strategy finishes the reduction
  over the DP x CP replicas (tied-embedding copies summed over the embedding group first),
  then sequence-parallel norm gradients are summed over TP. Sums commute, so this is right on
  the slice a rank owns even after a reduce-scatter (TP peers share the layout).
- `step(lr)`: global norm over the owned gradient slices (each weight once across TP, PP and
  DP), skip on NaN/Inf or an update that could overflow (optim/update_check.py, riding in
  the norm's all-reduce), clip, AdamW on the owned fp32 masters (`zero1.ShardState`), then
  the strategy brings every rank's parameters up to date (ZeRO-1/2's all-gather, with
  --overlap-param-gather in the background).

Where parameters live: optim/param_buffers.py. How they are synchronised: optim/grad_sync.py
(the interface), optim/sync_full.py (no_shard, ZeRO-1), optim/sync_sharded.py (ZeRO-2/3).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron_lite import sharding
from megatron_lite.config import Config, ConfigError
from megatron_lite.config import num_microbatches as num_microbatches_of
from megatron_lite.layers import tags
from megatron_lite.layout import overlap_param_gather_errors
from megatron_lite.optim import zero1
from megatron_lite.optim.clip import clip_coefficient, reduced_square_sum
from megatron_lite.optim.grad_sync import GradSync, SyncContext
from megatron_lite.optim.param_buffers import ParamBuffers
from megatron_lite.optim.sync_full import AllReduce, Zero1
from megatron_lite.optim.sync_sharded import Zero2, Zero3
from megatron_lite.optim.update_check import UpdateCheck
from megatron_lite.optim.zero3 import FullyShardedParams
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState, ReplicaGroup

STRATEGIES: dict[str, type[GradSync]] = {
    sharding.NO_SHARD: AllReduce, sharding.OPTIM: Zero1, sharding.OPTIM_GRADS: Zero2,
    sharding.OPTIM_GRADS_PARAMS: Zero3}
"""The gradient-sync class of each --data-parallel-sharding-strategy (megatron_lite/sharding.py
says what each splits)."""


@dataclass
class SyncGroup:
    """Parameters kept alike over one replica group: the dense ones over DP x CP, with expert
    parallelism the routed experts over expert-DP. Each has its own buffers and its own
    strategy instance; their squared norms are summed over `norm_group`."""

    name: str
    bufs: ParamBuffers
    sync: GradSync
    ctx: SyncContext
    norm_group: dist.ProcessGroup | None
    norm_kind: str
    """`norm_group`'s kind (mp or world)."""
    check: UpdateCheck | None

    def reduced_terms(self, carry: Tensor | None, dtype: torch.dtype) -> Tensor:
        """[squared gradient norm, *carry] of this group, summed over its norm group."""
        return self.reduced([g for s in self.bufs.shards for g in s.norm_pieces()], carry, dtype)

    def reduced(self, pieces: list[Tensor], carry: Tensor | None, dtype: torch.dtype
                ) -> Tensor:
        """[squared sum of `pieces`, *carry], summed over the norm group."""
        return reduced_square_sum(pieces, carry, self.norm_group, dtype,
                                  self.ctx.replicas.device, kind=self.norm_kind)


@dataclass
class StepResult:
    grad_norm: float
    """Global gradient norm before clipping; NaN/Inf when some gradient was not finite."""
    skipped: bool
    """True when the norm or the proposed update was not finite: nothing was changed."""
    skip_reason: str | None = None
    """Why it was skipped, naming the ranks where the update check found the cause."""


@dataclass(frozen=True)
class MemoryReport:
    """Bytes this rank's optimizer holds (see `Optimizer.memory`)."""

    state_bytes: int
    """fp32 master weights + Adam momentum + variance for the owned elements (12 B each)."""
    padding_elements: int
    """Owned elements that are padding, not parameters (their optimizer state is wasted)."""
    grad_buffer_bytes: int
    """The gradient kept through the step: the full-size buffer, or under ZeRO-2/3 the owned
    shard (the bucket tensors in flight during backward come and go)."""
    local_params: int
    """Parameters on this rank (after TP/PP splitting, before DP sharding)."""
    buffer_elements: int
    """Elements of the gradient/parameter buffers, padding included."""
    buffer_padding_elements: int
    """Buffer elements that are alignment padding (parameter starts, bucket ends)."""

    @property
    def buffer_padding_fraction(self) -> float:
        """What the alignment costs: padding over the whole buffer (<= 1% at real sizes)."""
        return self.buffer_padding_elements / max(1, self.buffer_elements)

    def describe(self) -> str:
        gib = 2 ** 30
        return (f"optimizer state {self.state_bytes / gib:.3f} GiB "
                f"({self.state_bytes / max(1, self.local_params):.2f} B/param, "
                f"{self.padding_elements} padding elements), gradient buffer "
                f"{self.grad_buffer_bytes / gib:.3f} GiB (alignment padding "
                f"{self.buffer_padding_elements} elements, "
                f"{100 * self.buffer_padding_fraction:.3f}% of the buffer)")


def _group_specs(pstate: ParallelState, sharded: bool) -> list[tuple]:
    """(name, which parameters, replicas, norm group and its kind, count-once) per sync
    group: the dense parameters' norm is summed over the model-parallel ranks when the
    replicas hold the same gradient; the experts' over every rank (EP ranks hold different
    experts), counted on expert-replica 0 only when not sharded. The experts have their own
    group when they are laid out apart (EP > 1 or an expert-TP size other than TP)."""
    dense_norm = (pstate.world_group, "world") if sharded else (pstate.mp_group, "mp")
    if not pstate.experts_apart:
        return [("dense", lambda p: True, pstate.replicas, *dense_norm, False)]
    return [("dense", lambda p: not tags.is_expert(p), pstate.replicas, *dense_norm, False),
            ("expert", tags.is_expert, pstate.expert_replicas, pstate.world_group, "world",
             True)]


def _sync_group(opt: Optimizer, chunks: Sequence[nn.Module], name: str,
                select: Callable[[nn.Parameter], bool], replicas: ReplicaGroup,
                norm_group: dist.ProcessGroup | None, norm_kind: str, norm_once: bool
                ) -> SyncGroup:
    """One group's buffers and strategy instance, sharing the optimizer's clocks."""
    cfg = opt.cfg
    bufs = ParamBuffers.build(chunks, select, opt.pstate, cfg.parallel, opt.strategy,
                              opt.math_dtype, replicas, norm_once, cfg.train.fp8_param_gather)
    # a partial, not a bound method: the optimizer must not be reachable from its own hooks'
    # state, or it (and the process groups it holds) outlives `close` until a cyclic
    # collection, possibly at interpreter shutdown (see `Optimizer.close`)
    reduce_tied = partial(comms.all_reduce_, group=opt.pstate.embedding_group, kind="embedding")
    ctx = SyncContext(replicas, cfg.parallel, reduce_tied, opt.traffic, opt.wait_clock,
                      tp_group=opt.pstate.tp_group)
    check = (UpdateCheck(bufs.shards, cfg.optim, opt.math_dtype, opt.pstate.device)
             if cfg.reliability.check_for_nan_in_loss_and_grad else None)
    return SyncGroup(name, bufs, STRATEGIES[opt.strategy.name](chunks, bufs, ctx), ctx,
                     norm_group, norm_kind, check)


class Optimizer:
    """AdamW over this rank's model chunks, its gradient sync chosen by the config."""

    def __init__(self, cfg: Config, chunks: Sequence[nn.Module], pstate: ParallelState
                 ) -> None:
        parallel = cfg.parallel
        errors = overlap_param_gather_errors(parallel.overlap_param_gather,
                                             parallel.use_distributed_optimizer)
        if errors:
            raise ConfigError(errors[0])
        self.cfg, self.pstate = cfg, pstate
        self.strategy = sharding.get(parallel.data_parallel_sharding_strategy)
        self.sharded = self.strategy.state
        """The optimizer state is sharded over the replicas (every strategy but no_shard)."""
        self.shard_params = self.strategy.params
        self.math_dtype = torch.float64 if cfg.train.fp64 else torch.float32
        """Masters, moments, reductions and norms (float64 only under --fp64)."""
        self.traffic = comms.Traffic()
        """DP bytes/calls of the gradient reduction and parameter gather (tests, bench)."""
        self.wait_clock = comms.WaitClock(pstate.device)
        """Exposed DP communication: `finalize_grads` (the gradient reductions still running,
        the tied-embedding and SP all-reduces), ZeRO-1/2's parameter all-gathers (their waits
        under --overlap-param-gather, the whole gather otherwise); the training step adds its
        token-count and loss all-reduces."""
        self.groups = [_sync_group(self, chunks, *spec) for spec in _group_specs(pstate,
                                                                                 self.sharded)]
        self.params = [p for g in self.groups for p in g.bufs.params]
        self.buffers = [b for g in self.groups for b in g.bufs.buffers]
        self.shards = [s for g in self.groups for s in g.bufs.shards]
        self.sync = self.groups[0].sync
        """The dense parameters' strategy."""
        self._sp_pieces = [(g.bufs.shards[b], r) for g in self.groups
                           for b, r in g.bufs.sequence_parallel_pieces()]
        self.zero_grad()
        self.on_skip: Callable[[str], None] | None = None
        """Told why `step` skipped (the reliability guard's event names the cause)."""
        self._step = 0

    @property
    def grad_check(self) -> Callable[[Tensor], None] | None:
        """Called with each bucket's local gradients right before its DP reduction (NaN/Inf
        checks that can name the rank; set by megatron_lite/reliability)."""
        return self.groups[0].ctx.grad_check

    @grad_check.setter
    def grad_check(self, check: Callable[[Tensor], None] | None) -> None:
        for group in self.groups:
            group.ctx.grad_check = check

    @property
    def fsdp(self) -> FullyShardedParams | None:
        """ZeRO-3's gathers and frees of the dense parameters (None for other strategies)."""
        return self.sync.fsdp if isinstance(self.sync, Zero3) else None

    def close(self) -> None:
        """Remove the hooks on the model, so that model and optimizer can be freed.

        The hooks make a reference cycle (parameter -> hook -> optimizer -> parameter) that
        Python's collector cannot break, as autograd also holds the parameters. Left alone it
        keeps the process groups, and gloo's worker threads, alive until interpreter
        shutdown, where a thread still releasing its last collective's tensors aborts the
        process ("terminate called without an active exception").
        """
        for group in self.groups:
            group.sync.close()

    # ---- gradients -------------------------------------------------------------------------

    def zero_grad(self, num_microbatches: int | None = None) -> None:
        """Start a step of `num_microbatches` backward passes (default the config's; a
        batch-size ramp-up changes it per step): overlap launches a bucket after the last."""
        count = num_microbatches or num_microbatches_of(self.cfg, self.pstate.world_size)
        for group in self.groups:
            group.sync.begin(count)
        self._finalized = False

    def start_grad_sync(self, chunk_index: int) -> None:
        """Pipeline hook: chunk `chunk_index` ran its last backward; its buckets may start
        (with --overlap-grad-reduce, and under ZeRO-2/3 always)."""
        for group in self.groups:
            group.sync.start(chunk_index)

    def finalize_grads(self) -> None:
        """Finish the step's gradient reduction: tied embeddings, DP, then SP norms over TP."""
        with self.wait_clock:
            for group in self.groups:
                group.sync.finish()
            if self._sp_pieces and self.pstate.tp_size > 1:
                grads = [shard.grad_at(r) for shard, r in self._sp_pieces]
                flat = comms.all_reduce_(torch.cat(grads), self.pstate.tp_group, kind="tp")
                for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(reduced)
        self._finalized = True

    # ---- update ----------------------------------------------------------------------------

    def step(self, lr: float, decoupled_lr: float | None = None,
             weight_decay: float | None = None) -> StepResult:
        """Clip and apply AdamW to the owned slices, then bring every rank's params up to date;
        `decoupled_lr` (--decoupled-lr) for the embedding and output weights; `weight_decay`
        this step's (--weight-decay-incr-style), default --weight-decay."""
        if not self._finalized:
            raise RuntimeError("Optimizer.step() needs finalize_grads() after the backward passes")
        self._finalized = False
        self.finish_param_sync()
        wd = self.cfg.optim.weight_decay if weight_decay is None else weight_decay
        carries = [g.check.terms(self._step + 1, lr, decoupled_lr, wd)
                   if g.check is not None else None for g in self.groups]
        reduced = [g.reduced_terms(c, self.math_dtype) for g, c in zip(self.groups, carries)]
        norm = torch.stack([r[0] for r in reduced]).sum().sqrt()
        if norm.is_meta:  # a dry run: no values
            values = [[math.nan] * r.numel() for r in reduced]
        else:
            flat = torch.cat(reduced).cpu().tolist()  # the step's one host sync
            values = [flat[a:a + r.numel()] for a, r in
                      zip(itertools.accumulate([0] + [r.numel() for r in reduced]), reduced)]
        norm_value = math.nan if norm.is_meta else math.sqrt(sum(v[0] for v in values))
        if not (norm.is_meta or math.isfinite(norm_value)):
            return self._skipped(norm_value, "non-finite gradient norm")
        rates = [lr] if decoupled_lr is None else [lr, decoupled_lr]
        for group, carry, terms in zip(self.groups, carries, values):
            if (carry is not None and not norm.is_meta
                    and not group.check.passes(terms[1:], norm_value)):
                return self._skipped(norm_value, group.check.culprits(
                    carry, norm_value, rates, self.pstate.rank, group.norm_group, group.norm_kind))
        coeff = clip_coefficient(norm, self.cfg.optim.clip_grad)
        self._step += 1
        for shard in self.shards:
            shard.adamw_step(self.cfg.optim, lr, self._step, coeff, decoupled_lr, wd)
        for group in self.groups:
            if self.cfg.parallel.overlap_param_gather:
                group.sync.after_step(async_op=True)  # waited in the next forward's hooks
            else:
                with self.wait_clock:
                    group.sync.after_step(async_op=False)
        return StepResult(norm_value, skipped=False)

    def _skipped(self, norm_value: float, why: str) -> StepResult:
        if self.on_skip is not None:
            self.on_skip(why)
        return StepResult(norm_value, skipped=True, skip_reason=why)

    def params_norm(self) -> float:
        """Global L2 norm of the weights, each element once (--log-params-norm; collective)."""
        squares = [g.reduced([s.buffer.param[r.start:r.end] for s in g.bufs.shards
                              for r in s.norm_ranges], None, self.math_dtype) for g in self.groups]
        return comms.host_scalar(torch.cat(squares).sum().sqrt())

    def num_zeros_in_grad(self) -> int | float:
        """Reduced gradient elements that are exactly zero, each element once (after `step`,
        before the next `zero_grad`; --log-num-zeros-in-grad; collective); NaN on meta."""
        total = torch.zeros((), dtype=torch.float64, device=self.pstate.device)
        for group in self.groups:
            count = torch.zeros((), dtype=torch.float64, device=self.pstate.device)
            for s in group.bufs.shards:
                for r in s.norm_ranges:
                    count += (s.grad_at(r) == 0).sum()
            total += comms.all_reduce_(count, group.norm_group, kind=group.norm_kind)
        value = comms.host_scalar(total)
        return int(value) if math.isfinite(value) else value

    # ---- parameters ------------------------------------------------------------------------

    @contextmanager
    def gathered_params(self) -> Iterator[None]:
        """Under ZeRO-3 every parameter holds its full value inside (all units gathered at
        once: for reading weights outside a forward); a no-op otherwise."""
        with contextlib.ExitStack() as stack:
            for group in self.groups:
                stack.enter_context(group.sync.gathered())
            yield

    def weight_in_optimizer(self, param: nn.Parameter) -> bool:
        """A checkpoint saves the master as the weight: ZeRO-3's weights, and under
        --fp8-param-gather the FP8 linears' (the model keeps their fp8 copy only)."""
        return self.shard_params or (self.cfg.train.fp8_param_gather and tags.is_fp8_weight(param))

    def set_param(self, param: nn.Parameter, value: Tensor) -> None:
        """Set a parameter (this rank's TP/PP-local tensor), e.g. from a checkpoint; under
        ZeRO-3 only its owned slice is kept. Call `reload_model_params` afterwards."""
        group = next(g for g in self.groups if any(p is param for p in g.bufs.params))
        group.sync.write_param(param, value)

    def param_tensors(self) -> list[Tensor]:
        """The parameter storage kept through a step (the model's, or ZeRO-3's shards)."""
        return [t for g in self.groups for t in g.sync.param_tensors()]

    def finish_param_sync(self) -> None:
        """Wait for outstanding parameter all-gathers; call before reading model weights
        outside a forward (e.g. saving a checkpoint) under --overlap-param-gather."""
        for group in self.groups:
            group.sync.wait_params()

    def reload_model_params(self) -> None:
        """Take the fp32 masters from the model's current weights: call after loading model
        weights without optimizer state (the masters were copied at construction)."""
        self.finish_param_sync()
        for shard in self.shards:
            shard.copy_params_to_master()
        if self.cfg.train.fp8_param_gather:  # the fp8 copies are cast from the new weights
            for group in self.groups:
                group.sync.after_step(async_op=False)

    # ---- state -----------------------------------------------------------------------------

    def grad_tensors(self) -> list[Tensor]:
        """The gradient storage kept through a step (full buffers or ZeRO-2/3 shards)."""
        return [t for g in self.groups for t in g.sync.grad_tensors()]

    def memory(self) -> MemoryReport:
        """What this rank's optimizer holds (the lead prints `describe()` at start-up)."""
        layouts = [b.layout for b in self.buffers]
        return MemoryReport(
            state_bytes=sum(s.nbytes() for s in self.shards),
            padding_elements=sum(s.padding() for s in self.shards),
            grad_buffer_bytes=sum(g.sync.grad_bytes() for g in self.groups),
            local_params=sum(p.numel() for p in self.params),
            buffer_elements=sum(layout.numel for layout in layouts),
            buffer_padding_elements=sum(layout.padding for layout in layouts))

    def state_dict(self) -> dict:
        """This replica's optimizer state; format in `megatron_lite.optim.zero1` (the dense
        group's, over DP x CP). With expert parallelism the expert group's state, in the same
        format over expert-DP, is added under "expert" (the dense part stays as it is).

        The tensors are the live shard buffers, not copies (a copy would cost 12 bytes per
        owned element of device memory at every save): callers copy before training
        continues, as the Checkpointer does into its host buffers.
        """
        self.finish_param_sync()
        states = [zero1.state_dict(g.bufs.shards, self._step, g.ctx.replicas.rank,
                                   g.ctx.replicas.size, self.sharded) for g in self.groups]
        return {**states[0], "expert": states[1]} if len(states) > 1 else states[0]

    def load_state_dict(self, state: dict) -> None:
        """Restore this replica's state (`state_dict`'s format) and set the model's weights
        from the masters.

        Collective over each group's replicas when the state is sharded (every rank calls it).
        """
        self.finish_param_sync()
        parts = [state, state["expert"]] if len(self.groups) > 1 else [state]
        for group, part in zip(self.groups, parts, strict=True):
            replicas = group.ctx.replicas
            self._step = zero1.load_state_dict(group.bufs.shards, part, replicas.rank,
                                               replicas.size, self.sharded)
            for shard in group.bufs.shards:
                shard.copy_master_to_params()
            group.sync.after_step(async_op=False)
