"""Parameter tags: how parallelism treats each weight, declared by its layer, read by the rest.

A layer states a weight's tensor-parallel layout once, when it creates it, with the `mark_*`
functions here; the optimizer, gradient clipping, checkpointing and export read it back with
the reader functions below, never by attribute name (the role of Megatron-LM's
`set_tensor_model_parallel_attributes` and `param_is_not_tensor_parallel_duplicate`). The
tags are plain attributes of the `nn.Parameter`:

- TP split, the one tag saved in checkpoints (where it comes back as JSON lists):
  ("rows", partitions)  column-parallel: the rows of each stacked sub-matrix (e.g. Q, K, V)
                        are split over TP on their own
  ("vocab", (padded,))  vocab-parallel: the rows of the padded vocabulary are split over TP;
                        those past the real vocabulary are zero
  ("cols",)             row-parallel: the input columns are split over TP
  None                  replicated over TP (norm weights), also for a parameter never marked
- sequence-parallel gradient: a replicated weight that sees only this rank's sequence slice
  under SP (or only its heads: the q/k norms of --qk-layernorm), so its gradient is partial
  and must be summed over TP after backward.
- shared embedding: one of the two copies of a tied embedding, on the first and on the last
  pipeline stage; their gradients are summed over the embedding group.
- expert: a routed expert's weight, split over expert-parallel ranks (each holds its own
  experts), so its gradient is summed over the expert-data-parallel group instead of DP x CP.
- fp8 weight: the weight of a linear whose GEMMs run in FP8 (--fp8-format); under
  --fp8-param-gather the optimizer gives these their own buffers, gathered in fp8.

Adding a parallelism-aware layer:
1. Pick each weight's split: `column_split(partitions)`, `row_split()`,
   `vocab_split(padded_size)`, or none (replicated).
2. Create the weight with `layers/init.init_shard(full_shape, split, ...)`: the full tensor
   is drawn from (seed, name) and this rank keeps its slice, so every TP size starts from
   the same model (and the meta device allocates the slice without drawing).
3. Tag it: `mark_tp_split(weight, split)` or `mark_replicated(weight)`; add
   `mark_sequence_parallel_grad` to a replicated weight that sees sequence slices under SP
   (take the flag from `LayerContext.sequence_parallel`, already resolved for the TP size),
   `mark_shared_embedding` to a weight that a second pipeline stage holds a copy of, and
   `mark_expert` to a routed expert's weight.
4. List it in megatron_lite/structure.py (name, global shape, split): export, the planner's
   parameter counts and ZeRO-3's bucket order read the model's parameters from there, and
   tests/test_structure.py checks the list against a meta-device build.
5. Nothing else to wire: the optimizer sums SP gradients over TP and gives shared-embedding
   copies their own buckets (optim/param_buffers.py); the global norm counts a replicated
   weight on TP rank 0 and a shared embedding on the first stage only (optim/clip.py);
   checkpoints save the split and re-slice it into any layout (checkpoint/reshard.py);
   export gathers full tensors from it (export.py: a new weight needs its Hugging Face name
   in `to_hf`/`from_hf`).
6. Extend tests/model/test_tags.py (each weight's tags per layout),
   tests/model/test_tensor_parallel.py (TP=2/4 gradients vs one process, shard by shard),
   tests/optim/test_data_parallel.py (norm and step under TP x DP and PP x DP) and
   tests/checkpoint/test_layouts.py (resume and reshard across layouts).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

TpSplit = tuple
"""("rows", partitions) | ("vocab", (padded rows,)) | ("cols",); readers also take lists."""


# ---- TP split values (what `layers/init` slices by and checkpoints store) ------------------

def column_split(partitions: Sequence[int]) -> TpSplit:
    """Output rows split over TP, each of the fused sub-matrices (row counts) on its own."""
    return ("rows", tuple(partitions))


def row_split() -> TpSplit:
    """Input columns split over TP."""
    return ("cols",)


def vocab_split(padded_size: int) -> TpSplit:
    """Rows of a `padded_size`-row vocabulary split over TP; pad rows (at the end) are zero."""
    return ("vocab", (padded_size,))


def row_partitions(split: TpSplit) -> Sequence[int] | None:
    """The row counts a column or vocab split cuts one by one; None for a row split."""
    return None if split[0] == "cols" else split[1]


def padded_vocab_size(split: TpSplit | None) -> int | None:
    """The padded row count of a vocab split (the real rows come first); None otherwise."""
    return split[1][0] if split is not None and split[0] == "vocab" else None


# ---- marking (layers, when they create a weight) --------------------------------------------

def mark_tp_split(param: nn.Parameter, split: TpSplit) -> nn.Parameter:
    """Tag `param` as this rank's slice under `split` (the value it was initialised with)."""
    param.tp_split = split
    return param


def mark_replicated(param: nn.Parameter) -> nn.Parameter:
    """Tag `param` as the same full tensor on every TP rank."""
    param.tp_split = None
    return param


def mark_sequence_parallel_grad(param: nn.Parameter) -> nn.Parameter:
    """Tag a replicated `param` whose gradient is partial under SP and summed over TP."""
    param.sequence_parallel = True
    return param


def mark_shared_embedding(param: nn.Parameter) -> nn.Parameter:
    """Tag one of the two stage copies of a tied embedding (gradients summed across stages)."""
    param.shared_embedding = True
    return param


def mark_expert(param: nn.Parameter) -> nn.Parameter:
    """Tag a routed expert's weight (its replicas are the expert-data-parallel ranks)."""
    param.expert = True
    return param


def mark_fp8_weight(param: nn.Parameter) -> nn.Parameter:
    """Tag the weight of an FP8 linear (its module reads an fp8 copy under --fp8-param-gather)."""
    param.fp8_weight = True
    return param


# ---- reading (optimizer, clipping, checkpoints, export) -------------------------------------

def tp_split(param: nn.Parameter) -> TpSplit | None:
    """`param`'s TP split, None when it is replicated (or was never marked)."""
    return getattr(param, "tp_split", None)


def is_replicated(param: nn.Parameter) -> bool:
    """Every TP rank holds the same `param` (count it once, e.g. in the gradient norm)."""
    return tp_split(param) is None


def is_sequence_parallel_grad(param: nn.Parameter) -> bool:
    """`param`'s gradient is partial under SP: the optimizer sums it over TP after backward."""
    return getattr(param, "sequence_parallel", False)


def is_shared_embedding(param: nn.Parameter) -> bool:
    """`param` is a stage copy of a tied embedding (see `mark_shared_embedding`)."""
    return getattr(param, "shared_embedding", False)


def is_expert(param: nn.Parameter) -> bool:
    """`param` is a routed expert's weight (see `mark_expert`)."""
    return getattr(param, "expert", False)


def is_fp8_weight(param: nn.Parameter) -> bool:
    """`param` is an FP8 linear's weight (see `mark_fp8_weight`)."""
    return getattr(param, "fp8_weight", False)
