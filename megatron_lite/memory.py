"""Memory accounting: measured activation bytes, the start-up memory report and --dry-run.

The planner (`planner.py`) predicts bytes from the config alone; this module measures what a
run really holds so the two can be compared in the start-up log: model and optimizer state
from the actual tensors, and the saved-for-backward bytes of one micro-batch, captured with
`torch.autograd.graph.saved_tensors_hooks` (each storage counted once, parameters excluded).
`LiveBytes` counts every allocation of a whole training step, which is how the meta-device
rank dry run measures the memory a GPU rank will meet.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lite.config import Config, validate
from megatron_lite.data.loader import context_parallel_index
from megatron_lite.parallel.state import ParallelState, format_grid, rank_grid
from megatron_lite.pipeline.engine import BatchContext  # the chunks' input (ModelChunk)
from megatron_lite.pipeline.partition import config_partition, stage_chunks
from megatron_lite.planner import estimate_memory, sharding_formula, stage_params

GIB = 2**30


def fmt_bytes(n: float) -> str:
    """Human-readable bytes (GiB for real models, MiB/KiB for the tiny test ones)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _tensors(value: object) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


_RESIZE_WATCHERS: list[set[int]] = []
"""The resized-storage sets of the active LiveBytes modes."""
_RESIZE = torch.UntypedStorage.resize_


def _watched_resize(storage: torch.UntypedStorage, nbytes: int) -> torch.UntypedStorage:
    """UntypedStorage.resize_, telling every active LiveBytes which storage it resized."""
    out = _RESIZE(storage, nbytes)
    for resized in _RESIZE_WATCHERS:
        resized.add(storage._cdata)
    return out


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of the storages allocated on `device` while the mode is active.

    Every op's outputs pass through here; a storage not seen before is counted with its size
    and uncounted when Python frees it (a weak reference on the storage). One storage is
    counted once however many views share it. Storages also grow and shrink outside the
    dispatcher (`UntypedStorage.resize_`): the pipeline frees a sent activation right after
    its send, and ZeRO-3 re-allocates a unit's full-size buckets just before gathering into
    them and frees them after use. So after any collective or p2p op the tracked storages
    are re-measured, once, before the next op moves the peak: a gathered unit is in the
    peak from its gather on. Only the storages that may have changed size are re-measured:
    those given to `UntypedStorage.resize_` (hooked while a LiveBytes is on) or to a mutating
    op since the last re-measure (all of them every collective was a third of the CPU time of
    a 70B rank's dry run).
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._stale = False
        self._resized: set[int] = set()
        """Keys of the storages whose size may have changed since the last re-measure."""

    def __enter__(self) -> LiveBytes:
        _RESIZE_WATCHERS.append(self._resized)
        if len(_RESIZE_WATCHERS) == 1:
            torch.UntypedStorage.resize_ = _watched_resize
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _RESIZE_WATCHERS[:] = [w for w in _RESIZE_WATCHERS if w is not self._resized]
            if not _RESIZE_WATCHERS:
                del torch.UntypedStorage.resize_

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable:  # an in-place or out= op may resize what it writes
            self._resized.update(t.untyped_storage()._cdata for t in
                                 _tensors([*args, *(kwargs or {}).values()])
                                 if t.device == self.device)
        if func.namespace == "c10d":  # storages resized around communication: re-measure
            self._remeasure()
            self._stale = True
        for t in _tensors(out):
            if t.device == self.device:
                self._track(t)
        return out

    def _track(self, t: Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._sizes:
            return
        if self._stale:
            self._remeasure()
        size = storage.nbytes()
        self._sizes[key] = size
        self._refs[key] = weakref.ref(storage, partial(self._freed, key))
        self.live += size
        self.peak = max(self.peak, self.live)

    def _freed(self, key: int, _ref: weakref.ref) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _remeasure(self) -> None:
        resized = list(self._resized)
        self._resized.clear()
        for key in resized:
            ref = self._refs.get(key)
            storage = ref() if ref is not None else None
            if storage is not None:
                self._sizes[key] = storage.nbytes()
        self.live = sum(self._sizes.values())
        self.peak = max(self.peak, self.live)
        self._stale = False

    def reset_peak(self) -> int:
        """Start a new peak from the bytes live now; returns them."""
        self._remeasure()
        self.peak = self.live
        return self.live

    def bytes_of(self, tensors: list[Tensor]) -> int:
        """Tracked bytes of the distinct storages behind `tensors` (at their current size)."""
        self._remeasure()
        keys = {t.untyped_storage()._cdata for t in tensors}
        return sum(self._sizes.get(k, 0) for k in keys)


def _chunk_inputs(chunk: nn.Module, cfg: Config, pstate: ParallelState, generator: torch.Generator
                  ) -> tuple[Tensor, Tensor | None]:
    m, b = cfg.model, cfg.train.micro_batch_size
    local = m.seq_length // pstate.cp_size
    labels = torch.randint(0, m.vocab_size, (b, local), generator=generator)
    labels = labels.to(pstate.device) if chunk.post_process else None
    if chunk.pre_process:
        return torch.randint(0, m.vocab_size, (b, local), generator=generator
                             ).to(pstate.device), labels
    s = local // (pstate.tp_size if cfg.parallel.sequence_parallel else 1)
    dtype = next(chunk.parameters()).dtype
    hidden = torch.randn(s, b, m.hidden_size, generator=generator).to(pstate.device, dtype)
    return hidden.requires_grad_(), labels


def measure_saved_bytes(chunks: list[nn.Module], cfg: Config, pstate: ParallelState) -> int:
    """Bytes autograd keeps for backward after one micro-batch's forward through every chunk.

    Runs a forward on synthetic inputs of the right shapes (tokens, or a hidden state for a
    chunk that starts mid-model), so it needs no pipeline communication; TP and CP ranks run
    it together because the layers' collectives (and the CP ring) are inside.
    """
    # by storage identity: a ZeRO-3 weight's bytes (and address) come and go with its gathers
    owned = {t.untyped_storage()._cdata for c in chunks
             for t in [*c.parameters(), *c.buffers()]}
    # storage address -> one tensor on it, alive until counted so that no address repeats
    saved: dict[int, Tensor] = {}

    def pack(t: Tensor) -> None:
        # The graph keeps nothing: a saved output tensor held by its own graph node is a
        # reference cycle through C++ that Python's collector cannot free, so the
        # micro-batch's activations (and the process groups its nodes name) would otherwise
        # live until the process exits.
        storage = t.untyped_storage()
        if storage._cdata not in owned:
            saved.setdefault(storage.data_ptr(), t)

    def unpack(_: None) -> Tensor:
        raise RuntimeError("the memory-measurement forward has no backward")

    generator = torch.Generator().manual_seed(0)
    batch = BatchContext()
    if pstate.cp_size > 1:
        batch = BatchContext(token_index=context_parallel_index(
            cfg.model.seq_length, pstate.cp_size, pstate.cp_rank).to(pstate.device))
    outputs = []
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        for chunk in chunks:
            x, labels = _chunk_inputs(chunk, cfg, pstate, generator)
            outputs.append(chunk(x, labels, batch))
    del outputs
    total = sum(t.untyped_storage().nbytes() for t in saved.values())
    saved.clear()  # the graph holds `pack`, whose closure holds these tensors: break the cycle
    return total


def sharding_summary(cfg: Config, dp: int, params: int, state_bytes: float | None = None
                     ) -> str:
    """The DP sharding strategy's bytes-per-parameter formula at this DP size, and (given the
    states' bytes) the B/param measured on this rank beside it."""
    strategy = cfg.parallel.data_parallel_sharding_strategy
    form, per_param = sharding_formula(strategy, dp, cfg.train.bf16,
                                       cfg.parallel.grad_reduce_in_bf16)
    line = (f"sharding {strategy} over d={dp}: {form} = {per_param:.3f} B/param x "
            f"{params:,} = {fmt_bytes(per_param * params)}")
    if cfg.train.fp8_param_gather:  # optim/fp8_params.py: the fp8 copy, and which bf16 stays
        e = 2 if cfg.train.bf16 else 4
        now, was = ((f"1/d + {e}/d", f"{e}/d") if strategy == "optim_grads_params"
                    else (f"1 + {e}/d", f"{e}"))
        line += f"; the FP8 linears' weights (--fp8-param-gather): {now} in place of {was}"
    if state_bytes is not None:
        line += f"; measured {state_bytes / max(1, params):.3f} B/param"
    return line


def memory_report(cfg: Config, pstate: ParallelState, chunks: list[nn.Module],
                  optimizer_bytes: int, grad_bytes: int, param_bytes: int | None = None,
                  fp8_state_bytes: int | None = None) -> str:
    """Measured state and activation bytes of this rank next to the planner's estimate;
    `param_bytes` is what the optimizer keeps (ZeRO-3: the shards), default the model's;
    `fp8_state_bytes` what the delayed FP8 recipe's amax tables hold (None: no such tables)."""
    if param_bytes is None:
        params = {id(p): p for c in chunks for p in c.parameters()}
        param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    est = estimate_memory(cfg, pstate.world_size, stage=pstate.pp_rank,
                          fused_kernels=chunks[0].layers[0].attention.use_triton
                          if len(chunks[0].layers) else False, device_type=pstate.device.type)
    lines = [f"memory (rank {pstate.rank}, stage {pstate.pp_rank}): measured | planner",
             f"  parameters  {fmt_bytes(param_bytes)} | {fmt_bytes(est.param_bytes)}",
             f"  gradients   {fmt_bytes(grad_bytes)} | {fmt_bytes(est.grad_bytes)}",
             f"  optimizer   {fmt_bytes(optimizer_bytes)} | {fmt_bytes(est.optimizer_bytes)}",
             "  " + sharding_summary(cfg, pstate.dp_size, est.params,
                                     param_bytes + grad_bytes + optimizer_bytes)]
    if fp8_state_bytes is not None or est.fp8_state_bytes:
        lines.append(f"  fp8 amax histories (--fp8-amax-history-len "
                     f"{cfg.train.fp8_amax_history_len}) {fmt_bytes(fp8_state_bytes or 0)} | "
                     f"{fmt_bytes(est.fp8_state_bytes)}")
    if pstate.device.type == "cpu":
        saved = measure_saved_bytes(chunks, cfg, pstate)
        ratio = est.activation_bytes_per_microbatch / saved if saved else float("nan")
        lines.append(f"  activations per micro-batch (saved for backward) {fmt_bytes(saved)} | "
                     f"{fmt_bytes(est.activation_bytes_per_microbatch)} (planner/measured "
                     f"{ratio:.3f})")
    lines.append(f"  planner peak activations ({est.in_flight} micro-batch chunk(s) in flight) "
                 f"{fmt_bytes(est.activation_bytes)}; total {fmt_bytes(est.total_bytes)}")
    return "\n".join(lines)


def dry_run_report(cfg: Config, world_size: int) -> str:
    """Validate and describe a layout without creating any process group."""
    validate(cfg, world_size)
    model, parallel = cfg.model, cfg.parallel
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    part = config_partition(cfg, pp)
    cp = parallel.context_parallel_size
    cp_dim = f"cp {cp} x " if cp > 1 else ""
    lines = [f"dry run: world size {world_size} = pp {pp} x dp "
             f"{world_size // (tp * cp * pp)} x {cp_dim}tp {tp}; config is valid",
             f"rank grid [pp][dp{'][cp' if cp > 1 else ''}] -> tp ranks:",
             format_grid(rank_grid(world_size, tp, pp, cp), full=cfg.logging.log_rank_grid),
             "stage partition:"]
    for stage in range(pp):
        specs = stage_chunks(part, stage)
        layers = sum(len(s.layer_ids) for s in specs)
        chunks = "; ".join(f"chunk {i}: layers {s.layer_ids[0]}-{s.layer_ids[-1]}"
                           if s.layer_ids else f"chunk {i}: no layers"
                           for i, s in enumerate(specs))
        est = estimate_memory(cfg, world_size, stage=stage)
        params = stage_params(model, tp, pp, stage, layers, part.v_shape)
        lines.append(f"  stage {stage}: {chunks} | {params:,} params per rank | states "
                     f"{fmt_bytes(est.state_bytes)} + activations "
                     f"{fmt_bytes(est.activation_bytes)}"
                     + (f" + fp8 amax histories {fmt_bytes(est.fp8_state_bytes)}"
                        if est.fp8_state_bytes else "")
                     + f" = {fmt_bytes(est.total_bytes)}")
        lines.append("    " + sharding_summary(cfg, world_size // (tp * pp), params))
    return "\n".join(lines)
