"""Activation and gradient transfers between pipeline stages.

Shapes are never communicated: every stage computes the one shape that crosses a stage
boundary, [s, b, h] (or [s/t, b, h] under sequence parallelism), from the config. Each
`Communicate` action of the schedule becomes one `batch_isend_irecv` whose requests are all
waited before the stage moves on; a `Post` (zero-bubble schedules) is one that is waited
later, by a `Wait`. The schedule guarantees the neighbours post matching batches.
Activations use tag 0 and gradients tag 1: gloo matches on tags, NCCL ignores them and
matches in posting order, which the schedule also keeps consistent. Under an audit (the rank
dry run) each op is labelled with what it carries, (kind, micro-batch, the sending chunk), the
same on both ends, so the matcher proves that order rather than trusting equal shapes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist

from megatron_lite.parallel.audit import Identity, batch_identity, group_kind, identity
from megatron_lite.parallel.comms import WaitClock
from megatron_lite.parallel.state import ParallelState
from megatron_lite.pipeline.partition import stage_and_chunk, virtual_stage
from megatron_lite.pipeline.schedule import Recv, Send

_TAGS = {"activation": 0, "grad": 1}


def boundary_shape(seq_length: int, micro_batch_size: int, hidden_size: int, tp_size: int,
                   sequence_parallel: bool) -> tuple[int, int, int]:
    """Shape of the hidden state passed between stages (sequence-first).

    `sequence_parallel` is the flag in effect (`LayerContext.sequence_parallel`); the
    --sequence-parallel flag as given gives the same shape, since at TP=1 s/t is s.
    """
    seq = seq_length // tp_size if sequence_parallel else seq_length
    return seq, micro_batch_size, hidden_size


class PostedBatch:
    """One posted batch of transfers: `wait()` blocks until all are done and returns the
    received tensors by op (valid only after it)."""

    def __init__(self, works: list[dist.Work], received: dict[Recv, torch.Tensor],
                 sent: list[torch.Tensor], clock: WaitClock | None = None) -> None:
        self.works, self.received = works, received
        self._sent = sent  # the send buffers, kept alive until the sends are done
        self.clock = clock

    def wait(self) -> dict[Recv, torch.Tensor]:
        with self.clock if self.clock is not None and self.works else nullcontext():
            for work in self.works:
                work.wait()
        self.works, self._sent = [], []
        return self.received


class StageComm:
    """Sends and receives one stage's boundary tensors to and from its pipeline neighbours.

    A transfer whose peer is this stage (the turn of ZBV's V on the last stage) is handed
    over locally, in posting order, without p2p.
    """

    def __init__(self, pstate: ParallelState, shape: tuple[int, ...], dtype: torch.dtype,
                 v_shape: bool = False) -> None:
        self.pstate, self.shape, self.dtype = pstate, tuple(shape), dtype
        self.v_shape = v_shape
        """Chunks placed in a V (ZBV): needed to name the chunk at the other end of a transfer."""
        self._local: list[torch.Tensor] = []
        self.wait_clock = WaitClock(pstate.device)
        """Exposed pipeline communication: time blocked in the waits of posted batches (a
        receive waiting for the neighbour's compute counts: that is the bubble seen here)."""

    def is_local(self, op: Send | Recv) -> bool:
        return op.peer == self.pstate.pp_rank

    def identity(self, op: Send | Recv) -> Identity:
        """(kind, micro-batch, the sending stage's chunk): what both ends call this transfer.

        An activation flows from model piece v to v+1, a gradient from v+1 to v; the receiver
        names the sender's piece from its own.
        """
        pp = self.pstate.pp_size
        mine = virtual_stage(pp, self.pstate.pp_rank, op.chunk, self.v_shape)
        sender = mine
        if isinstance(op, Recv):
            sender = mine - 1 if op.tensor == "activation" else mine + 1
        return identity(op.tensor, mb=op.microbatch,
                        chunk=stage_and_chunk(pp, sender, self.v_shape)[1])

    def exchange(self, ops: Sequence[Send | Recv], outgoing: Mapping[Send, torch.Tensor]
                 ) -> dict[Recv, torch.Tensor]:
        """Post every op of one batch, wait for all; return the received tensors by op."""
        return self.post(ops, outgoing).wait()

    def post(self, ops: Sequence[Send | Recv], outgoing: Mapping[Send, torch.Tensor]
             ) -> PostedBatch:
        """Post every op of one batch as one batched isend/irecv, without waiting."""
        p2p_ops, received, sent, remote = [], {}, [], []
        for op in ops:
            if self.is_local(op):
                if isinstance(op, Send):
                    self._local.append(outgoing[op])
                else:
                    received[op] = self._local.pop(0)
                continue
            remote.append(op)
            peer = self.pstate.pp_ranks[op.peer]
            tag = _TAGS[op.tensor]
            if isinstance(op, Send):
                tensor = outgoing[op]
                if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
                    raise RuntimeError(
                        f"stage {self.pstate.pp_rank} would send {op.tensor} of shape "
                        f"{tuple(tensor.shape)} {tensor.dtype}, the pipeline expects "
                        f"{self.shape} {self.dtype}; the model chunk's output does not match "
                        "--seq-length/--micro-batch-size/--hidden-size (and /TP under SP)")
                sent.append(tensor.contiguous())
                p2p_ops.append(dist.P2POp(dist.isend, sent[-1], peer, tag=tag))
            else:
                buffer = torch.empty(self.shape, dtype=self.dtype, device=self.pstate.device)
                received[op] = buffer
                p2p_ops.append(dist.P2POp(dist.irecv, buffer, peer, tag=tag))
        works = []
        if p2p_ops:
            with batch_identity(lambda: [(p.tensor, self.identity(op))
                                         for p, op in zip(p2p_ops, remote)]), group_kind("pp"):
                works = dist.batch_isend_irecv(p2p_ops)
        return PostedBatch(works, received, sent, self.wait_clock)
