"""Every validation error names the flag and the values, and fires before any process group."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import pretrain
from megatron_lite.arguments import parse_config
from megatron_lite.config import ConfigError, validate

CASES = [
    # (flags, world size, fragments the message must contain)
    (["--tensor-model-parallel-size", "2"], 3,
     ["world size 3", "--tensor-model-parallel-size 2"]),
    (["--num-attention-heads", "6", "--hidden-size", "48", "--num-query-groups", "6",
      "--tensor-model-parallel-size", "4"], 4, ["--num-attention-heads 6", "4"]),
    (["--num-query-groups", "2", "--tensor-model-parallel-size", "4", "--num-attention-heads",
      "8"], 4, ["--num-query-groups 2"]),
    (["--hidden-size", "66", "--num-attention-heads", "4"], 1,
     ["--hidden-size 66", "--num-attention-heads 4"]),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2", "--seq-length", "33",
      "--max-position-embeddings", "64"], 2, ["--sequence-parallel", "--seq-length (33)",
                                              "--seq-length 34"]),
    (["--global-batch-size", "6", "--micro-batch-size", "2"], 2,
     ["--global-batch-size 6", "--micro-batch-size 2", "data-parallel size 2"]),
    (["--seq-length", "128", "--max-position-embeddings", "64"], 1,
     ["--seq-length 128", "--max-position-embeddings 64"]),
    (["--overlap-param-gather"], 2, ["--overlap-param-gather", "--use-distributed-optimizer"]),
    (["--data-parallel-sharding-strategy", "optim_grads_params", "--pipeline-model-parallel-size",
      "2", "--num-layers", "4"], 4,
     ["--data-parallel-sharding-strategy optim_grads_params", "--pipeline-model-parallel-size 2",
      "use optim_grads"]),
    (["--data-parallel-sharding-strategy", "optim_grads_params", "--compile"], 2,
     ["optim_grads_params with --compile", "drop --compile"]),
]


@pytest.mark.parametrize("flags,world,fragments", CASES)
def test_validation_messages(flags: list[str], world: int, fragments: list[str]) -> None:
    cfg = parse_config(flags)
    with pytest.raises(ConfigError) as err:
        validate(cfg, world)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_valid_layouts_pass() -> None:
    validate(parse_config(["--tensor-model-parallel-size", "2", "--sequence-parallel",
                           "--global-batch-size", "8"]), 4)


@pytest.mark.quick
def test_pretrain_rejects_before_process_groups(monkeypatch, capsys) -> None:
    """A torchrun-launched rank with a bad layout exits 2 without touching torch.distributed."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3",
                       "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    rc = pretrain.main(["--mock-data", "--tensor-model-parallel-size", "2"])
    assert rc == 2
    assert "world size 3 is not divisible" in capsys.readouterr().err
    assert not dist.is_initialized()


@pytest.mark.parametrize("flags,strategy", [
    ([], "no_shard"), (["--use-distributed-optimizer"], "optim"),
    (["--use-megatron-fsdp"], "optim_grads_params"),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"], "optim_grads"),
    (["--data-parallel-sharding-strategy", "optim_grads"], "optim_grads")])
def test_sharding_strategy_and_its_aliases(flags: list[str], strategy: str) -> None:
    parallel = parse_config(flags).parallel
    assert parallel.data_parallel_sharding_strategy == strategy
    assert parallel.use_distributed_optimizer == (strategy != "no_shard")


def test_distributed_optimizer_contradicting_no_shard_is_refused() -> None:
    with pytest.raises(ConfigError, match="--use-distributed-optimizer"):
        parse_config(["--use-distributed-optimizer", "--data-parallel-sharding-strategy",
                      "no_shard"])
