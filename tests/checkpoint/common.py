"""Shared pieces of the checkpoint tests: a tiny model's flags and full-state comparisons."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_lite.arguments import parse_config
from megatron_lite.checkpoint import CheckpointReader
from megatron_lite.config import Config, ParallelConfig
from megatron_lite.export import load_model, main, model_logits
from megatron_lite.parallel.state import ParallelState
from megatron_lite.training import train
from tests.distributed import relayout as relayout_to
from tests.numerics import EXACT, assert_all_close, assert_close

# 4 layers (PP=4, or PP=2 x v=2), GQA, a vocab that needs padding at TP=1 and TP=2.
FP32_FLAGS = ["--mock-data", "--num-layers", "4", "--hidden-size", "32",
              "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "64",
              "--seq-length", "16", "--vocab-size", "97", "--make-vocab-size-divisible-by", "8",
              "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "2e-3",
              "--lr-warmup-iters", "1", "--train-iters", "4", "--eval-iters", "0",
              "--peak-tflops", "1", "--log-interval", "100"]
"""The dtype tests' flags (fp32 bit-exact resume, the fp32 HF export)."""
FLAGS = [*FP32_FLAGS, "--fp64"]
"""The equivalence tests' flags: float64 throughout (tests/numerics.py)."""
ITERS, HALF = 4, 2
"""Every run trains ITERS iterations; an interrupted one stops (and saves) at HALF."""
HALF_SAMPLES = HALF * 4
"""consumed_samples at HALF (global batch 4)."""

LAYOUTS = {
    "single": ([], 1, 1, 1),
    "tp2": (["--tensor-model-parallel-size", "2"], 2, 2, 1),
    "pp2-v2": (["--pipeline-model-parallel-size", "2",
                "--num-layers-per-virtual-pipeline-stage", "1"], 2, 1, 2),
    "pp4": (["--pipeline-model-parallel-size", "4"], 4, 1, 4),
    "dp2-zero1": (["--use-distributed-optimizer"], 2, 1, 1),
    "tp2-pp2": (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
                4, 2, 2),
}
"""name -> (extra flags, world size, tp, pp)."""


def relayout(pstate: ParallelState, tp: int, pp: int) -> ParallelState:
    """Another (TP, PP) layout of the same, already initialised ranks (tests/distributed.py)."""
    return relayout_to(pstate, Config(parallel=ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)))


def run_train(pstate: ParallelState, flags: list[str], base: list[str] = FLAGS) -> list[float]:
    return train(parse_config([*base, *flags]), pstate).losses


def run_sequence(pstate: ParallelState, runs: list[list[str]], base: list[str] = FLAGS
                 ) -> list[list[float]]:
    """Several training runs one after the other in the same ranks (one spawn)."""
    return [run_train(pstate, flags, base) for flags in runs]


def full_state(ckpt_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every weight and its optimizer state, gathered to full tensors (layout-free)."""
    reader = CheckpointReader(ckpt_dir)
    return {name: {"weight": reader.full_weight(name), **reader.full_optimizer(name)}
            for name in reader.where}


def assert_same_state(a: Path, b: Path) -> None:
    """The same full weights and optimizer state, bit for bit and in the same dtype."""
    sa, sb = full_state(a), full_state(b)
    assert sorted(sa) == sorted(sb)
    for name in sa:
        for kind in sa[name]:
            ta, tb = sa[name][kind], sb[name][kind]
            assert ta.dtype == tb.dtype and torch.equal(ta, tb), (name, kind, ta.dtype, tb.dtype)


def assert_close_state(got: Path, ref: Path, tol: float = EXACT) -> float:
    """The full weights and optimizer state within `tol` (float64 runs of two layouts after the
    same steps: only the summation order differs). Returns the worst relative error."""
    sg, sr = full_state(got), full_state(ref)
    flat_got = {f"{n}.{k}": t for n, kinds in sg.items() for k, t in kinds.items()}
    flat_ref = {f"{n}.{k}": t for n, kinds in sr.items() for k, t in kinds.items()}
    assert all(t.dtype == torch.float64 for t in flat_ref.values())
    return assert_all_close(flat_got, flat_ref, tol)


def flip_tensor_byte(path: Path) -> None:
    """Flip one bit in the middle of the tensor data (past the safetensors header), which
    leaves the file a valid safetensors file of the right size: only a checksum sees it."""
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[(header + len(data)) // 2] ^= 0x10
    path.write_bytes(bytes(data))


HF_FLOOR = 6e-8
"""Measured relative logits difference, ours vs transformers' LlamaForCausalLM, both float64
on the same weights: transformers computes RMSNorm and its RoPE tables in fp32 even in a
float64 model, so this is its fp32 rounding, not ours (ours is float64 throughout)."""


def check_hf_round_trip(ckpt: Path, iteration: int, tmp_path: Path, *extra: str) -> Path:
    """Export `ckpt`; transformers' LlamaForCausalLM gives our logits after a complete load
    (both in float64, within 5 x `HF_FLOOR`; a wrong name, split or RoPE convention is O(1));
    importing the export gives back the same weights. Returns the HF dir."""
    import transformers

    hf = tmp_path / "hf"
    assert main(["--load", str(ckpt), "--output", str(hf), *extra]) == 0
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    cfg, chunk = load_model(ckpt)
    ours = model_logits(chunk.double(), tokens, cfg.vocab_size)
    model, info = transformers.LlamaForCausalLM.from_pretrained(
        hf, output_loading_info=True, dtype=torch.float64)
    # A missing weight would be silently random-initialised: require a complete load.
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        theirs = model(tokens).logits
    assert theirs.shape == ours.shape == (2, 16, 97) and theirs.dtype == torch.float64
    assert_close(theirs, ours, 5 * HF_FLOOR, "transformers' logits")
    back = tmp_path / "back"
    assert main(["--from-hf", str(hf), "--save", str(back)]) == 0
    a = CheckpointReader(ckpt / f"iter_{iteration:07d}")
    b = CheckpointReader(back / "iter_0000000")
    assert sorted(a.where) == sorted(b.where)
    for name in a.where:
        assert torch.equal(a.full_weight(name), b.full_weight(name)), name
    return hf
