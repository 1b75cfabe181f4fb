"""ZeRO-3 on a GPU's terms, on the meta device: the head is not re-gathered for its backward,
and the dry run's activation peak sees the gathered units, so it matches the planner.

The layout (4 layers x 256, sequence 64, DP=4, bf16) has units large next to its activations,
like the issue's: before `LiveBytes` re-measured storages after each collective, the dry run
missed the gathered units (11.5 MiB measured against the planner's 15.9 MiB, 0.72); now it
measures 15.1 MiB, and the planner, counting each unit and bucket at the moments the schedule
holds it (planner.zero3_peak_bytes), says 14.9 MiB (1.01). More layouts:
test_zero3_peak_moments.py.
"""

from __future__ import annotations

import pytest

from megatron_lite import planner
from megatron_lite.arguments import parse_config
from megatron_lite.dry_run import run_rank
from megatron_lite.optim.sync_sharded import MAX_INFLIGHT_SCATTERS

LAYOUT = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
          "--seq-length", "64", "--vocab-size", "1024", "--micro-batch-size", "1",
          "--global-batch-size", "8", "--bf16", "--dry-run",
          "--data-parallel-sharding-strategy", "optim_grads_params"]
DP, UNITS, MICROBATCHES = 4, 6, 2


def _gathers(result) -> list:
    dp_group = tuple(range(DP))
    step = result.ops[slice(*result.phase_ops["train_step"])]  # the training step alone
    return [op for op in step if op.group == dp_group and op.op == "all_gather"]


@pytest.mark.quick
def test_dry_run_activations_match_the_planner_with_gathered_units() -> None:
    """Within 10% of the planner, and the gathered units are really in the measured peak:
    without them it would be off by more than 20%."""
    cfg = parse_config(LAYOUT)
    r = run_rank(cfg, DP, 0, time_host=False)
    ratio = r.activation_bytes / r.planner_activation_bytes
    print(f"ZeRO-3 activations measured / planner = {r.activation_bytes} / "
          f"{r.planner_activation_bytes} = {ratio:.3f}")
    assert 0.9 <= ratio <= 1.1
    gathered = planner.gathered_unit_bytes(cfg.model, 1, bf16=True)
    assert (r.activation_bytes - gathered) / r.planner_activation_bytes < 0.8


@pytest.mark.parametrize("untie", [False, True])
def test_head_is_not_gathered_again_for_its_backward(untie: bool) -> None:
    """Per micro-batch each unit is gathered for its forward and its backward, except the
    head (and, tied, the embedding it reads): it stays gathered from its forward into its
    backward, which the schedule runs right after. Untied, the embedding is freed after its
    forward and gathered again for its own backward."""
    flags = LAYOUT + (["--untie-embeddings-and-output-weights"] if untie else [])
    gathers = _gathers(run_rank(parse_config(flags), DP, 0, time_host=False))
    per_microbatch = 2 * UNITS - (1 if untie else 2)
    assert len(gathers) == per_microbatch * MICROBATCHES
    units = [dict(op.identity[1])["unit"] for op in gathers]
    head, embedding = UNITS - 1, 0
    assert units.count(head) == MICROBATCHES
    assert units.count(embedding) == (2 if untie else 1) * MICROBATCHES


def test_planner_counts_the_tied_embedding_and_the_gradient_buckets() -> None:
    """Tied: the embedding (read by the head) stays gathered beside a layer and the head or
    two layers; untied: two neighbouring units. Per unit its own gradient buckets, at most
    ZERO3_GRAD_BUCKETS at once: one accumulating, MAX_INFLIGHT_SCATTERS in flight."""
    assert planner.ZERO3_GRAD_BUCKETS == MAX_INFLIGHT_SCATTERS + 1
    tied = parse_config(LAYOUT).model
    untied = parse_config([*LAYOUT, "--untie-embeddings-and-output-weights"]).model
    emb, layer, head = planner.zero3_units(tied, 1)
    assert (emb, head) == (1024 * 256, 256) and layer == planner.layer_params(tied, 1)
    assert planner.gathered_unit_bytes(tied, 1, True) == 2 * (emb + 2 * layer)
    u_head = planner.zero3_units(untied, 1)[2]
    assert u_head == emb + 256
    assert planner.gathered_unit_bytes(untied, 1, True) == 2 * max(2 * layer, layer + u_head)
    # each unit is below the default bucket size: one bucket each, the head's first
    assert planner.zero3_grad_buckets(tied, 1, 40_000_000) == [[256], *[[layer]] * 4, [emb]]
    assert planner.zero3_grad_buckets(untied, 1, 40_000_000)[0] == [u_head]
