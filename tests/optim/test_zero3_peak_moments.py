"""The planner's ZeRO-3 activation peak against the rank dry run's, at layouts where the
planner used to add every gathered unit and three fp32 buckets of the largest unit (the
embedding: 6 GiB at 128K x 4096) to the whole activation peak: measured / planner was 0.45
(4 x 4096, vocab 128K), 0.38 with full recomputation, 0.72 (8 x 2048, vocab 32K), 0.74-0.75
(4 x 256). The peak is the fullest moment of the step (planner.zero3_peak_bytes): the loss,
the head's backward, each layer's backward with its buckets in flight, the embedding's
backward. Now 0.98-1.00 at each (meta device, one process, about a second a layout).
"""

from __future__ import annotations

import pytest

from megatron_lite import planner
from megatron_lite.arguments import parse_config
from megatron_lite.dry_run import run_rank
from megatron_lite.optim.optimizer import Optimizer

STEP = ["--micro-batch-size", "1", "--global-batch-size", "8", "--bf16", "--dry-run",
        "--data-parallel-sharding-strategy", "optim_grads_params"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"]
UNTIED = ["--untie-embeddings-and-output-weights"]


def _shape(layers: int, hidden: int, heads: int, seq: int, vocab: int,
           groups: int | None = None) -> list[str]:
    flags = ["--num-layers", str(layers), "--hidden-size", str(hidden),
             "--num-attention-heads", str(heads), "--seq-length", str(seq),
             "--vocab-size", str(vocab)]
    return flags + (["--num-query-groups", str(groups)] if groups else [])


SMALL = _shape(4, 256, 4, 512, 1024)
"""Two micro-batches per rank at DP=4: the first one's last reduce-scatters still hold their
inputs when the second begins."""

LAYOUTS = {
    "8x2048-vocab32k": (8, _shape(8, 2048, 16, 2048, 32000)),
    "8x2048-vocab32k-untied": (8, [*_shape(8, 2048, 16, 2048, 32000), *UNTIED]),
    "4x4096-gqa-vocab128k": (8, _shape(4, 4096, 32, 4096, 128000, 8)),
    "4x4096-gqa-vocab128k-full-recompute": (8, [*_shape(4, 4096, 32, 4096, 128000, 8),
                                                *RECOMPUTE]),
    "4x256-2-microbatches-small-buckets": (4, [*SMALL, "--ddp-bucket-size", "200000"]),
    "4x256-tp2-sp": (8, [*SMALL, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.quick) if i == 0 else n
                                  for i, n in enumerate(LAYOUTS)])
def test_zero3_peak_matches_the_dry_run(name: str) -> None:
    world, flags = LAYOUTS[name]
    r = run_rank(parse_config([*STEP, *flags]), world, 0, time_host=False)
    ratio = r.activation_bytes / r.planner_activation_bytes
    print(f"{name}: ZeRO-3 activations measured / planner = {r.activation_bytes} / "
          f"{r.planner_activation_bytes} = {ratio:.3f}")
    assert 0.9 <= ratio <= 1.1


@pytest.fixture
def optimizers(monkeypatch: pytest.MonkeyPatch) -> list[Optimizer]:
    """Every Optimizer built while the test runs (the dry run's, to read its units)."""
    built: list[Optimizer] = []
    init = Optimizer.__init__

    def recording(self: Optimizer, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(Optimizer, "__init__", recording)
    return built


@pytest.mark.parametrize("untie", [False, True])
def test_buckets_and_gathered_units_are_the_optimizers(untie: bool,
                                                       optimizers: list[Optimizer]) -> None:
    """zero3_grad_buckets cuts each unit as the optimizer does (to the alignment padding),
    and gathered_unit_bytes is the most the real step held gathered at once."""
    flags = [*STEP, *SMALL, "--ddp-bucket-size", "200000", *(UNTIED if untie else [])]
    cfg = parse_config(flags)
    run_rank(cfg, 4, 0, time_host=False)
    opt = optimizers[0]
    real = [[opt.buffers[b].layout.buckets[k].range.size for b, k in sorted(unit.keys)]
            for unit in reversed(opt.fsdp.units)]  # backward order: head, layers, embedding
    planned = planner.zero3_grad_buckets(cfg.model, 1, 200000)
    assert [len(u) for u in planned] == [len(u) for u in real]
    assert len(real[1]) > 1  # a layer is cut into several buckets at this bucket size
    for p, r in zip((b for u in planned for b in u), (b for u in real for b in u)):
        assert 0 <= r - p <= 1024, (planned, real)
    gathered = planner.gathered_unit_bytes(cfg.model, 1, bf16=True)
    assert opt.fsdp.peak_gathered_bytes == pytest.approx(gathered, rel=0.01)
