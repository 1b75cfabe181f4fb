"""Per-DP-rank micro-batches of each global batch, with a resumable position.

The global batch of step k is samples [consumed, consumed + global_batch) of the dataset
(which does its own seeded shuffling). Inside it, micro-step j of DP rank r takes the
`micro_batch_size` samples starting at consumed + (j * dp + r) * micro_batch_size, the order
Megatron's pretraining sampler uses. The whole position is `consumed_samples`: a checkpoint
stores that number and a resumed run continues with exactly the same batches.

With `node_local=True` each DP rank's dataset holds only its own shards: the rank reads its
dataset sequentially from consumed_samples / dp, so every rank still takes the same number of
samples per step and the position is still the one global number.

Node-local data at another DP size (a resume after losing nodes): the checkpoint says which DP
size S the sample streams were made for. When the new size D divides S, DP rank r takes over
the streams of the old ranks r, r + D, r + 2D, ... (exactly the shards i % D == r that it would
own anyway) and reads each from its old position, consumed_samples / S, B / S samples per step
and stream. Every global batch then holds exactly the samples the DP-S run would have used;
only their micro-batch and rank change, which the token-sum loss does not see. Otherwise
(D grows, or does not divide S) the shards are re-assigned round robin over D, each rank reads
its new sample order from consumed_samples / D, and `resume_note` says so: the data order
changes from there on (the epoch count and the samples per step do not).

Under context parallelism every CP rank of a DP rank reads the same samples and keeps its
two chunks of each (`context_parallel_index`), with "token_index" saying where they sit in
the sequence. Document ids and positions (--reset-attention-mask, --reset-position-ids) are
computed on the whole sample first, so a chunk's values do not depend on the CP size.

With `batch_size_at` (a batch-size ramp-up) the global batch of a step is a function of the
position it starts at, so the position still says everything: a resume mid-ramp continues
with the same batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from megatron_lite.data.documents import document_layout


class TokenDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> np.ndarray: ...


@dataclass(frozen=True)
class SequenceLayout:
    """Which part of each sample this rank keeps, and what it learns about documents."""

    cp_rank: int = 0
    cp_size: int = 1
    reset_position_ids: bool = False
    """Add "positions" [b, s]: each token's position inside its document."""
    reset_attention_mask: bool = False
    """Add "documents" [b, s]: each token's document id (attention stays inside one)."""


def context_parallel_index(seq_length: int, cp_size: int, cp_rank: int) -> Tensor:
    """Sequence positions CP rank `cp_rank` holds: chunks r and 2c-1-r of 2c equal chunks.

    Pairing an early chunk with a late one gives every rank the same causal attention work
    (Megatron's load-balanced split).
    """
    chunk = seq_length // (2 * cp_size)
    starts = (cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk)
    return torch.cat([torch.arange(start, start + chunk) for start in starts])


def to_batch(samples: Sequence[np.ndarray], eod_id: int | None, eod_mask_loss: bool,
             layout: SequenceLayout = SequenceLayout()) -> dict[str, Tensor]:
    """Stack samples of seq+1 tokens into inputs, next-token labels and a loss mask (plus
    "positions", "documents" and, under CP, this rank's chunks and their "token_index", plus
    "sequence_documents", the whole sequence's document ids, to plan attention with)."""
    data = torch.from_numpy(np.stack(samples).astype(np.int64))
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    if eod_mask_loss and eod_id is not None:
        loss_mask[tokens == eod_id] = 0.0
    batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
    if layout.reset_position_ids or layout.reset_attention_mask:
        if eod_id is None:
            raise ValueError("--reset-position-ids / --reset-attention-mask need the data's "
                             "end-of-document id")
        documents, positions = document_layout(tokens, eod_id,
                                               reset_position_ids=layout.reset_position_ids)
        if layout.reset_attention_mask:
            batch["documents"] = documents
        if layout.reset_position_ids:
            batch["positions"] = positions
    if layout.cp_size > 1:
        index = context_parallel_index(tokens.shape[1], layout.cp_size, layout.cp_rank)
        whole = batch.get("documents")
        batch = {k: v[:, index].contiguous() for k, v in batch.items()}
        batch["token_index"] = index
        if whole is not None:
            # The whole sequence's document ids stay on the host: attention's plan of every
            # ring step is made from them (training.py), so no ids travel the CP ring.
            batch["sequence_documents"] = whole
    return batch


class MicroBatchLoader:
    """Yields, per optimizer step, this DP rank's list of micro-batches."""

    def __init__(self, dataset: TokenDataset, *, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int, dp_size: int, consumed_samples: int = 0,
                 eod_id: int | None = None, eod_mask_loss: bool = False,
                 node_local: bool = False, prefetch: int = 0,
                 batch_size_at: Callable[[int], int] | None = None,
                 stream_factory: Callable[[int, int], TokenDataset] | None = None,
                 layout: SequenceLayout = SequenceLayout()) -> None:
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError("global batch must be a multiple of micro batch x dp")
        self.dataset = dataset
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed_samples = consumed_samples
        self.scheduler_samples = consumed_samples
        """Samples of the steps that updated the weights: the LR schedule's position. Megatron's
        scheduler counts these, so a skipped step consumes its data without moving the LR."""
        self.eod_id, self.eod_mask_loss = eod_id, eod_mask_loss
        self.node_local = node_local
        self.layout = layout
        self.prefetch = prefetch
        self.batch_size_at = batch_size_at or (lambda consumed: global_batch_size)
        self._pool = ThreadPoolExecutor(1, "batch-prefetch") if prefetch > 0 else None
        self._ahead: dict[int, Future] = {}
        self.streams: list[TokenDataset] = [dataset]
        """Node-local: the sample streams this rank reads (more than one after a resume at a
        DP size that divides the saved one; see the module docstring)."""
        self.stream_dp = dp_size
        """Node-local: the DP size the streams were made for (saved in checkpoints)."""
        self.stream_factory = stream_factory
        """Node-local: (old DP rank, old DP size) -> that rank's training dataset."""
        self.resume_note: str | None = None
        """What a node-local resume at another DP size did to the data order (for the log)."""
        self.before_fetch: Callable[[], None] | None = None
        """Called inside the timed fetch of every step (fault injection: a slow loader)."""
        self.wait_seconds = 0.0
        """Time the caller was blocked in `next_step` since the last `pop_wait_seconds`."""

    @property
    def current_global_batch_size(self) -> int:
        """The global batch of the next step (below --global-batch-size during a ramp-up)."""
        return self.batch_size_at(self.consumed_samples)

    @property
    def num_microbatches(self) -> int:
        return self.current_global_batch_size // (self.micro_batch_size * self.dp_size)

    def sample_indices(self, consumed: int) -> list[list[tuple[int, int]]]:
        """(stream, dataset index) of each sample of this rank's micro-batches for the step
        starting at `consumed` (stream 0 unless node-local streams were taken over)."""
        mb, dp = self.micro_batch_size, self.dp_size
        batch = self.batch_size_at(consumed)
        steps = batch // (mb * dp)
        if self.node_local:
            per_stream, start = batch // self.stream_dp, consumed // self.stream_dp
            flat = [(s, (start + i) % len(stream)) for s, stream in enumerate(self.streams)
                    for i in range(per_stream)]
            return [flat[j * mb:(j + 1) * mb] for j in range(steps)]
        n = len(self.dataset)
        return [[(0, (consumed + (j * dp + self.dp_rank) * mb + i) % n) for i in range(mb)]
                for j in range(steps)]

    def _build(self, consumed: int) -> list[dict[str, Tensor]]:
        return [to_batch([self.streams[s][i] for s, i in refs], self.eod_id, self.eod_mask_loss,
                         self.layout)
                for refs in self.sample_indices(consumed)]

    def pop_wait_seconds(self) -> float:
        seconds, self.wait_seconds = self.wait_seconds, 0.0
        return seconds

    def next_step(self) -> list[dict[str, Tensor]]:
        """The step starting at `consumed_samples`, then advance.

        With `prefetch` = N (--num-workers), a background thread prepares the next N steps.
        Work is keyed by the position it starts at, so a position set from outside (resume,
        evaluation restart) simply misses and is built here: batches never depend on timing.
        """
        started = time.perf_counter()
        if self.before_fetch is not None:
            self.before_fetch()
        future = self._ahead.pop(self.consumed_samples, None)
        batches = future.result() if future else self._build(self.consumed_samples)
        self.wait_seconds += time.perf_counter() - started
        self.consumed_samples += self.batch_size_at(self.consumed_samples)
        if self._pool is not None:
            for stale in [k for k in self._ahead if k < self.consumed_samples]:
                self._ahead.pop(stale).cancel()
            start = self.consumed_samples
            for _ in range(self.prefetch):
                if start not in self._ahead:
                    self._ahead[start] = self._pool.submit(self._build, start)
                start += self.batch_size_at(start)
        return batches

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "stream_dp": self.stream_dp}

    def load_state_dict(self, state: dict) -> None:
        """The position (and the LR's, `scheduler_samples`, which the checkpoint's metadata
        keeps; default the position); node-local, also the streams of the saved DP layout
        (`stream_dp`)."""
        self.consumed_samples = int(state["consumed_samples"])
        self.scheduler_samples = int(state.get("scheduler_samples", self.consumed_samples))
        self.resume_note = None
        saved = int(state.get("stream_dp", self.stream_dp))
        if self.node_local and saved != self.stream_dp:
            self._take_over_streams(saved)

    def _take_over_streams(self, saved: int) -> None:
        """Resume node-local data made for DP size `saved` at this loader's DP size."""
        dp, r, c = self.dp_size, self.dp_rank, self.consumed_samples
        self._ahead.clear()
        head = f"node-local data: the checkpoint's sample streams were made for DP {saved}, "
        if saved % dp == 0 and self.global_batch_size % saved == 0 and self.stream_factory:
            self.stream_dp = saved
            if saved == dp:  # back at the streams' own size: this rank's own dataset
                self.streams, self.resume_note = [self.dataset], None
                return
            self.streams = [self.stream_factory(q, saved) for q in range(r, saved, dp)]
            self.resume_note = (
                f"{head}this run has DP {dp}: DP rank r continues the streams of the old ranks "
                f"r, r+{dp}, ... ({saved // dp} each; shards i % {dp} == r, as before) from their "
                f"saved position, sample {c // saved} of each, {self.global_batch_size // saved} "
                "samples per stream and step: every global batch holds exactly the samples "
                f"the DP-{saved} run would have used (only their rank and micro-batch change)")
            return
        self.streams, self.stream_dp = [self.dataset], dp
        why = (f"{dp} does not divide {saved}" if saved % dp else
               f"--global-batch-size {self.global_batch_size} is not a multiple of {saved}")
        self.resume_note = (
            f"{head}this run has DP {dp} ({why}): the shards are re-assigned round robin "
            f"(shard i -> DP rank i % {dp}) and each rank starts its new sample order at sample "
            f"{c // dp} (consumed_samples {c} / {dp}). The data order changes from here: "
            "samples already trained on may come again and others be left out; samples per "
            "step and epochs are unchanged")
