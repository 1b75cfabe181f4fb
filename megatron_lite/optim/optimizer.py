"""Mixed-precision AdamW with contiguous gradient buffers, bucketed DP reduction and ZeRO-1.

Per step the training loop calls `zero_grad()`, runs every micro-batch's backward,
`finalize_grads()` and `step(lr)`:

- Backward: a hook on every parameter adds its micro-batch gradient into `param.main_grad`, a
  view of the fp32 (or, with --grad-reduce-in-bf16, bf16) gradient buffer, and frees `.grad`.
- DP reduction, once per step: each bucket is summed over DP (the loss is already divided by
  the global-batch token count, so a sum is the mean gradient) by an all-reduce, or with
  --use-distributed-optimizer by a reduce-scatter that leaves each rank its own slice. With
  --overlap-grad-reduce a bucket starts as soon as every gradient in it has arrived for the
  last micro-batch (counted per parameter) or when the pipeline engine calls
  `start_grad_sync(chunk)`; otherwise `finalize_grads()` starts them all.
- ZeRO-2/3 (--data-parallel-sharding-strategy optim_grads / optim_grads_params): there is
  no full-size gradient buffer. The hook adds into a bucket-sized tensor made when the
  bucket's first gradient arrives; once every member has arrived it is reduce-scattered into
  the owned fp32 shard (`ShardState.grad`) and dropped, so at most the buckets in flight
  exist at full size. With gradient accumulation this happens every micro-batch (the default,
  --sharded-grad-accumulation reduce-scatter: fp32 accumulation, no full-size storage,
  gradient traffic x micro-batches: 1.5x ZeRO-1's total at 2 micro-batches, measured in
  tests/optim/test_sharding.py); `full-buffer` keeps the buckets alive in the parameter dtype
  (bf16: 2 B/param) until the last micro-batch and sends ZeRO-1's bytes. Per-micro-batch is
  the default because memory is what ZeRO-2 is chosen for; the shard is folded into this
  rank's slice of the next micro-batch's input, so the collective returns the running sum.
- After the DP reduction, `finalize_grads()` sums sequence-parallel norm gradients over TP.
  Sums commute, so this is right on the slice a rank owns even after a reduce-scatter (TP peers
  share the layout). Tied-embedding copies on the first and last pipeline stage live in their
  own bucket, summed over the embedding group before that bucket's DP reduction: their
  stages finish backward at different times, so this cannot happen inside the hooks.
- `step(lr)`: global norm over the owned gradient slices (each weight once across TP, PP and DP),
  skip on NaN/Inf, clip, AdamW on the owned fp32 masters (`zero1.ShardState`), write the
  slice into the model's parameter buffer, then (ZeRO-1) all-gather every bucket's parameters;
  with --overlap-param-gather the all-gathers run in the background and each module waits
  for its buckets in a forward pre-hook of the next step.
- The update's finite check (with --check-for-nan-in-loss-and-grad, the default): the step is
  skipped unless the update it proposes is sure to leave weights and Adam state finite, decided
  before anything is written, so nothing needs restoring (no second copy of the state). Each
  rank bounds its proposed update from its shard's largest |weight|, |m|, v and its LR
  (`_update_bound_terms`); those terms ride in the gradient norm's all-reduce (the same
  collective and host sync as before), summed over the same group: every DP shard under
  ZeRO-1/2/3, the model-parallel ranks without sharding (DP replicas hold identical state).
  With the reduced norm G bounding every clipped gradient element, AdamW's new weight obeys
  |p'| <= P (1 + lr wd) + lr / (1 - b1^t) * (M + G) / eps, and m', v' stay below M + G and
  V + G^2: finite inputs, a finite LR and a bound below the dtype's largest value / 16 mean a
  finite update. NaN/Inf in a weight or moment, a NaN LR, or an update that would overflow skip
  the step on every rank, as a NaN gradient does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.config import Config, ConfigError, ddp_bucket_size
from megatron_lite.config import num_microbatches as num_microbatches_of
from megatron_lite.layers import tags
from megatron_lite.layout import overlap_param_gather_errors
from megatron_lite.optim import zero1, zero3
from megatron_lite.optim.buffers import GradBuffer, Range, build_layout
from megatron_lite.optim.clip import (
    clip_coefficient,
    counts_toward_norm,
    global_norm,
    global_norm_and_sums,
)
from megatron_lite.parallel import comms
from megatron_lite.parallel.audit import op_identity
from megatron_lite.parallel.state import ParallelState

BucketKey = tuple[int, int]
"""(buffer index, bucket index)."""
MAX_INFLIGHT_SCATTERS = 2
"""ZeRO-2/3: reduce-scatters that may run at once; each holds a bucket-sized input."""


@dataclass
class StepResult:
    grad_norm: float
    """Global gradient norm before clipping; NaN/Inf when some gradient was not finite."""
    skipped: bool
    """True when the norm or the proposed update was not finite: nothing was changed."""
    skip_reason: str | None = None
    """Why it was skipped, naming the ranks where the update check found the cause."""

UPDATE_LIMIT_DIVISOR = 16.0
"""The update check wants its bound below the dtype's largest value over this (a margin for
the rounding of the bound's own arithmetic and of the bf16 copy of the weights)."""


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


_DECOUPLED = ("embedding.", "output.")
"""Parameter names (after the chunk prefix) that take --decoupled-lr, as in Megatron."""


def _named_parameters(chunks: Sequence[nn.Module]) -> list[tuple[str, nn.Parameter, int]]:
    """(name, parameter, chunk index) for every trainable parameter once (ties appear twice)."""
    seen: set[int] = set()
    out = []
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((f"chunk{c}.{name}", p, c))
    return out


class Optimizer:
    """AdamW over this rank's model chunks: buffers, DP reduction, clipping, ZeRO-1."""

    def __init__(self, cfg: Config, chunks: Sequence[nn.Module], pstate: ParallelState
                 ) -> None:
        parallel = cfg.parallel
        errors = overlap_param_gather_errors(parallel.overlap_param_gather,
                                             parallel.use_distributed_optimizer)
        if errors:
            raise ConfigError(errors[0])
        # CP ranks hold the same parameters as DP ranks do: reduce and shard over DP x CP
        self.cfg, self.pstate = cfg, pstate.gradient_replicas()
        self.sharded = parallel.use_distributed_optimizer
        """The optimizer state is sharded over DP (every strategy but no_shard)."""
        self.shard_grads = parallel.shard_grads
        """ZeRO-2/3: only the owned gradient slices are kept (`ShardState.grad`); buckets
        are reduce-scattered from the hooks whatever --overlap-grad-reduce says."""
        self.full_accumulator = (self.shard_grads
                                 and parallel.sharded_grad_accumulation == "full-buffer")
        """ZeRO-2 with --sharded-grad-accumulation full-buffer: one reduce-scatter per step."""
        self.shard_params = parallel.shard_params
        """ZeRO-3: only the owned parameter slices are kept; `fsdp` gathers them per unit."""
        self.overlap_grad_reduce = parallel.overlap_grad_reduce
        self.num_microbatches = num_microbatches_of(cfg, pstate.world_size)
        self.math_dtype = torch.float64 if cfg.train.fp64 else torch.float32
        """Masters, moments, reductions and norms (float64 only under --fp64)."""
        self.traffic = comms.Traffic()
        """DP bytes/calls of the gradient reduction and parameter gather (tests, bench)."""
        self.wait_clock = comms.WaitClock(pstate.device)
        """Exposed DP communication: `finalize_grads` (the gradient reductions still running,
        the tied-embedding and SP all-reduces), ZeRO-1's parameter all-gathers (their waits
        under --overlap-param-gather, the whole gather otherwise); the training step adds its
        token-count and loss all-reduces."""
        named = _named_parameters(chunks)
        self.params = [p for _, p, _ in named]
        self._names = [n for n, _, _ in named]
        units = zero3.unit_of_params(zero3.unit_modules(chunks)) if self.shard_params else None
        self._build_buffers(named, torch.bfloat16 if parallel.grad_reduce_in_bf16
                            else self.math_dtype, units)
        self._live: dict[BucketKey, torch.Tensor] = {}
        """ZeRO-2/3: bucket gradients accumulating since their last reduce-scatter."""
        self._seen: dict[BucketKey, set[int]] = {}
        """ZeRO-2/3: members that added a gradient into the live bucket tensor."""
        self._inflight: dict[BucketKey, tuple[dist.Work | None, torch.Tensor | None]] = {}
        """ZeRO-2/3: each bucket's latest reduce-scatter and the input it must keep alive
        (None once waited for)."""
        self._scattered: set[BucketKey] = set()
        """ZeRO-2/3: buckets whose shard already holds a part of this step's gradient."""
        self._step = 0
        self._handles: dict[BucketKey, dist.Work | None] = {}
        self._gathers: dict[BucketKey, dist.Work | None] = {}
        self._arrivals = [0] * len(self.params)
        self._waiting = {key: len(m) for key, m in self._members.items()}
        self._finalized = False
        self.grad_check: Callable[[torch.Tensor], None] | None = None
        """Called with each bucket's local gradients right before its DP reduction (NaN/Inf
        checks that can name the rank; see megatron_lite/reliability)."""
        self.check_update = cfg.reliability.check_for_nan_in_loss_and_grad
        """Skip a step whose update could leave a non-finite weight or Adam moment."""
        self.on_skip: Callable[[str], None] | None = None
        """Told why `step` skipped (the reliability guard's event names the cause)."""
        self._state_max = torch.zeros(3)
        """This step's largest |master|, |exp_avg|, exp_avg_sq (for the skip message)."""
        self._update_limit = min(
            [torch.finfo(b.param.dtype).max for b in self.buffers]
            + [torch.finfo(s.master.dtype).max for s in self.shards]) / UPDATE_LIMIT_DIVISOR
        self._hooks = [p.register_post_accumulate_grad_hook(partial(self._on_grad, i))
                       for i, p in enumerate(self.params)]
        self.fsdp: zero3.FullyShardedParams | None = None
        """ZeRO-3's gathers and frees (its hooks run after the gradient hooks above)."""
        if self.shard_params:
            self.fsdp = zero3.FullyShardedParams(chunks, self.params, self._slot, self.buffers,
                                                 self.pstate, self.traffic)
            self._hooks += self.fsdp.hooks
        elif parallel.overlap_param_gather:
            self._register_gather_waits(chunks)

    def close(self) -> None:
        """Remove the hooks on the model, so that model and optimizer can be freed.

        The hooks make a reference cycle (parameter -> hook -> optimizer -> parameter) that
        Python's collector cannot break, as autograd also holds the parameters. Left alone it
        keeps the process groups, and gloo's worker threads, alive until interpreter
        shutdown, where a thread still releasing its last collective's tensors aborts the
        process ("terminate called without an active exception").
        """
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _build_buffers(self, named: list[tuple[str, nn.Parameter, int]],
                       grad_dtype: torch.dtype, units: dict[int, int] | None = None) -> None:
        """One buffer per parameter dtype; tied-embedding copies get their own buckets, and
        under ZeRO-3 (`units`: id(param) -> unit) every unit its own."""
        pstate = self.pstate
        self.buffers: list[GradBuffer] = []
        self.shards: list[zero1.ShardState] = []
        self._slot: list[BucketKey] = [(0, 0)] * len(named)
        self._deferred: set[BucketKey] = set()
        self._chunk_of: dict[BucketKey, int] = {}
        self._members: dict[BucketKey, list[int]] = {}
        self._local = [0] * len(named)
        """Each parameter's index inside its buffer."""
        index = {id(p): i for i, (_, p, _) in enumerate(named)}
        for dtype in dict.fromkeys(p.dtype for _, p, _ in named):
            members = [(n, p, c) for n, p, c in named if p.dtype == dtype]
            tied = [pstate.pp_size > 1 and tags.is_shared_embedding(p) for _, p, _ in members]
            groups = [2 * chunk + is_tied for (_, _, chunk), is_tied in zip(members, tied)]
            if units is not None:  # ZeRO-3 refuses PP: no stage copies, one chunk
                groups = [2 * units[id(p)] for _, p, _ in members]
            layout = build_layout([p.numel() for _, p, _ in members], groups,
                                  list(reversed(range(len(members)))),
                                  ddp_bucket_size(self.cfg.parallel, pstate.dp_size),
                                  pstate.dp_size)
            b = len(self.buffers)
            if units is not None:
                buffer = zero3.ShardedParamBuffer([p for _, p, _ in members], layout,
                                                  grad_dtype, pstate.dp_rank)
            else:
                buffer = GradBuffer([p for _, p, _ in members], layout, grad_dtype,
                                    full_grad=not self.shard_grads)
            for j, (_, p, _) in enumerate(members):
                self._local[index[id(p)]] = j
            for bucket in layout.buckets:
                key = (b, bucket.index)
                self._chunk_of[key] = members[bucket.params[0]][2]
                if bucket.group % 2:
                    self._deferred.add(key)
                self._members[key] = [index[id(members[i][1])] for i in bucket.params]
                for i in self._members[key]:
                    self._slot[i] = key
            infos = [zero1.ParamInfo(n, tuple(p.shape), p.ndim >= 2, counts_toward_norm(p, pstate),
                                     decoupled=n.split(".", 1)[1].startswith(_DECOUPLED))
                     for n, p, _ in members]
            self.buffers.append(buffer)
            self.shards.append(zero1.ShardState(
                buffer, layout.owned(pstate.dp_rank, self.sharded), infos))
        self._sp_pieces = self._sequence_parallel_pieces()

    def _sequence_parallel_pieces(self) -> list[tuple[int, int, int]]:
        """(buffer, start, end) of owned gradient elements of SP norm weights."""
        pieces = []
        for b, shard in enumerate(self.shards):
            layout = shard.buffer.layout
            for p, r in zip(shard.buffer.params, layout.param_ranges):
                if not tags.is_sequence_parallel_grad(p):
                    continue
                for own in shard.owned:
                    overlap = r.intersect(own)
                    if overlap is not None:
                        pieces.append((b, overlap.start, overlap.end))
        return pieces

    def _register_gather_waits(self, chunks: Sequence[nn.Module]) -> None:
        slot = {id(p): self._slot[i] for i, p in enumerate(self.params)}
        for chunk in chunks:
            for module in chunk.modules():
                keys = {slot[id(p)] for p in module.parameters(recurse=False) if id(p) in slot}
                if keys:
                    self._hooks.append(module.register_forward_pre_hook(
                        partial(self._wait_gathers, sorted(keys))))

    # ---- gradients -------------------------------------------------------------------------

    def zero_grad(self, num_microbatches: int | None = None) -> None:
        """Start a step of `num_microbatches` backward passes (default the config's; a
        batch-size ramp-up changes it per step): overlap launches a bucket after the last."""
        self.num_microbatches = num_microbatches or num_microbatches_of(self.cfg,
                                                                        self.pstate.world_size)
        for shard in self.shards:
            shard.zero_grad()
        for p in self.params:
            p.grad = None
        if self.fsdp is not None:
            self.fsdp.zero_grad()
        self._arrivals = [0] * len(self.params)
        self._waiting = {key: len(m) for key, m in self._members.items()}
        self._handles.clear()
        self._live.clear()
        self._seen.clear()
        self._inflight.clear()
        self._scattered.clear()
        self._finalized = False

    def _on_grad(self, i: int, param: nn.Parameter) -> None:
        """Post-accumulate hook: move the micro-batch gradient into the buffer."""
        key = self._slot[i]
        if self.shard_grads:
            self._accumulate_sharded(i, key, param)
            return
        if key in self._handles:
            raise RuntimeError(
                f"a gradient of {self._names[i]} arrived after its bucket's DP reduction "
                f"started: more backward passes per step than the {self.num_microbatches} "
                "micro-batches the config implies")
        param.main_grad.add_(param.grad)
        param.grad = None
        if not self.overlap_grad_reduce:
            return
        self._arrivals[i] += 1
        if self._arrivals[i] == self.num_microbatches:
            self._waiting[key] -= 1
            if self._waiting[key] == 0 and key not in self._deferred:
                self._launch(key)

    def _accumulate_sharded(self, i: int, key: BucketKey, param: nn.Parameter) -> None:
        """ZeRO-2/3 hook: add into the bucket's live tensor; reduce-scatter it once every
        member has arrived (each micro-batch, or with a full-buffer accumulator the last)."""
        self._arrivals[i] += 1
        if self._arrivals[i] > self.num_microbatches:
            raise RuntimeError(
                f"a gradient of {self._names[i]} arrived after its bucket's DP reduction "
                f"started: more backward passes per step than the {self.num_microbatches} "
                "micro-batches the config implies")
        buffer = self.buffers[key[0]]
        bucket = buffer.layout.buckets[key[1]]
        live = self._live.get(key)
        if live is None:
            dtype = buffer.param.dtype if self.full_accumulator else buffer.grad_dtype
            live = self._live[key] = buffer.new_bucket_grad(bucket, dtype)
        buffer.param_grad_view(live, bucket, self._local[i]).add_(param.grad)
        param.grad = None
        if key in self._deferred:
            return
        if self.full_accumulator:
            if self._arrivals[i] == self.num_microbatches:
                self._waiting[key] -= 1
                if self._waiting[key] == 0:
                    self._scatter(key)
            return
        seen = self._seen.setdefault(key, set())
        seen.add(i)
        if len(seen) == len(self._members[key]):
            self._scatter(key)

    def _scatter(self, key: BucketKey) -> None:
        """ZeRO-2/3: reduce-scatter the live bucket tensor into the owned gradient shard.

        A bucket scattered earlier in the step (an earlier micro-batch) already holds a sum
        in its shard: this rank adds it into its own slice of the input first, so the
        collective's result is the running total and no shard-sized temporary is needed.
        """
        pstate = self.pstate
        buffer = self.buffers[key[0]]
        bucket = buffer.layout.buckets[key[1]]
        out = self.shards[key[0]].bucket_grad_shard(key[1])
        live = self._live.pop(key, None)
        if live is None:
            live = buffer.new_bucket_grad(bucket, out.dtype)
        self._seen.pop(key, None)
        if self.grad_check is not None:
            self.grad_check(live)
        send = live if live.dtype == out.dtype else live.to(out.dtype)
        if key in self._scattered:
            handle = self._inflight.pop(key)[0]  # (re-inserted last: dicts keep launch order)
            if handle is not None:
                handle.wait()
            own = bucket.shard(pstate.dp_size, pstate.dp_rank).relative_to(bucket.range.start)
            send[own.start:own.end].add_(out)
        with op_identity("grad_reduce_scatter", buffer=key[0], bucket=key[1]):
            handle = comms.reduce_scatter_flat(out, send, pstate.dp_group, async_op=True,
                                               traffic=self.traffic)
        self._inflight[key] = (handle, send)
        self._scattered.add(key)
        self._retire(keep=MAX_INFLIGHT_SCATTERS)

    def _retire(self, keep: int) -> None:
        """Wait for the oldest reduce-scatters until `keep` still hold their input: without
        this every bucket's input would live until `finalize_grads`, a full-size gradient."""
        running = [k for k, (_, send) in self._inflight.items() if send is not None]
        for key in running[:max(0, len(running) - keep)]:
            handle = self._inflight[key][0]
            if handle is not None:
                handle.wait()
            self._inflight[key] = (None, None)

    def _launch(self, key: BucketKey) -> None:
        """Start the DP reduction of one bucket (asynchronously)."""
        pstate = self.pstate
        buffer = self.buffers[key[0]]
        bucket = buffer.layout.buckets[key[1]]
        grad = buffer.bucket_grad(bucket)
        if self.grad_check is not None:
            self.grad_check(grad)
        with op_identity("grad_reduce", buffer=key[0], bucket=key[1]):
            if self.sharded:
                own = bucket.shard(pstate.dp_size, pstate.dp_rank)
                self._handles[key] = comms.reduce_scatter_flat(
                    buffer.grad[own.start:own.end], grad, pstate.dp_group, async_op=True,
                    traffic=self.traffic)
            else:
                self._handles[key] = comms.all_reduce_flat(grad, pstate.dp_group,
                                                           async_op=True, traffic=self.traffic)

    def _keys(self) -> list[BucketKey]:
        return [(b, k.index) for b, buf in enumerate(self.buffers) for k in buf.layout.buckets]

    def start_grad_sync(self, chunk_index: int) -> None:
        """Pipeline hook: chunk `chunk_index` ran its last backward; start its buckets.

        Only with --overlap-grad-reduce (otherwise `finalize_grads` reduces everything);
        under ZeRO-2/3 always, for buckets whose gradients are still accumulating.
        """
        if self.shard_grads:
            for key in self._keys():
                if (self._chunk_of[key] == chunk_index and key in self._live
                        and key not in self._deferred):
                    self._scatter(key)
            return
        if not self.overlap_grad_reduce:
            return
        for key in self._keys():
            if (self._chunk_of[key] == chunk_index and key not in self._handles
                    and key not in self._deferred):
                self._launch(key)

    def finalize_grads(self) -> None:
        """Finish the step's gradient reduction: tied embeddings, DP, then SP norms over TP."""
        with self.wait_clock:
            self._finish_reductions()
        self._finalized = True

    def _finish_reductions(self) -> None:
        pstate = self.pstate
        if self.shard_grads:
            self._finalize_sharded()
        else:
            self._finalize_full()
        if self._sp_pieces and pstate.tp_size > 1:
            grads = [self.shards[b].grad_at(Range(s, e)) for b, s, e in self._sp_pieces]
            flat = comms.all_reduce_(torch.cat(grads), pstate.tp_group)
            for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(reduced)

    def _finalize_sharded(self) -> None:
        """ZeRO-2/3: tied embeddings over the embedding group, the buckets still live (or
        never scattered: every rank must join every collective), then wait for all."""
        pstate = self.pstate
        for key in sorted(self._deferred):
            buffer = self.buffers[key[0]]
            bucket = buffer.layout.buckets[key[1]]
            live = self._live.get(key)
            if live is None:
                live = self._live[key] = buffer.new_bucket_grad(bucket, buffer.grad_dtype)
            for j in bucket.params:
                comms.all_reduce_(buffer.param_grad_view(live, bucket, j), pstate.embedding_group)
        for key in self._keys():
            if key in self._live or key not in self._scattered:
                self._scatter(key)
        self._retire(keep=0)
        self._inflight.clear()

    def _finalize_full(self) -> None:
        pstate = self.pstate
        for key in sorted(self._deferred):
            buffer = self.buffers[key[0]]
            for j in buffer.layout.buckets[key[1]].params:
                comms.all_reduce_(buffer.params[j].main_grad, pstate.embedding_group)
        for key in self._keys():
            if key not in self._handles:
                self._launch(key)
        for key in self._keys():
            handle = self._handles[key]
            if handle is not None:
                handle.wait()

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
        carry = self._update_bound_terms(lr, decoupled_lr, wd) if self.check_update else None
        norm, sums = global_norm_and_sums([g for s in self.shards for g in s.norm_pieces()],
                                          carry, self.pstate, sharded_over_dp=self.sharded,
                                          dtype=self.math_dtype)
        if sums is None or norm.is_meta:  # meta: a dry run, no values
            norm_value, terms = comms.host_scalar(norm), None
        else:
            norm_value, *terms = torch.cat([norm.reshape(1), sums]).cpu().tolist()  # 1 sync
        if not (norm.is_meta or math.isfinite(norm_value)):
            return self._skipped(norm_value, "non-finite gradient norm")
        if terms is not None and not self._update_is_finite(terms, norm_value):
            assert carry is not None
            return self._skipped(norm_value, self._update_culprits(carry, norm_value, lr,
                                                                   decoupled_lr))
        coeff = clip_coefficient(norm, self.cfg.optim.clip_grad)
        self._step += 1
        for shard in self.shards:
            shard.adamw_step(self.cfg.optim, lr, self._step, coeff, decoupled_lr, wd)
        if self.cfg.parallel.overlap_param_gather:
            self._start_param_sync(async_op=True)  # waited in the next forward's hooks
        else:
            with self.wait_clock:
                self._start_param_sync(async_op=False)
        return StepResult(norm_value, skipped=False)

    def _skipped(self, norm_value: float, why: str) -> StepResult:
        if self.on_skip is not None:
            self.on_skip(why)
        return StepResult(norm_value, skipped=True, skip_reason=why)

    def _update_bound_terms(self, lr: float, decoupled_lr: float | None, weight_decay: float
                            ) -> torch.Tensor:
        """This rank's [P (1 + lr wd), M, V, lr / (1 - b1^t)] (module docstring): the largest
        |master|, |exp_avg| and exp_avg_sq of its shards, NaN when one holds a NaN; read-only
        passes over the state, no sync."""
        rates = [lr] if decoupled_lr is None else [lr, decoupled_lr]
        top = max(rates) if all(math.isfinite(r) for r in rates) else math.nan
        optim = self.cfg.optim
        device, dtype = self.pstate.device, self.math_dtype
        largest = []
        for pick in (lambda s: s.master, lambda s: s.exp_avg, lambda s: s.exp_avg_sq):
            parts = [pick(s) for s in self.shards if pick(s).numel()]
            # aminmax: one pass, no |x| temporary, NaN through (an inf-norm is ~20x slower
            # on CPU); v >= 0, so its max is its largest magnitude
            tops = [torch.maximum(lo.neg(), hi) for lo, hi in map(torch.aminmax, parts)]
            largest.append(torch.stack([t.to(dtype) for t in tops]).max() if tops
                           else torch.zeros((), dtype=dtype, device=device))
        self._state_max = torch.stack(largest)
        bias1 = 1.0 - optim.adam_beta1 ** (self._step + 1)
        step_size = torch.full((), top / bias1, dtype=dtype, device=device)  # a fill, no copy
        return torch.stack([largest[0] * (1.0 + top * weight_decay), largest[1],
                            largest[2], step_size])

    def _update_is_finite(self, terms: list[float], norm: float) -> bool:
        """The summed bound terms say every new weight and moment is finite (docstring)."""
        decayed, moment, variance, step_size = terms
        clip = self.cfg.optim.clip_grad
        grad = min(norm, clip) if clip > 0 else norm  # bounds every clipped gradient element
        eps = self.cfg.optim.adam_eps  # > 0 once validated; 0 (set later) is 0/0 somewhere
        ratio = (moment + grad) / eps if eps > 0 else math.inf
        bounds = (ratio, step_size * ratio, decayed + step_size * ratio, variance + grad ** 2)
        return all(math.isfinite(b) and b <= self._update_limit for b in bounds)

    def _update_culprits(self, carry: torch.Tensor, norm: float, lr: float,
                         decoupled_lr: float | None) -> str:
        """The rare path after a failed update check: the ranks whose own terms fail it, and
        their numbers (collective over the norm's group, which every member joins: they all
        skip)."""
        p, m, v = self._state_max.tolist()
        rates = [lr] if decoupled_lr is None else [lr, decoupled_lr]
        mine = None
        if not self._update_is_finite(carry.tolist(), norm):
            mine = (f"rank {self.pstate.rank} (largest |weight| {p:.3g}, |Adam m| {m:.3g}, "
                    f"Adam v {v:.3g}, LR {', '.join(f'{r:.3g}' for r in rates)}, --adam-eps "
                    f"{self.cfg.optim.adam_eps:g}, gradient norm {norm:.3g})")
        group = self.pstate.world_group if self.sharded else self.pstate.mp_group
        found = [x for x in comms.all_gather_objects(mine, group, self.pstate.device) if x]
        where = "; ".join(found) if found else "no single rank (only the summed bound overflows)"
        return f"the update would not be finite on {where}"

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
        group = self.pstate.world_group if self.sharded else self.pstate.mp_group
        value = comms.host_scalar(comms.all_reduce_(count, group))
        return int(value) if math.isfinite(value) else value

    def _start_param_sync(self, async_op: bool) -> None:
        """ZeRO-1: all-gather each bucket's updated slices, first-used (last) bucket first
        (ZeRO-3 gathers a unit's buckets only when its forward needs them)."""
        if not self.sharded or self.fsdp is not None:
            return
        pstate = self.pstate
        for key in reversed(self._keys()):
            buffer = self.buffers[key[0]]
            bucket = buffer.layout.buckets[key[1]]
            own = bucket.shard(pstate.dp_size, pstate.dp_rank)
            with op_identity("param_gather", buffer=key[0], bucket=key[1]):
                self._gathers[key] = comms.all_gather_flat(
                    buffer.bucket_param(bucket), buffer.param[own.start:own.end],
                    pstate.dp_group, async_op=async_op, traffic=self.traffic)

    def _wait_gathers(self, keys: list[BucketKey], *_: object) -> None:
        """Forward pre-hook (--overlap-param-gather): this module's params must be current."""
        for key in keys:
            handle = self._gathers.pop(key, None)
            if handle is not None:
                with self.wait_clock:
                    handle.wait()

    @contextmanager
    def gathered_params(self) -> Iterator[None]:
        """Under ZeRO-3 every parameter holds its full value inside (all units gathered at
        once: for reading weights outside a forward); a no-op otherwise."""
        if self.fsdp is None:
            yield
            return
        with self.fsdp.gathered():
            yield

    def set_param(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Set a parameter (this rank's TP/PP-local tensor), e.g. from a checkpoint; under
        ZeRO-3 only its owned slice is kept. Call `reload_model_params` afterwards."""
        if self.fsdp is None:
            with torch.no_grad():
                param.copy_(value)
        else:
            self.fsdp.write_param(param, value)

    def param_tensors(self) -> list[torch.Tensor]:
        """The parameter storage kept through a step (the model's, or ZeRO-3's shards)."""
        if self.fsdp is None:
            return list(self.params)
        return [b.param.data for b in self.buffers]

    def finish_param_sync(self) -> None:
        """Wait for outstanding parameter all-gathers; call before reading model weights
        outside a forward (e.g. saving a checkpoint) under --overlap-param-gather."""
        self._wait_gathers(list(self._gathers))

    # ---- state -----------------------------------------------------------------------------

    def reload_model_params(self) -> None:
        """Take the fp32 masters from the model's current weights: call after loading model
        weights without optimizer state (the masters were copied at construction)."""
        self.finish_param_sync()
        for shard in self.shards:
            shard.copy_params_to_master()

    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradient storage kept through a step (full buffers or ZeRO-2/3 shards)."""
        return ([b.grad for b in self.buffers if b.grad is not None]
                + [s.grad for s in self.shards if s.grad is not None])

    def memory(self) -> MemoryReport:
        """What this rank's optimizer holds (the lead prints `describe()` at start-up)."""
        return MemoryReport(
            state_bytes=sum(s.nbytes() for s in self.shards),
            padding_elements=sum(s.padding() for s in self.shards),
            grad_buffer_bytes=(sum(b.nbytes() for b in self.buffers)
                               + sum(s.grad_nbytes() for s in self.shards)),
            local_params=sum(p.numel() for p in self.params),
            buffer_elements=sum(b.layout.numel for b in self.buffers),
            buffer_padding_elements=sum(b.layout.padding for b in self.buffers))

    def state_dict(self) -> dict:
        """This DP rank's optimizer state; format in `megatron_lite.optim.zero1`.

        The tensors are the live shard buffers, not copies (a copy would cost 12 bytes per
        owned element of device memory at every save): callers copy before training
        continues, as the Checkpointer does into its host buffers.
        """
        self.finish_param_sync()
        pstate = self.pstate
        return zero1.state_dict(self.shards, self._step, pstate.dp_rank, pstate.dp_size,
                                self.sharded)

    def load_state_dict(self, state: dict) -> None:
        """Restore this DP rank's state and set the model's weights from the masters.

        Collective over the DP group under --use-distributed-optimizer (every rank calls it).
        """
        self.finish_param_sync()
        pstate = self.pstate
        self._step = zero1.load_state_dict(self.shards, state, pstate.dp_rank, pstate.dp_size,
                                           self.sharded)
        for shard in self.shards:
            shard.copy_master_to_params()
        self._start_param_sync(async_op=False)
