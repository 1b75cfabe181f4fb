"""What layers are built with and what their forwards read, as two small frozen objects.

`LayerContext` is made once per model from the `ParallelState` and the run's choices
(`LayerContext.from_state`): the TP group and where this rank sits in it, sequence
parallelism as it is in effect (already False at TP=1), the CP ring, the device, dtype and
seed of the weights, the kernels, recomputation and the weight-gradient mode. Every layer and
block takes it instead of the whole `ParallelState` plus loose keywords, so a layer reads
only the parallel facts it needs, from one place.

`BatchContext` is what one micro-batch's forward reads besides the hidden states: where this
rank's tokens sit in the sequence (context parallelism), their RoPE positions and document
ids, the host plan of the attention kernel calls, and (filled in by the model chunk from its
tables) the RoPE angles of those tokens. So every block's forward is `forward(x, batch)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from megatron_lite.config import MoEConfig
from megatron_lite.layers.attention import AttentionPlan, Ring
from megatron_lite.layers.fp8 import Fp8Recipe
from megatron_lite.layers.linear import WeightGradQueue
from megatron_lite.parallel import comms
from megatron_lite.parallel.state import ParallelState


@dataclass(frozen=True)
class LayerContext:
    """The immutable build context of one model's layers (see the module docstring)."""

    tp_group: comms.Group
    tp_size: int
    tp_rank: int
    sequence_parallel: bool
    """Sequence parallelism in effect: False at TP=1, whatever --sequence-parallel says."""
    cp_size: int
    cp_rank: int
    cp_group: comms.Group
    ring: Ring | None
    """The CP ring attention passes K/V around; None without context parallelism."""
    ep_size: int
    ep_rank: int
    ep_group: comms.Group
    """Expert parallelism (--expert-model-parallel-size): the group a MoE layer's experts
    are split over and where this rank sits in it."""
    etp_size: int
    etp_rank: int
    etp_group: comms.Group
    """Expert tensor parallelism (--expert-tensor-parallel-size): the TP ranks each expert's
    weights are split over (the TP group unless smaller)."""
    device: torch.device
    seed: int
    """Every weight is drawn from (seed, its name): the same model at any TP size."""
    dtype: torch.dtype = torch.float32
    use_triton: bool = False
    recompute_granularity: str | None = None
    """None, "selective" (RoPE + attention core rerun in backward) or "full" (whole layers)."""
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    split_backward: bool = False
    """Defer weight gradients to the pipeline's W steps (--pipeline-schedule zb-h1/zbv)."""
    moe: MoEConfig | None = None
    """Mixture of experts (--num-experts): the layers --moe-layer-freq picks get a `MoE`."""
    weight_grads: WeightGradQueue | None = None
    """The queue of one model chunk's deferred weight gradients (`for_chunk`); None when
    backward is plain autograd."""
    fp8: Fp8Recipe | None = None
    """--fp8-format: the parallel linears' GEMMs in FP8 (None: in `dtype`)."""
    fp8_bf16_layers: frozenset[int] = frozenset()
    """Transformer layers kept out of FP8 (--first-last-layers-bf16)."""

    @classmethod
    def from_state(cls, pstate: ParallelState, *, seed: int, sequence_parallel: bool = False,
                   dtype: torch.dtype = torch.float32, use_triton: bool = False,
                   recompute_granularity: str | None = None, recompute_method: str = "uniform",
                   recompute_num_layers: int = 1, split_backward: bool = False,
                   moe: MoEConfig | None = None, fp8: Fp8Recipe | None = None,
                   fp8_bf16_layers: frozenset[int] = frozenset()) -> LayerContext:
        """The context of this rank's layers. The one place sequence parallelism is resolved
        for the TP size: at TP=1 there is no group to split the sequence over."""
        ring = (Ring(pstate.cp_group, pstate.cp_ranks, pstate.cp_rank)
                if pstate.cp_size > 1 else None)
        return cls(tp_group=pstate.tp_group, tp_size=pstate.tp_size, tp_rank=pstate.tp_rank,
                   sequence_parallel=sequence_parallel and pstate.tp_size > 1,
                   cp_size=pstate.cp_size, cp_rank=pstate.cp_rank, cp_group=pstate.cp_group,
                   ring=ring,
                   ep_size=pstate.ep_size, ep_rank=pstate.ep_rank, ep_group=pstate.ep_group,
                   etp_size=pstate.etp_size, etp_rank=pstate.etp_rank,
                   etp_group=pstate.etp_group,
                   device=pstate.device, seed=seed, dtype=dtype, use_triton=use_triton,
                   recompute_granularity=recompute_granularity,
                   recompute_method=recompute_method,
                   recompute_num_layers=recompute_num_layers, split_backward=split_backward,
                   moe=moe, fp8=fp8, fp8_bf16_layers=fp8_bf16_layers)

    def for_chunk(self) -> LayerContext:
        """This context for one model chunk: its own weight-gradient queue when backward is
        split (a queue belongs to one chunk, whose W steps the engine runs)."""
        return replace(self, weight_grads=WeightGradQueue() if self.split_backward else None)

    def for_layer(self, layer: int) -> LayerContext:
        """This context for transformer layer `layer`: without FP8 if it is one of the
        --first-last-layers-bf16 layers."""
        return replace(self, fp8=None) if layer in self.fp8_bf16_layers else self


@dataclass(frozen=True)
class BatchContext:
    """What one micro-batch's forward reads besides the hidden states (all optional)."""

    token_index: Tensor | None = None
    """[s]: this rank's tokens' places in the whole sequence (None: 0..s-1)."""
    positions: Tensor | None = None
    """[b, s]: RoPE positions where they differ from `token_index` (restarting per document)."""
    documents: Tensor | None = None
    """[b, s]: document ids; attention stays inside one document."""
    plan: AttentionPlan | None = None
    """The host plan of the attention kernel calls (made by the loader), shared by layers."""
    cos: Tensor | None = None
    """RoPE angles of these tokens ([s, d] or [s, b, d]; the whole table for plain 0..s-1
    positions, sliced per layer), set by the model chunk (`with_rope`)."""
    sin: Tensor | None = None

    @classmethod
    def of(cls, microbatch: Mapping[str, Any]) -> BatchContext:
        """The batch context of a micro-batch dict: its "token_index", "positions",
        "documents" and "attention_plan", those it has. Each pipeline stage reads them from
        its own copy of the micro-batch, not from the previous stage."""
        get = microbatch.get
        return cls(token_index=get("token_index"), positions=get("positions"),
                   documents=get("documents"), plan=get("attention_plan"))

    def with_rope(self, cos: Tensor, sin: Tensor) -> BatchContext:
        return replace(self, cos=cos, sin=sin)
