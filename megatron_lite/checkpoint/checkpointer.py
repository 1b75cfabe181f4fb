"""Saving and loading a training run: the training loop's only view of checkpoints.

Save (every rank, collectively): rank 0 prepares `iter_XXXXXXX.tmp/`; each rank copies its
own state to host memory (weights of its (tp, pp) slice on DP rank 0, with EP > 1 its EP
rank's experts on expert-DP rank 0, its optimizer shards, its RNG and loader state) and
writes it, in parallel with every other rank; then the file sizes are gathered and rank 0
commits (see files.py). Before any of that the ranks agree that
every weight and optimizer tensor is finite: a save of NaN/Inf is refused with the tensors
named, nothing written and nothing deleted (a --save-keep-last rotation would otherwise drop
the last good checkpoint for a poisoned one). With --async-save the writes run in a
background thread while training continues; the commit happens at the first iteration where
every rank has finished (one tiny all-reduce per iteration while a save is in flight), and
a new save first waits for the previous one.

Load: `latest` (or --ckpt-step) under --load (default --save). Before any rank reads a
tensor, the ranks verify the checkpoint's files against the sizes and sha256 sums in its
metadata (each rank hashes every world_size-th file) and agree on the verdict in one small
collective, so a bad file stops every rank at the same point instead of leaving some in a
collective. A corrupt or partial newest checkpoint is reported by name and the next older
complete one is tried (--no-ckpt-fallback stops instead). The same layout reads only its own
files; any other layout gathers full tensors and re-slices them (reshard.py). RNG states are
restored when the layout is unchanged (they are per rank).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import platform
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import safetensors
import torch
import torch.distributed as dist
from torch import Tensor, nn

from megatron_lite.checkpoint import files as ckpt_files
from megatron_lite.checkpoint.reshard import (
    CheckpointReader,
    direct_optimizer_state,
    fill_optimizer_state,
    is_tied_copy,
    local_slice,
    model_parameters,
)
from megatron_lite.config import (
    Config,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    TrainConfig,
    data_parallel_size,
    schedule_lengths,
)
from megatron_lite.data.format import find_manifest
from megatron_lite.data.loader import MicroBatchLoader
from megatron_lite.errors import found_on_rank
from megatron_lite.layers import tags
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState
from megatron_lite.pipeline.partition import config_partition, stage_chunks
from megatron_lite.provenance import git_commit


def layout_partition(cfg: Config, pp_size: int) -> list[list[list[int]]]:
    """partition[stage][chunk] = global layer ids (JSON-able); ZBV's V included, so a
    checkpoint saved under one schedule reshards into any other."""
    part = config_partition(cfg, pp_size)
    return [[list(spec.layer_ids) for spec in stage_chunks(part, s)] for s in range(pp_size)]


def _sha256(path: str | Path | None) -> str | None:
    if path is None or not Path(path).is_file():
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def data_fingerprint(cfg: Config) -> dict:
    """What the data position refers to: mock data or the manifests' and tokenizer's hashes."""
    data = cfg.data
    manifests = {path: _sha256(find_manifest(path)) for path in data.data_path
                 if find_manifest(path)}
    return {"mock_data": data.mock_data, "data_path": list(data.data_path), "split": data.split,
            "manifest_sha256": manifests, "tokenizer_sha256": _sha256(data.tokenizer_model)}


GIB = 2**30


class HostStaging:
    """The host memory a save goes through: one bounded staging buffer, reused across saves.

    A save must not hold a second device copy of the weights and optimizer state (12 bytes
    per owned element: a job near capacity would run out of memory exactly when it
    checkpoints), nor pin host memory the size of the rank's state for the whole run (an 8B
    rank on 8 GPUs: ~12 GB page-locked, taken from the OS and the data loaders). So bytes
    leave the device through one uint8 buffer of at most `limit_bytes` (pinned when the
    source is on CUDA, so each piece is one DMA), piece after piece (`pieces`):

    - a plain save streams each file: copy a piece into the buffer, write it, next piece;
    - --async-save must hold the step's state while training goes on, so `stage` fills
      pageable host copies per (file, name) through the buffer; the writer thread writes
      them. They are kept for the next save (same shapes: same memory).

    The buffer is `min(limit_bytes, bytes of the largest file so far)`. Meta tensors (a
    --dry-run on the meta device) have no data: they pass through unchanged. Reuse is safe
    because `Checkpointer.save` first waits for the previous save's writer.
    """

    def __init__(self, limit_bytes: int = 2 * GIB) -> None:
        if limit_bytes < 1:
            raise ValueError(f"staging buffer of {limit_bytes} bytes")
        self.limit = int(limit_bytes)
        self.buffers: dict[tuple[str, str], Tensor] = {}
        """--async-save's pageable host copies, per (file, name)."""
        self.buffer: Tensor | None = None
        """The staging buffer (uint8), allocated on first use."""

    def _staging(self, need: int, pinned: bool) -> Tensor:
        size = min(self.limit, need)
        buf = self.buffer
        if buf is None or buf.numel() < size or (pinned and not buf.is_pinned()):
            self.buffer = None  # the old one goes back before the new one is taken
            self.buffer = torch.empty(max(size, 0 if buf is None else buf.numel()),
                                      dtype=torch.uint8, pin_memory=pinned)
        return self.buffer

    def pieces(self, tensors: Sequence[Tensor]) -> Iterator[np.ndarray]:
        """The tensors' bytes back to back, one staging buffer's worth at a time (a piece
        may end inside a tensor); each piece is valid until the next one is asked for."""
        flats = [ckpt_files.tensor_bytes(t) for t in tensors if t.numel()]
        total = sum(f.numel() for f in flats)
        if not total:
            return
        device = next((f.device for f in flats if f.device.type == "cuda"), None)
        buf = self._staging(total, pinned=device is not None)
        capacity, fill = buf.numel(), 0
        for flat in flats:
            start = 0
            while start < flat.numel():
                n = min(flat.numel() - start, capacity - fill)
                buf[fill:fill + n].copy_(flat[start:start + n], non_blocking=flat.is_cuda)
                fill, start = fill + n, start + n
                if fill == capacity:
                    yield self._ready(buf, fill, device)
                    fill = 0
        if fill:
            yield self._ready(buf, fill, device)

    @staticmethod
    def _ready(buf: Tensor, n: int, device: torch.device | None) -> np.ndarray:
        if device is not None:
            torch.cuda.current_stream(device).synchronize()  # the piece's DMA is done
        return buf[:n].numpy()

    def stage(self, file: str, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Pageable host copies of `file`'s tensors (--async-save), complete on return."""
        out = {}
        for name, src in tensors.items():
            if src.device.type == "meta":
                out[name] = src
                continue
            buf = self.buffers.get((file, name))
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype)
                self.buffers[(file, name)] = buf
            if src.device.type == "cpu":
                buf.copy_(src.detach())
            else:
                dst, offset = ckpt_files.tensor_bytes(buf), 0
                for piece in self.pieces([src]):
                    dst[offset:offset + len(piece)].copy_(torch.from_numpy(piece))
                    offset += len(piece)
            out[name] = buf
        return out

    def finish(self) -> None:
        """Kept for callers: every copy is complete when `stage` or a piece returns."""

    def allocated_bytes(self) -> int:
        """Host bytes this staging holds: the buffer and --async-save's copies."""
        held = [self.buffer] if self.buffer is not None else []
        return sum(t.untyped_storage().nbytes() for t in [*held, *self.buffers.values()])


FREE_SPACE_MARGIN = 1.1
"""A save needs its tensor bytes times this free (headers, metadata, the filesystem's slack)."""


class _SaveJob:
    """One rank's part of one save: host copies of its tensors, written by `run()`."""

    def __init__(self, tmp: Path, items: list[tuple[str, dict[str, Tensor], dict]],
                 on_file_written: Callable[[], None] | None = None,
                 pieces: ckpt_files.Pieces | None = None, write: bool = True) -> None:
        self.tmp, self.items, self.on_file_written = tmp, items, on_file_written
        self.pieces = pieces
        """How the tensors' bytes reach the file (None: they are host copies already)."""
        self.write = write
        """False on the meta device (a dry run): no bytes to write; each file is counted with
        the tensor bytes it would hold and no checksum."""
        self.written: dict[str, tuple[int, str]] = {}
        """File name -> (bytes, sha256)."""
        self.error: str | None = None
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        try:
            for name, tensors, meta in self.items:
                if not self.write:
                    self.written[name] = (sum(t.numel() * t.element_size()
                                              for t in tensors.values()), "")
                    continue
                self.written[name] = ckpt_files.write_tensors(self.tmp / name, tensors, meta,
                                                              self.pieces)
                if self.on_file_written is not None:
                    self.on_file_written()
        except Exception as e:  # reported to every rank at commit, never swallowed
            self.error = f"{type(e).__name__}: {e}"
        self.items = []  # the staged tensors stay with the Checkpointer for the next save

    @property
    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()


class Stateful(Protocol):
    """Run state kept in the checkpoint metadata; `state_dict()` must be JSON-able and the
    same on every rank (rank 0's is stored)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Checkpointer:
    """--save / --load / intervals for one run; every method is called by every rank.

    `extra_state` objects (e.g. {"reliability": guard}) are saved in the metadata as JSON
    and restored on load when the checkpoint has them.

    Files are per (tp, pp, dp) position with CP folded into DP (`gradient_replicas`): a CP
    rank holds the same parameters as its peers, so a checkpoint's "dp" counts DP x CP
    replicas and any CP size reads it like a change of DP size. With EP > 1 the routed
    experts are per (tp, pp, ep) position, their optimizer state per (tp, pp, ep, expert-dp):
    the EP ranks are DP ranks holding different experts (reshard.py reassembles them).
    """

    def __init__(self, cfg: Config, pstate: ParallelState, chunks: list[nn.Module],
                 optimizer: Optimizer, train_loader: MicroBatchLoader,
                 extra_state: dict[str, Stateful] | None = None) -> None:
        self.cfg, self.pstate, self.chunks = cfg, pstate.gradient_replicas(), chunks
        self.optimizer, self.loader = optimizer, train_loader
        self.extra_state = dict(extra_state or {})
        self.on_file_written: Callable[[], None] | None = None
        """Called after each file this rank writes (in the writer thread with --async-save);
        the reliability guard points it at the fault injector's `*_in_save` faults."""
        self.on_save: Callable[[int, float, float], None] | None = None
        """Called on every rank after each committed save with (iteration, seconds, GB);
        the training loop points it at MetricsLogger.log_checkpoint."""
        ckpt_cfg = cfg.checkpoint
        self.save_dir = Path(ckpt_cfg.save) if ckpt_cfg.save else None
        load = ckpt_cfg.load or ckpt_cfg.save
        self.load_dir = Path(load) if load else None
        self.tied = not cfg.model.untie_embeddings_and_output_weights
        self.partition = layout_partition(cfg, pstate.pp_size)
        self._pending: tuple[_SaveJob, int, dict, float, float] | None = None
        self._on_disk: int | None = None
        self._last_save_time = time.monotonic()
        self.staging = HostStaging(int(ckpt_cfg.ckpt_staging_buffer_gb * GIB))

    # ---- collectives ---------------------------------------------------------------------

    def _barrier(self) -> None:
        if self.pstate.distributed:
            comms.barrier(self.pstate.world_group, self.pstate.device, kind="world")

    def _all_reduce(self, value: float, op: dist.ReduceOp) -> float:
        scalar = torch.tensor([value], dtype=torch.float64 if self.pstate.device.type == "cpu"
                              else torch.float32, device=self.pstate.device)
        return comms.host_scalar(comms.all_reduce_(scalar, self.pstate.world_group, op=op,
                                                    kind="world"))

    def _gather(self, obj: object) -> list:
        return comms.all_gather_objects(obj, self.pstate.world_group, self.pstate.device,
                                        kind="world")

    # ---- saving --------------------------------------------------------------------------

    def snapshot(self, copy: bool | None = None) -> list[tuple[str, dict[str, Tensor], dict]]:
        """This rank's files: its live tensors, written before training goes on (a plain
        save streams them through the staging buffer), or with `copy` (default
        --async-save) host copies, since training changes the originals meanwhile; never a
        device copy. Called by `save`, and by the meta-device dry run, which measures that
        it allocates nothing on the device."""
        pstate = self.pstate
        if copy is None:
            copy = self.cfg.checkpoint.async_save

        def stage(file: str, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
            return self.staging.stage(file, tensors) if copy else {
                k: v.detach() for k, v in tensors.items()}

        split_experts = pstate.experts_apart  # own files per (EP, expert-TP) position

        def weights_item(file: str, experts: bool) -> tuple[str, dict[str, Tensor], dict]:
            weights, splits, in_optimizer = {}, {}, []
            for name, local, param in model_parameters(self.chunks, self.tied):
                if (not is_tied_copy(local, self.tied)
                        and (split_experts and tags.is_expert(param)) == experts):
                    if self.optimizer.weight_in_optimizer(param):
                        in_optimizer.append(name)
                    else:
                        weights[name] = param.detach()
                    splits[name] = tags.tp_split(param)
            weight_meta = {"tp_split": splits, "in_optimizer": in_optimizer,
                           "tp_rank": pstate.etp_rank if experts else pstate.tp_rank,
                           "pp_rank": pstate.pp_rank, **({"ep_rank": pstate.ep_rank}
                                                         if experts else {})}
            return file, stage(file, weights), weight_meta

        def optim_item(file: str, state: dict) -> tuple[str, dict[str, Tensor], dict]:
            skeleton, tensors = ckpt_files.flatten_state(state)
            return file, stage(file, tensors), {"state": skeleton}

        items = []
        tp, pp = pstate.tp_rank, pstate.pp_rank
        if pstate.dp_rank == 0:
            items.append(weights_item(ckpt_files.model_file(tp, pp), experts=False))
        state = self.optimizer.state_dict()
        expert_state = state.pop("expert", None)
        if self.optimizer.sharded or pstate.dp_rank == 0:
            items.append(optim_item(ckpt_files.optim_file(tp, pp, pstate.dp_rank), state))
        edp, etp = pstate.expert_replicas.rank, pstate.etp_rank
        if split_experts and edp == 0:  # one writer per position: its expert-DP rank 0
            items.append(weights_item(ckpt_files.expert_model_file(etp, pp, pstate.ep_rank),
                                      experts=True))
        if expert_state is not None and (self.optimizer.sharded or edp == 0):
            items.append(optim_item(ckpt_files.expert_optim_file(etp, pp, pstate.ep_rank, edp),
                                    expert_state))
        rng = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["torch_cuda"] = torch.cuda.get_rng_state(pstate.device)
        np_state = np.random.get_state()
        meta = {"rank": pstate.rank, "python_random": random.getstate(),
                "numpy_random": [np_state[0], np_state[1].tolist(), *np_state[2:]],
                "loader": self.loader.state_dict()}
        items.append((ckpt_files.rank_file(pstate.rank), rng, meta))
        return items

    def _metadata(self) -> dict:
        pstate, parallel = self.pstate, self.cfg.parallel
        return {
            "consumed_samples": self.loader.consumed_samples,
            "scheduler_samples": self.loader.scheduler_samples,  # the LR's position
            "data_stream_dp": self.loader.stream_dp,  # node-local: the streams' DP layout
            "has_optimizer": True,
            "config": ckpt_files.redact(self.cfg.to_dict(), ckpt_files.secret_values()),
            "layout": {"world_size": pstate.world_size, "tp": pstate.tp_size, "pp": pstate.pp_size,
                       "dp": pstate.dp_size, "cp": parallel.context_parallel_size,
                       "ep": pstate.ep_size, "etp": pstate.etp_size,
                       "virtual_chunks": len(self.partition[0]),
                       "use_distributed_optimizer": parallel.use_distributed_optimizer,
                       "weights_in_optimizer": self.optimizer.shard_params},
            "partition": self.partition,
            "seed": self.cfg.train.seed,
            "versions": {"torch": torch.__version__, "numpy": np.__version__,
                         "safetensors": safetensors.__version__,
                         "python": platform.python_version()},
            "git_commit": git_commit(),
            "data": data_fingerprint(self.cfg),
            "extra_state": {k: v.state_dict() for k, v in self.extra_state.items()},
        }

    def save(self, iteration: int) -> None:
        """Write a checkpoint of the state after `iteration` (async with --async-save)."""
        assert self.save_dir is not None
        # The previous save's writer must be done before `snapshot` overwrites the host
        # buffers it is writing from (HostStaging reuses them): keep this wait first.
        self.wait()
        start = time.perf_counter()
        self.optimizer.finish_param_sync()
        self._refuse_non_finite(iteration)
        tmp = self.save_dir / (ckpt_files.iter_dir_name(iteration) + ".tmp")
        if self.pstate.rank == 0:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            ckpt_files.clear_stale(self.save_dir)
            tmp.mkdir()
        self._barrier()
        copy = self.cfg.checkpoint.async_save
        job = _SaveJob(tmp, self.snapshot(copy), self.on_file_written,
                       None if copy else self.staging.pieces,
                       write=self.pstate.device.type != "meta")
        self._check_free_space(iteration, job)
        meta = self._metadata() if self.pstate.rank == 0 else {}
        blocking = time.perf_counter() - start
        self._pending = (job, iteration, meta, start, blocking)
        self._last_save_time = time.monotonic()
        if self.cfg.checkpoint.async_save:
            job.thread = threading.Thread(target=job.run, name="checkpoint-writer", daemon=True)
            job.thread.start()
        else:
            job.run()
            self._commit()

    def _non_finite_tensors(self) -> list[str]:
        """Names of this rank's weights and optimizer tensors that hold a NaN/Inf: one
        read-only pass (each one's min and max, NaN/Inf through) and one sync."""
        named = [(name, param.detach())  # the others' masters are checked below
                 for name, _, param in model_parameters(self.chunks, self.tied)
                 if not self.optimizer.weight_in_optimizer(param)]
        state = self.optimizer.state_dict()
        for prefix, part in (("", state), ("expert ", state.get("expert", {}))):
            named += [(f"optimizer {prefix}{k}", t) for k, t in part.get("tensors", {}).items()]
        named = [(n, t) for n, t in named if t.is_floating_point() and t.numel()]
        if not named or named[0][1].is_meta:
            return []
        ends = [torch.stack(torch.aminmax(t)).double() for _, t in named]  # NaN through
        finite = torch.isfinite(torch.stack(ends)).all(dim=1).tolist()
        return [n for (n, _), ok in zip(named, finite) if not ok]

    def _refuse_non_finite(self, iteration: int) -> None:
        """Every rank: raise (before anything is written) when some rank's state is not
        finite; one small all-reduce per save, a gather of the names only when it is."""
        bad = self._non_finite_tensors()
        found = self._all_reduce(float(bool(bad)), dist.ReduceOp.MAX)
        if not found or math.isnan(found):  # NaN: a dry run on meta tensors, no values
            return
        where = [f"rank {r}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                 for r, names in enumerate(self._gather(bad)) if names]
        kept = ckpt_files.list_iterations(self.save_dir)
        last = (f"the newest checkpoint there, iteration {kept[-1]}, is kept" if kept else
                "no checkpoint was there")
        err = ckpt_files.CheckpointError(
            f"refusing to save iteration {iteration} to {self.save_dir}: non-finite values "
            f"(NaN/Inf) in {'; '.join(where)}. Nothing was written and nothing deleted; {last}. "
            "Resume from it and look for the cause in the events above (the NaN/Inf guard "
            "skips non-finite gradients and updates unless --no-check-for-nan-in-loss-and-grad)")
        err.same_on_every_rank = True  # type: ignore[attr-defined]
        raise err

    def _check_free_space(self, iteration: int, job: _SaveJob) -> None:
        """Refuse a save the disk cannot hold before a byte of it is written (collective): a
        disk that fills mid-save leaves a partial checkpoint, and every later save fails too.
        Checked against the tensor bytes of all ranks (the save directory is shared)."""
        if not job.write:
            return
        need = float(sum(t.numel() * t.element_size() for _, tensors, _ in job.items
                         for t in tensors.values()))
        total = self._all_reduce(need, dist.ReduceOp.SUM)
        free = float(shutil.disk_usage(job.tmp).free)
        short = self._all_reduce(float(total * FREE_SPACE_MARGIN > free), dist.ReduceOp.MAX)
        if not short:
            return
        if self.pstate.rank == 0:
            shutil.rmtree(job.tmp, ignore_errors=True)
        raise ckpt_files.CheckpointError(
            f"saving iteration {iteration} to {self.save_dir}: needs about {total / 1e9:.3f} GB "
            f"(x{FREE_SPACE_MARGIN:g} margin) but only {free / 1e9:.3f} GB are free there (on "
            "at least one rank); free space (fewer --save-keep-last) or point --save at a "
            "larger filesystem. The previous checkpoint is kept")

    def _commit(self) -> None:
        job, iteration, meta, start, blocking = self._pending
        if job.thread is not None:
            job.thread.join()
            blocking_wait = 0.0
        else:
            blocking_wait = time.perf_counter() - start - blocking
        self._pending = None
        reports = self._gather((job.written, job.error))
        errors = [f"rank {r}: {err}" for r, (_, err) in enumerate(reports) if err]
        if errors:
            raise ckpt_files.CheckpointError(
                f"saving iteration {iteration} to {job.tmp} failed (previous checkpoint "
                "kept):\n  " + "\n  ".join(errors))
        written = {name: info for infos, _ in reports for name, info in infos.items()}
        files = {name: size for name, (size, _) in written.items()}
        if self.pstate.rank == 0:
            sums = {name: digest for name, (_, digest) in written.items()}
            final = ckpt_files.commit(self.save_dir, job.tmp, iteration,
                             {**meta, "files": files, "sha256": sums},
                             self.cfg.checkpoint.save_keep_last)
        seconds = time.perf_counter() - start
        gb = sum(files.values()) / 1e9
        if self.on_save is not None:
            self.on_save(iteration, seconds, gb)
        if self.pstate.rank == 0:
            print(f"checkpoint: saved iteration {iteration} to {final}: {gb:.4f} GB from "
                  f"{len(files)} files in {seconds:.3f} s ({gb / seconds:.3f} GB/s); training "
                  f"blocked {blocking + blocking_wait:.3f} s", flush=True)
        self._barrier()
        self._on_disk = iteration

    def wait(self) -> None:
        """Finish an in-flight async save (collective)."""
        if self._pending is not None:
            self._commit()

    def poll(self) -> None:
        """Commit an async save once every rank's writer is done (collective, cheap)."""
        if self._pending is not None:
            done = self._all_reduce(float(self._pending[0].done), dist.ReduceOp.MIN)
            if done:
                self._commit()

    def after_step(self, iteration: int) -> bool:
        """Save when an interval is due; True when --exit-interval says stop now."""
        ckpt_cfg = self.cfg.checkpoint
        self.poll()
        exit_now = bool(ckpt_cfg.exit_interval) and iteration % ckpt_cfg.exit_interval == 0
        if self.save_dir is not None:
            interval, minutes = ckpt_cfg.save_interval, ckpt_cfg.save_interval_minutes
            due = exit_now or bool(interval and iteration % interval == 0)
            if minutes:
                late = time.monotonic() - self._last_save_time >= 60 * minutes
                due |= self._all_reduce(float(late and self.pstate.rank == 0),
                                        dist.ReduceOp.MAX) > 0
            if due:
                self.save(iteration)
        if exit_now:
            self.wait()
            if self.pstate.rank == 0:
                print(f"exiting at iteration {iteration} (--exit-interval "
                      f"{ckpt_cfg.exit_interval})", flush=True)
        return exit_now

    def finish(self, iteration: int) -> None:
        """End of training: save the final state unless it is on disk or being written
        (--async-save's save of the last interval); wait."""
        in_flight = self._pending[1] if self._pending is not None else None
        if self.save_dir is not None and iteration not in (self._on_disk, in_flight):
            self.save(iteration)
        self.wait()

    # ---- loading -------------------------------------------------------------------------

    def load(self, *, restore_extra: bool = True) -> int:
        """Restore from --load (or --save) if a checkpoint is there; the iteration to resume
        after (0 for a fresh start). A rollback within a run passes `restore_extra=False`:
        what happened since the checkpoint (e.g. the spikes) stays in the run's history."""
        ckpt_cfg = self.cfg.checkpoint
        if self.load_dir is None:
            return 0
        start = time.perf_counter()
        ckpt_dir = self._verified_checkpoint()
        if ckpt_dir is None:
            if ckpt_cfg.load and ckpt_cfg.load != ckpt_cfg.save:
                raise ckpt_files.CheckpointError(
                    f"--load {ckpt_cfg.load}: no checkpoint there (no `latest`, no iter_* "
                    "directory); check the path")
            if self.pstate.rank == 0:
                print(f"checkpoint: none in {self.load_dir}, starting from scratch", flush=True)
            return 0
        reader = CheckpointReader(ckpt_dir)
        self._validate(reader)
        if restore_extra and not ckpt_cfg.finetune:
            # first: --fp8-param-gather casts the loaded weights with the FP8 histories' scales
            saved_extra = reader.meta.get("extra_state", {})
            for key, obj in self.extra_state.items():
                if key in saved_extra:
                    obj.load_state_dict(saved_extra[key])
        self._load_weights(reader)
        if ckpt_cfg.finetune:
            if self.pstate.rank == 0:
                print(f"checkpoint: --finetune: loaded the weights of {ckpt_dir}; starting at "
                      "iteration 0 with a fresh optimizer and data position", flush=True)
            return 0
        if not ckpt_cfg.no_load_optim:
            self._load_optimizer(reader)
        restored_rng = self._load_rank_state(reader)
        iteration = int(reader.meta["iteration"])
        if self.save_dir is not None and ckpt_dir.parent.resolve() == self.save_dir.resolve():
            self._on_disk = iteration
        total = self._all_reduce(float(reader.bytes_read), dist.ReduceOp.SUM)
        seconds = time.perf_counter() - start
        if self.pstate.rank == 0:
            saved = reader.meta["layout"]
            cp = saved.get("cp", 1)  # the layout's "dp" counts dp x cp ranks (its shards)
            print(f"checkpoint: loaded iteration {iteration} from {ckpt_dir} (saved with tp "
                  f"{saved['tp']}, pp {saved['pp']}, dp {saved['dp'] // cp}"
                  f"{f', cp {cp}' if cp > 1 else ''}"
                  f"{f', ep {reader.ep}' if reader.ep > 1 else ''}): {total / 1e9:.4f} GB "
                  f"read in {seconds:.3f} s ({total / 1e9 / seconds:.3f} GB/s); RNG "
                  f"{'restored' if restored_rng else 'not restored'}"
                  f"{'' if restored_rng else ' (layout changed or --no-load-rng)'}",
                  flush=True)
        return iteration

    def _verify(self, ckpt_dir: Path) -> str | None:
        """Collective: every rank's verdict on `ckpt_dir` (None = intact). Each rank checks
        the metadata and hashes its share of the files; one all-gather of the findings."""
        problem = None
        try:
            meta = ckpt_files.read_metadata(ckpt_dir)
            names = sorted(meta["files"])[self.pstate.rank::self.pstate.world_size]
            ckpt_files.verify_checksums(ckpt_dir, meta, names)
        except ckpt_files.CheckpointError as e:
            problem = str(e)
        found = [p for p in self._gather(problem) if p]
        return "; ".join(dict.fromkeys(found)) if found else None

    def _verified_checkpoint(self) -> Path | None:
        """The newest intact checkpoint to load (None: none there). A broken one is named on
        every rank, then the next older one is tried unless --no-ckpt-fallback."""
        assert self.load_dir is not None
        ckpt_cfg = self.cfg.checkpoint
        candidates = ckpt_files.checkpoint_candidates(self.load_dir, ckpt_cfg.ckpt_step)
        for i, ckpt_dir in enumerate(candidates):
            problem = self._verify(ckpt_dir)
            if problem is None:
                return ckpt_dir
            if not ckpt_cfg.ckpt_fallback or i + 1 == len(candidates):
                why = ("--no-ckpt-fallback: stopping instead of loading an older checkpoint"
                       if not ckpt_cfg.ckpt_fallback
                       else "no older complete checkpoint to fall back to")
                raise ckpt_files.CheckpointError(f"{problem}\n{why}; pick one with --ckpt-step, "
                                                 "or move the broken directory away")
            print(f"checkpoint: rank {self.pstate.rank}: {problem}; falling back to the "
                  f"previous checkpoint {candidates[i + 1]}", flush=True)
        return None

    def _validate(self, reader: CheckpointReader) -> None:
        saved = reader.meta["config"]
        diffs = ckpt_files.model_mismatches(saved["model"], self.cfg.to_dict()["model"])
        if diffs:
            raise ckpt_files.CheckpointError(
                f"{reader.dir} holds a different model than this run's config:\n  "
                + "\n  ".join(diffs) + "\npass the checkpoint's values (or load another one)")
        saved_data = reader.meta.get("data")  # absent in imported (never trained) checkpoints
        if saved_data and saved_data != data_fingerprint(self.cfg) and self.pstate.rank == 0:
            print(f"checkpoint: warning: the data (--data-path, --split, manifests or tokenizer)"
                  f" differs from the one {reader.dir} was trained on; the data position "
                  "refers to the old data", flush=True)

    @torch.no_grad()
    def _load_weights(self, reader: CheckpointReader) -> None:
        pstate = self.pstate
        for name, _local, param in model_parameters(self.chunks, self.tied):
            tensor = None
            expert = name in reader.experts
            same = ((reader.ep, reader.etp) == (pstate.ep_size, pstate.etp_size) if expert
                    else reader.tp == pstate.tp_size)
            if same:
                split = reader.where.get(name, (0, None))[1]
                tp_rank = (pstate.etp_rank if expert else pstate.tp_rank) if split else 0
                tensor = reader.local_weight(name, tp_rank, pstate.ep_rank)
            if tensor is None or tensor.shape != param.shape:
                tensor = local_slice(reader.full_weight(name), param, pstate)
            self.optimizer.set_param(param, tensor)
        self.optimizer.reload_model_params()  # masters = the loaded weights

    def _load_optimizer(self, reader: CheckpointReader) -> None:
        """Read into host tensors, then `load_state_dict` copies them into the live buffers:
        the template is the live state (free, shapes and layout only), never written."""
        template = self.optimizer.state_dict()
        if reader.has_optimizer:
            state = direct_optimizer_state(reader, template, self.pstate, self.partition)
            if state is None:
                state = fill_optimizer_state(template, self.chunks, self.pstate, self.tied,
                                             reader.full_optimizer)
                _set_step(state, reader.file(ckpt_files.optim_file(0, 0, 0)).meta["state"]["step"])
        else:  # model-only (e.g. imported from Hugging Face): fresh Adam moments
            def from_weights(name: str) -> dict[str, Tensor]:
                w = reader.full_weight(name)  # fill_optimizer_state casts to the masters'
                return {"master": w, "exp_avg": torch.zeros_like(w),
                        "exp_avg_sq": torch.zeros_like(w)}

            state = fill_optimizer_state(template, self.chunks, self.pstate, self.tied,
                                         from_weights)
            _set_step(state, 0)
        self.optimizer.load_state_dict(state)

    def _load_rank_state(self, reader: CheckpointReader) -> bool:
        """RNG states, when this rank's saved counterpart exists (same layout)."""
        pstate, saved = self.pstate, reader.meta["layout"]
        # node-local data at another DP size: the loader takes over the saved layout's
        # streams where it can and says what changes (data/loader.py)
        self.loader.load_state_dict({"consumed_samples": reader.meta["consumed_samples"],
                                     "scheduler_samples": reader.meta.get(
                                         "scheduler_samples", reader.meta["consumed_samples"]),
                                     "stream_dp": reader.meta.get(
                                         "data_stream_dp", reader.dp // saved.get("cp", 1))})
        if self.loader.resume_note and pstate.rank == 0:
            print(self.loader.resume_note, flush=True)
        same = ((saved["world_size"], saved["tp"], saved["pp"])
                == (pstate.world_size, pstate.tp_size, pstate.pp_size))
        name = ckpt_files.rank_file(pstate.rank)
        if not same or name not in reader.meta["files"] or self.cfg.checkpoint.no_load_rng:
            return False
        f = reader.file(name)
        torch.set_rng_state(f.get("torch_cpu"))
        if torch.cuda.is_available() and "torch_cuda" in f:
            torch.cuda.set_rng_state(f.get("torch_cuda"), pstate.device)
        version, state, gauss = f.meta["python_random"]
        random.setstate((version, tuple(state), gauss))
        kind, keys, pos, has_gauss, cached = f.meta["numpy_random"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        return True


def _set_step(state: dict, step: int) -> None:
    """The optimizer's step count, in the dense and (EP > 1) the expert group's state."""
    for part in (state, state.get("expert", {})):
        part["step"] = step


def apply_checkpoint_args(cfg: Config, world_size: int, rank: int = 0) -> None:
    """--use-checkpoint-args / --use-checkpoint-opt_param-scheduler: replace the model (and
    MoE) section / the LR-schedule flags with those saved in the checkpoint --load (or
    --save) would load.
    Without either schedule flag a resume must keep the saved schedule, as Megatron's does.
    Runs before the model is built (every rank reads the same small metadata file); a
    missing --load is this `rank`'s finding (its node's disk may be the one without it)."""
    ckpt_cfg = cfg.checkpoint
    root = ckpt_cfg.load or ckpt_cfg.save
    ckpt_dir = ckpt_files.resolve_checkpoint_dir(Path(root), ckpt_cfg.ckpt_step) if root else None
    if ckpt_dir is None and ckpt_cfg.load and ckpt_cfg.load != ckpt_cfg.save:
        with found_on_rank(rank):  # found now, not after the model is built
            raise ckpt_files.CheckpointError(
                f"--load {ckpt_cfg.load}: no checkpoint there (no `latest`, no iter_* "
                "directory); check the path")
    if not (ckpt_cfg.use_checkpoint_args or ckpt_cfg.use_checkpoint_opt_param_scheduler):
        if ckpt_dir is not None and not ckpt_cfg.override_opt_param_scheduler:
            meta = _readable_metadata(Path(root), ckpt_cfg.ckpt_step)
            if meta is not None:
                _check_schedule_unchanged(cfg, world_size, *meta)
        return
    if ckpt_dir is None:
        raise ckpt_files.CheckpointError(
            "--use-checkpoint-args / --use-checkpoint-opt_param-scheduler read the config of "
            f"the checkpoint to load, but there is none in {root or '(no --load or --save)'}")
    saved = ckpt_files.read_metadata(ckpt_dir)["config"]
    if ckpt_cfg.use_checkpoint_args:
        cfg.model = ModelConfig(**saved["model"])
        if "moe" in saved:  # the experts are part of the model's shape
            cfg.moe = MoEConfig(**saved["moe"])
        cfg.__post_init__()  # a --step-batch-size-schedule counts the saved --seq-length
    if ckpt_cfg.use_checkpoint_opt_param_scheduler:
        schedule = {k: v for k, v in saved["optim"].items()
                    if k.startswith(("lr", "min_lr", "decoupled"))}
        cfg.optim = dataclasses.replace(cfg.optim, **schedule)


def _readable_metadata(root: Path, step: int | None) -> tuple[dict, Path] | None:
    """The metadata of the checkpoint a resume will load: the newest candidate whose metadata
    reads (a broken newest one is the checkpointer's to report and fall back from)."""
    for ckpt_dir in ckpt_files.checkpoint_candidates(root, step):
        try:
            return ckpt_files.read_metadata(ckpt_dir), ckpt_dir
        except ckpt_files.CheckpointError:
            continue
    return None


def _schedule_values(optim: OptimConfig, train: TrainConfig, dp_size: int) -> dict[str, object]:
    """What Megatron's scheduler checks on resume, in its units (lengths in samples)."""
    gbs = train.global_batch_size or train.micro_batch_size * dp_size
    lengths = schedule_lengths(optim, train, gbs)
    if optim.weight_decay_incr_style == "constant":  # a longer run leaves it unchanged
        decay: tuple = (optim.weight_decay,)
    else:  # Megatron's: the style, its ends and the samples it moves over
        samples = (train.train_samples if train.train_samples is not None
                   else (train.train_iters or 0) * gbs)
        decay = (optim.weight_decay_incr_style, optim.start_weight_decay,
                 optim.end_weight_decay, samples)
    return {"learning rate (--lr)": optim.lr, "minimum learning rate (--min-lr)": optim.min_lr,
            "warm-up samples (--lr-warmup-*)": lengths.warmup,
            "decay samples (--lr-decay-*, --train-iters/--train-samples)": lengths.decay,
            "decay style (--lr-decay-style)": optim.lr_decay_style,
            "weight decay (--weight-decay, --weight-decay-incr-style)": decay}


def _saved_dp(layout: dict) -> int:
    """The data-parallel size (CP ranks not counted) a checkpoint was trained at."""
    return layout["world_size"] // (layout["tp"] * layout["pp"] * layout.get("cp", 1))


def _check_schedule_unchanged(cfg: Config, world_size: int, meta: dict, ckpt_dir: Path) -> None:
    """Refuse a resume whose LR or weight-decay schedule differs from the checkpoint's: the
    run would silently continue on another curve. --finetune and --no-load-optim start the
    schedule afresh, so they are not checked."""
    if cfg.checkpoint.finetune or cfg.checkpoint.no_load_optim:
        return

    def known(section: type, values: dict) -> dict:
        names = {f.name for f in dataclasses.fields(section)}
        return {k: v for k, v in values.items() if k in names}

    saved = meta["config"]
    then = _schedule_values(dataclasses.replace(cfg.optim, **known(OptimConfig, saved["optim"])),
                            dataclasses.replace(cfg.train, **known(TrainConfig, saved["train"])),
                            _saved_dp(meta["layout"]))
    now = _schedule_values(cfg.optim, cfg.train, data_parallel_size(cfg, world_size))
    changed = [f"{name}: {then[name]} in the checkpoint, {now[name]} now"
               for name in now if now[name] != then[name]]
    if changed:
        raise ckpt_files.CheckpointError(
            f"the checkpoint {ckpt_dir} was trained on another schedule ({'; '.join(changed)}). "
            "Pass --override-opt_param-scheduler to continue on this run's flags, or "
            "--use-checkpoint-opt_param-scheduler to continue on the checkpoint's")
