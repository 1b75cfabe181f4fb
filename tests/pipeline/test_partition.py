"""Layer -> (stage, chunk) assignment and the config checks that guard it."""

from __future__ import annotations

import itertools

import pytest

from megatron_lite.config import (
    Config,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    validate,
)
from megatron_lite.pipeline.partition import partition_layers


def _flatten_in_model_order(part) -> list[int]:
    """Layers in the order a micro-batch visits them: chunk 0 of every stage, then chunk 1..."""
    return [layer for chunk in range(part.num_chunks) for stage in range(part.pp_size)
            for layer in part.layer_ids(stage, chunk)]


def test_even_split() -> None:
    part = partition_layers(8, 4)
    assert [part.layer_ids(s, 0) for s in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_interleaved_round_robin_matches_megatron() -> None:
    # 16 layers, p = 4, 2 layers per virtual stage -> v = 2; chunk c of stage s starts at
    # (c*p + s) * 2.
    part = partition_layers(16, 4, layers_per_virtual_stage=2)
    assert part.num_chunks == 2
    for stage, chunk in itertools.product(range(4), range(2)):
        start = (chunk * 4 + stage) * 2
        assert part.layer_ids(stage, chunk) == (start, start + 1)
    assert part.location(9) == (0, 1)


def test_uneven_first_and_last_stages() -> None:
    part = partition_layers(10, 4, first_stage_layers=1, last_stage_layers=3)
    assert [len(part.layer_ids(s, 0)) for s in range(4)] == [1, 3, 3, 3]
    part = partition_layers(12, 3, layers_per_virtual_stage=2, first_stage_layers=2,
                            last_stage_layers=4)
    assert [[len(c) for c in chunks] for chunks in part.layers] == [[1, 1], [3, 3], [2, 2]]


@pytest.mark.parametrize(("layers", "pp", "lpv", "first", "last"), [
    (8, 4, None, None, None), (8, 2, 2, None, None), (12, 3, 1, None, None),
    (10, 4, None, 1, 3), (9, 3, None, 1, None), (7, 2, None, None, 3), (12, 3, 2, 2, 4),
])
def test_every_layer_exactly_once_and_in_order(layers, pp, lpv, first, last) -> None:
    part = partition_layers(layers, pp, lpv, first, last)
    assert _flatten_in_model_order(part) == list(range(layers))


def _cfg(layers=8, pp=2, lpv=None, first=None, last=None, gbs=8) -> Config:
    return Config(
        model=ModelConfig(num_layers=layers),
        parallel=ParallelConfig(pipeline_model_parallel_size=pp,
                                num_layers_per_virtual_pipeline_stage=lpv,
                                decoder_first_pipeline_num_layers=first,
                                decoder_last_pipeline_num_layers=last),
        train=TrainConfig(micro_batch_size=1, global_batch_size=gbs),
    )


@pytest.mark.parametrize(("kwargs", "needles"), [
    ({"layers": 7, "pp": 2}, ["--num-layers 7", "--pipeline-model-parallel-size 2"]),
    ({"layers": 8, "pp": 2, "lpv": 3}, ["--num-layers-per-virtual-pipeline-stage 3"]),
    ({"layers": 8, "pp": 1, "lpv": 2}, ["--pipeline-model-parallel-size > 1"]),
    ({"layers": 8, "pp": 2, "first": 3, "last": 3}, ["--decoder-first-pipeline-num-layers 3",
                                             "--num-layers 8"]),
    ({"layers": 8, "pp": 2, "lpv": 2, "gbs": 1}, ["1 micro-batches", "--global-batch-size"]),
    ({"layers": 8, "pp": 2, "lpv": 2, "gbs": 3}, ["multiple of --pipeline-model-parallel-size 2"]),
    ({"layers": 12, "pp": 3, "lpv": 2, "first": 1, "last": 5, "gbs": 6}, ["virtual chunks"]),
])
def test_validation_errors_name_the_flags(kwargs, needles) -> None:
    world = kwargs.get("pp", 2)
    with pytest.raises(ConfigError) as err:
        validate(_cfg(**kwargs), world_size=world)
    for needle in needles:
        assert needle in str(err.value)


GRID = list(itertools.product((4, 6, 7, 8, 12), (1, 2, 3, 4), (None, 1, 2, 3),
                              (None, 1, 2, 4), (None, 1, 3)))


def test_validate_and_partition_agree() -> None:
    """config.validate (stdlib only) must accept exactly what partition_layers can build."""
    for layers, pp, lpv, first, last in GRID:
        try:
            partition_layers(layers, pp, lpv, first, last)
            builds = True
        except ConfigError:
            builds = False
        try:
            validate(_cfg(layers, pp, lpv, first, last, gbs=4 * pp), world_size=pp)
            valid = True
        except ConfigError:
            valid = False
        assert builds == valid, (layers, pp, lpv, first, last)


def test_valid_pipeline_config_passes() -> None:
    validate(_cfg(layers=8, pp=2, lpv=2, gbs=4), world_size=4)  # dp = 2, m = 2
