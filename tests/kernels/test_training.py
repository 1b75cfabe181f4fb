"""10 training steps with the Triton kernels (interpreter on CPU) are as close to the float64
run as the torch reference kernels in the same precision are: the floor is the reference run's
own loss error against --fp64, measured here, and the Triton run must stay within 4x of it."""

from __future__ import annotations

import functools

import pytest

from megatron_lite.arguments import parse_config
from megatron_lite.parallel import state as parallel_state
from megatron_lite.parallel.launch import LaunchEnv
from megatron_lite.training import train
from tests.numerics import rel_err, within_floor

# Odd vocab (padding), GQA, ffn and head dim not powers of two; both microbatches per step.
FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "48", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "80", "--seq-length", "16",
         "--vocab-size", "97", "--make-vocab-size-divisible-by", "8", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--train-iters", "10", "--eval-iters", "0", "--peak-tflops", "1", "--log-interval", "1"]


def _losses(flags: tuple[str, ...]) -> list[float]:
    cfg = parse_config(list(flags))
    env = LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1,
                    master_addr="127.0.0.1", master_port=0, source="single", node_rank=0,
                    num_nodes=1)
    pstate = parallel_state.initialize(cfg, env=env)
    try:
        return train(cfg, pstate).losses
    finally:
        parallel_state.destroy(pstate)


@functools.cache
def _fp64_losses() -> tuple[float, ...]:
    """The exact side, shared by both precisions (--fp64 always uses the torch kernels)."""
    return tuple(_losses((*FLAGS, "--fp64")))


@pytest.mark.parametrize("precision", [(), ("--bf16",)], ids=["fp32", "bf16"])
def test_kernels_on_equals_off(precision):
    exact = _fp64_losses()
    on = _losses((*FLAGS, *precision, "--triton-kernels", "on"))
    off = _losses((*FLAGS, *precision, "--triton-kernels", "off"))
    assert len(on) == len(off) == len(exact) == 10
    floor = rel_err(off, exact)
    assert floor > 0, "the reference run in fp32/bf16 equals float64: the floor measures nothing"
    within_floor(rel_err(on, exact), floor, f"Triton {precision or 'fp32'} losses vs float64")
    assert off[-1] < off[0], "loss did not fall, so the comparison proves little"
