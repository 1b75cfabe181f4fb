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

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron_lite import sharding
from megatron_lite.config import Config, ConfigError
from megatron_lite.config import num_microbatches as num_microbatches_of
from megatron_lite.layout import overlap_param_gather_errors
from megatron_lite.optim import zero1
from megatron_lite.optim.clip import clip_coefficient, global_norm, global_norm_and_sums
from megatron_lite.optim.grad_sync import GradSync, SyncContext
from megatron_lite.optim.param_buffers import ParamBuffers
from megatron_lite.optim.sync_full import AllReduce, Zero1
from megatron_lite.optim.sync_sharded import Zero2, Zero3
from megatron_lite.optim.update_check import UpdateCheck
from megatron_lite.optim.zero3 import FullyShardedParams
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState

STRATEGIES: dict[str, type[GradSync]] = {
    sharding.NO_SHARD: AllReduce, sharding.OPTIM: Zero1, sharding.OPTIM_GRADS: Zero2,
    sharding.OPTIM_GRADS_PARAMS: Zero3}
"""The gradient-sync class of each --data-parallel-sharding-strategy (megatron_lite/sharding.py
says what each splits)."""


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
        """The optimizer state is sharded over DP x CP (every strategy but no_shard)."""
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
        self.bufs = ParamBuffers.build(chunks, pstate, parallel, self.strategy, self.math_dtype)
        self.params, self.buffers, self.shards = self.bufs.params, self.bufs.buffers, \
            self.bufs.shards
        self._sp_pieces = self.bufs.sequence_parallel_pieces()
        self._ctx = SyncContext(pstate.replicas, parallel, self._reduce_tied, self.traffic,
                                self.wait_clock)
        self.sync = STRATEGIES[self.strategy.name](chunks, self.bufs, self._ctx)
        self.sync.begin(num_microbatches_of(cfg, pstate.world_size))
        self.check = (UpdateCheck(self.shards, cfg.optim, self.math_dtype, pstate.device)
                      if cfg.reliability.check_for_nan_in_loss_and_grad else None)
        """Skip a step whose update could leave a non-finite weight or Adam moment."""
        self.on_skip: Callable[[str], None] | None = None
        """Told why `step` skipped (the reliability guard's event names the cause)."""
        self._step = 0
        self._finalized = False

    @property
    def grad_check(self) -> Callable[[Tensor], None] | None:
        """Called with each bucket's local gradients right before its DP reduction (NaN/Inf
        checks that can name the rank; set by megatron_lite/reliability)."""
        return self._ctx.grad_check

    @grad_check.setter
    def grad_check(self, check: Callable[[Tensor], None] | None) -> None:
        self._ctx.grad_check = check

    @property
    def fsdp(self) -> FullyShardedParams | None:
        """ZeRO-3's gathers and frees (None under the other strategies)."""
        return self.sync.fsdp if isinstance(self.sync, Zero3) else None

    def close(self) -> None:
        """Remove the hooks on the model, so that model and optimizer can be freed.

        The hooks make a reference cycle (parameter -> hook -> optimizer -> parameter) that
        Python's collector cannot break, as autograd also holds the parameters. Left alone it
        keeps the process groups, and gloo's worker threads, alive until interpreter
        shutdown, where a thread still releasing its last collective's tensors aborts the
        process ("terminate called without an active exception").
        """
        self.sync.close()

    # ---- gradients -------------------------------------------------------------------------

    def zero_grad(self, num_microbatches: int | None = None) -> None:
        """Start a step of `num_microbatches` backward passes (default the config's; a
        batch-size ramp-up changes it per step): overlap launches a bucket after the last."""
        self.sync.begin(num_microbatches
                        or num_microbatches_of(self.cfg, self.pstate.world_size))
        self._finalized = False

    def start_grad_sync(self, chunk_index: int) -> None:
        """Pipeline hook: chunk `chunk_index` ran its last backward; its buckets may start
        (with --overlap-grad-reduce, and under ZeRO-2/3 always)."""
        self.sync.start(chunk_index)

    def finalize_grads(self) -> None:
        """Finish the step's gradient reduction: tied embeddings, DP, then SP norms over TP."""
        with self.wait_clock:
            self.sync.finish()
            if self._sp_pieces and self.pstate.tp_size > 1:
                grads = [self.shards[b].grad_at(r) for b, r in self._sp_pieces]
                flat = comms.all_reduce_(torch.cat(grads), self.pstate.tp_group)
                for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(reduced)
        self._finalized = True

    def _reduce_tied(self, grad: Tensor) -> None:
        comms.all_reduce_(grad, self.pstate.embedding_group)

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
        carry = (self.check.terms(self._step + 1, lr, decoupled_lr, wd)
                 if self.check is not None else None)
        norm, sums = global_norm_and_sums([g for s in self.shards for g in s.norm_pieces()],
                                          carry, self.pstate, sharded_over_dp=self.sharded,
                                          dtype=self.math_dtype)
        if sums is None or norm.is_meta:  # meta: a dry run, no values
            norm_value, terms = comms.host_scalar(norm), None
        else:
            norm_value, *terms = torch.cat([norm.reshape(1), sums]).cpu().tolist()  # 1 sync
        if not (norm.is_meta or math.isfinite(norm_value)):
            return self._skipped(norm_value, "non-finite gradient norm")
        if terms is not None and not self.check.passes(terms, norm_value):
            rates = [lr] if decoupled_lr is None else [lr, decoupled_lr]
            return self._skipped(norm_value, self.check.culprits(
                carry, norm_value, rates, self.pstate.rank, self._norm_group()))
        coeff = clip_coefficient(norm, self.cfg.optim.clip_grad)
        self._step += 1
        for shard in self.shards:
            shard.adamw_step(self.cfg.optim, lr, self._step, coeff, decoupled_lr, wd)
        if self.cfg.parallel.overlap_param_gather:
            self.sync.after_step(async_op=True)  # waited in the next forward's hooks
        else:
            with self.wait_clock:
                self.sync.after_step(async_op=False)
        return StepResult(norm_value, skipped=False)

    def _skipped(self, norm_value: float, why: str) -> StepResult:
        if self.on_skip is not None:
            self.on_skip(why)
        return StepResult(norm_value, skipped=True, skip_reason=why)

    def _norm_group(self) -> dist.ProcessGroup | None:
        """Where per-shard numbers are summed: every rank when each holds a different shard,
        the model-parallel group when the replicas hold the same state."""
        return self.pstate.world_group if self.sharded else self.pstate.mp_group

    def params_norm(self) -> float:
        """Global L2 norm of the weights, each element once (--log-params-norm; collective)."""
        pieces = [s.buffer.param[r.start:r.end] for s in self.shards for r in s.norm_ranges]
        return comms.host_scalar(global_norm(pieces, self.pstate, sharded_over_dp=self.sharded,
                                             dtype=self.math_dtype))

    def num_zeros_in_grad(self) -> int | float:
        """Reduced gradient elements that are exactly zero, each element once (after `step`,
        before the next `zero_grad`; --log-num-zeros-in-grad; collective); NaN on meta."""
        count = torch.zeros((), dtype=torch.float64, device=self.pstate.device)
        for s in self.shards:
            for r in s.norm_ranges:
                count += (s.grad_at(r) == 0).sum()
        value = comms.host_scalar(comms.all_reduce_(count, self._norm_group()))
        return int(value) if math.isfinite(value) else value

    # ---- parameters ------------------------------------------------------------------------

    @contextmanager
    def gathered_params(self) -> Iterator[None]:
        """Under ZeRO-3 every parameter holds its full value inside (all units gathered at
        once: for reading weights outside a forward); a no-op otherwise."""
        with self.sync.gathered():
            yield

    def set_param(self, param: nn.Parameter, value: Tensor) -> None:
        """Set a parameter (this rank's TP/PP-local tensor), e.g. from a checkpoint; under
        ZeRO-3 only its owned slice is kept. Call `reload_model_params` afterwards."""
        self.sync.write_param(param, value)

    def param_tensors(self) -> list[Tensor]:
        """The parameter storage kept through a step (the model's, or ZeRO-3's shards)."""
        return self.sync.param_tensors()

    def finish_param_sync(self) -> None:
        """Wait for outstanding parameter all-gathers; call before reading model weights
        outside a forward (e.g. saving a checkpoint) under --overlap-param-gather."""
        self.sync.wait_params()

    def reload_model_params(self) -> None:
        """Take the fp32 masters from the model's current weights: call after loading model
        weights without optimizer state (the masters were copied at construction)."""
        self.finish_param_sync()
        for shard in self.shards:
            shard.copy_params_to_master()

    # ---- state -----------------------------------------------------------------------------

    def grad_tensors(self) -> list[Tensor]:
        """The gradient storage kept through a step (full buffers or ZeRO-2/3 shards)."""
        return self.sync.grad_tensors()

    def memory(self) -> MemoryReport:
        """What this rank's optimizer holds (the lead prints `describe()` at start-up)."""
        layouts = [b.layout for b in self.buffers]
        return MemoryReport(
            state_bytes=sum(s.nbytes() for s in self.shards),
            padding_elements=sum(s.padding() for s in self.shards),
            grad_buffer_bytes=self.sync.grad_bytes(),
            local_params=sum(p.numel() for p in self.params),
            buffer_elements=sum(layout.numel for layout in layouts),
            buffer_padding_elements=sum(layout.padding for layout in layouts))

    def state_dict(self) -> dict:
        """This replica's optimizer state; format in `megatron_lite.optim.zero1`.

        The tensors are the live shard buffers, not copies (a copy would cost 12 bytes per
        owned element of device memory at every save): callers copy before training
        continues, as the Checkpointer does into its host buffers.
        """
        self.finish_param_sync()
        replicas = self.pstate.replicas
        return zero1.state_dict(self.shards, self._step, replicas.rank, replicas.size,
                                self.sharded)

    def load_state_dict(self, state: dict) -> None:
        """Restore this replica's state and set the model's weights from the masters.

        Collective over the replica group when the state is sharded (every rank calls it).
        """
        self.finish_param_sync()
        replicas = self.pstate.replicas
        self._step = zero1.load_state_dict(self.shards, state, replicas.rank, replicas.size,
                                           self.sharded)
        for shard in self.shards:
            shard.copy_master_to_params()
        self.sync.after_step(async_op=False)

