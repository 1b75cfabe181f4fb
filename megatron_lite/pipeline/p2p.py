"""Activation and gradient transfers between pipeline stages.

Shapes are never communicated: every stage computes the one shape that crosses a stage
boundary, [s, b, h] (or [s/t, b, h] under sequence parallelism), from the config. Each
`Communicate` action of the schedule becomes one `batch_isend_irecv` whose requests are all
waited before the stage moves on; the schedule guarantees the neighbours post matching
batches. Activations use tag 0 and gradients tag 1: gloo matches on tags, NCCL ignores them
and matches in posting order, which the schedule also keeps consistent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_lite.parallel.state import ParallelState
from megatron_lite.pipeline.schedule import Recv, Send

_TAGS = {"activation": 0, "grad": 1}


def boundary_shape(seq_length: int, micro_batch_size: int, hidden_size: int, tp_size: int,
                   sequence_parallel: bool) -> tuple[int, int, int]:
    """Shape of the hidden state passed between stages (sequence-first).

    `sequence_parallel` is the flag in effect (`BuildOptions.sequence_parallel`); the
    --sequence-parallel flag as given gives the same shape, since at TP=1 s/t is s.
    """
    seq = seq_length // tp_size if sequence_parallel else seq_length
    return seq, micro_batch_size, hidden_size


class StageComm:
    """Sends and receives one stage's boundary tensors to and from its pipeline neighbours."""

    def __init__(self, pstate: ParallelState, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.pstate, self.shape, self.dtype = pstate, tuple(shape), dtype

    def exchange(self, ops: Sequence[Send | Recv], outgoing: Mapping[Send, torch.Tensor]
                 ) -> dict[Recv, torch.Tensor]:
        """Post every op of one batch, wait for all; return the received tensors by op."""
        p2p_ops, received = [], {}
        for op in ops:
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
                p2p_ops.append(dist.P2POp(dist.isend, tensor.contiguous(), peer, tag=tag))
            else:
                buffer = torch.empty(self.shape, dtype=self.dtype, device=self.pstate.device)
                received[op] = buffer
                p2p_ops.append(dist.P2POp(dist.irecv, buffer, peer, tag=tag))
        if p2p_ops:
            for work in dist.batch_isend_irecv(p2p_ops):
                work.wait()
        return received
