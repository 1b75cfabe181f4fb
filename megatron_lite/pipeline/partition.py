"""Which transformer layers live on which pipeline stage and virtual chunk (pure Python).

With p stages and v chunks per stage the layer stack is cut into p*v consecutive pieces,
dealt round-robin: piece k goes to stage k % p as its chunk k // p. So with an even split of
L layers into pieces of n = L / (p*v), chunk c of stage s holds layers [(c*p + s)*n, ...+n),
which is Megatron's interleaving: a micro-batch visits stage 0, 1, ..., p-1, then stage 0
again for chunk 1, and so on.

Uneven first/last stages (`--decoder-first-pipeline-num-layers`,
`--decoder-last-pipeline-num-layers`) fix those stages' layer counts; the remaining layers are
shared evenly by the other stages. Each stage then splits its own count evenly over its v
chunks, and virtual round c still visits stages in order, so layer order is preserved.

The V shape of the ZBV schedule (`--pipeline-schedule zbv`) cuts the stack into 2p even
pieces and gives stage s pieces s and 2p - 1 - s: a micro-batch goes down the stages and back
up, and stage 0 holds both the embedding and the head (a tied embedding is one parameter).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite import layout
from megatron_lite.config import Config, ConfigError, schedule_in_effect


@dataclass(frozen=True)
class Partition:
    """Layer ids per (stage, chunk): `layers[stage][chunk]` is a tuple of global layer indices."""

    layers: tuple[tuple[tuple[int, ...], ...], ...]
    v_shape: bool = False
    """Chunks placed in a V (ZBV) rather than round-robin; see `virtual_stage`."""

    @property
    def pp_size(self) -> int:
        return len(self.layers)

    @property
    def num_chunks(self) -> int:
        return len(self.layers[0])

    def layer_ids(self, stage: int, chunk: int) -> tuple[int, ...]:
        return self.layers[stage][chunk]

    def location(self, layer: int) -> tuple[int, int]:
        """(stage, chunk) holding a global layer index."""
        for stage, chunks in enumerate(self.layers):
            for chunk, ids in enumerate(chunks):
                if layer in ids:
                    return stage, chunk
        raise KeyError(f"layer {layer} is not in this partition")


def partition_layers(
    num_layers: int,
    pp_size: int,
    layers_per_virtual_stage: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> Partition:
    """Assign every layer to exactly one (stage, chunk); see the module docstring for the rule.

    Raises ConfigError with layout.py's message (the one config.validate gives) when the
    split is impossible."""
    errors = layout.split_errors(num_layers, pp_size, layers_per_virtual_stage,
                                 first_stage_layers, last_stage_layers)
    if errors:
        raise ConfigError(errors[0])
    counts = layout.stage_layer_counts(num_layers, pp_size, first_stage_layers,
                                       last_stage_layers)
    v = layout.virtual_chunks(num_layers, pp_size, layers_per_virtual_stage)
    per_chunk = [count // v for count in counts]
    layers: list[list[tuple[int, ...]]] = [[] for _ in range(pp_size)]
    start = 0
    for _chunk in range(v):
        for stage in range(pp_size):
            layers[stage].append(tuple(range(start, start + per_chunk[stage])))
            start += per_chunk[stage]
    return Partition(tuple(tuple(chunks) for chunks in layers))


def virtual_stage(pp_size: int, stage: int, chunk: int, v_shape: bool = False) -> int:
    """Position in the model (0 = the embedding's) of chunk `chunk` of stage `stage`.

    Round-robin (interleaving): chunk c of stage s is piece c*p + s. V shape (ZBV, two
    chunks): chunk 0 of stage s is piece s and chunk 1 is piece 2p - 1 - s.
    """
    if v_shape:
        return stage if chunk == 0 else 2 * pp_size - 1 - stage
    return chunk * pp_size + stage


def stage_and_chunk(pp_size: int, virtual: int, v_shape: bool = False) -> tuple[int, int]:
    """(stage, chunk) holding piece `virtual` of the model; the inverse of `virtual_stage`."""
    if v_shape:
        return (virtual, 0) if virtual < pp_size else (2 * pp_size - 1 - virtual, 1)
    return virtual % pp_size, virtual // pp_size


def config_partition(cfg: Config, pp_size: int) -> Partition:
    """The partition a run's flags ask for: the V when the schedule places chunks in one
    (ZBV), else round-robin with the virtual stage size and the uneven first/last stages."""
    parallel, layers = cfg.parallel, cfg.model.num_layers
    if schedule_in_effect(parallel).v_shape:
        return v_partition(layers, pp_size)
    return partition_layers(layers, pp_size, parallel.num_layers_per_virtual_pipeline_stage,
                            parallel.decoder_first_pipeline_num_layers,
                            parallel.decoder_last_pipeline_num_layers)


@dataclass(frozen=True)
class ChunkSpec:
    """What one model chunk of a stage is built from."""

    layer_ids: tuple[int, ...]
    pre_process: bool
    """Holds the embedding (first chunk of the first stage)."""
    post_process: bool
    """Holds the final norm, output layer and loss (last chunk of the last stage)."""


def v_partition(num_layers: int, pp_size: int) -> Partition:
    """ZBV's placement: 2p even pieces, stage s holds pieces s and 2p - 1 - s."""
    pieces = 2 * pp_size
    if num_layers % pieces:
        raise ConfigError(
            f"--pipeline-schedule zbv splits --num-layers {num_layers} into 2 x "
            f"--pipeline-model-parallel-size {pp_size} = {pieces} equal chunks; use a "
            f"multiple of {pieces}")
    n = num_layers // pieces
    layers = tuple(tuple(tuple(range(virtual * n, (virtual + 1) * n))
                         for virtual in (stage, pieces - 1 - stage))
                   for stage in range(pp_size))
    return Partition(layers, v_shape=True)


def stage_chunks(part: Partition, pp_rank: int) -> list[ChunkSpec]:
    """The chunks stage `pp_rank` builds, in chunk order."""
    last = part.pp_size * part.num_chunks - 1
    virtual = [virtual_stage(part.pp_size, pp_rank, c, part.v_shape)
               for c in range(part.num_chunks)]
    return [ChunkSpec(part.layer_ids(pp_rank, c), virtual[c] == 0, virtual[c] == last)
            for c in range(part.num_chunks)]
