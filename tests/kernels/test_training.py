"""10 training steps with the Triton kernels (interpreter on CPU) equal the torch reference."""

from __future__ import annotations

import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.launch import LaunchEnv
from megatron_lite.training import train

# Odd vocab (padding), GQA, ffn and head dim not powers of two; both microbatches per step.
FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "48", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "80", "--seq-length", "16",
         "--vocab-size", "97", "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--train-iters", "10", "--eval-iters", "0", "--peak-tflops", "1"]


def _losses(flags: list[str]) -> list[float]:
    cfg = parse_config(flags)
    env = LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1,
                    master_addr="127.0.0.1", master_port=0, source="single", node_rank=0,
                    num_nodes=1)
    pstate = parallel_state.initialize(cfg, env=env)
    try:
        return train(cfg, pstate).losses
    finally:
        parallel_state.destroy(pstate)


@pytest.mark.parametrize("precision,tol", [([], 1e-5), (["--bf16"], 1e-2)])
def test_kernels_on_equals_off(precision, tol):
    on = _losses([*FLAGS, *precision, "--triton-kernels", "on"])
    off = _losses([*FLAGS, *precision, "--triton-kernels", "off"])
    assert len(on) == len(off) == 10
    assert all(abs(a - b) <= tol * abs(b) for a, b in zip(on, off)), (on, off)
    assert off[-1] < off[0], "loss did not fall, so the comparison proves little"
