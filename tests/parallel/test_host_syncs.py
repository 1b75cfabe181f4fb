"""Device->host syncs per training step, counted in the meta dry run (`HostSyncCounter`): ring
attention plans once per micro-batch on the host, so the count does not grow with layers or
with the CP size; a planted `.cpu()` per layer is seen. GQA K/V are not repeated to the query
head count on the flash path, and the host plan equals the plan made from travelling ids. MoE
dispatch reads its counts once per layer per micro-batch (a planted `.tolist()` is seen),
comms.host_value counts, and in-place ops into host tensors from meta ones fail."""

from __future__ import annotations

import pytest
import torch

from megatron_lite import dry_run
from megatron_lite.arguments import parse_config
from megatron_lite.layers import attention as attn
from megatron_lite.layers.moe import MoE
from megatron_lite.model.llama import Attention
from megatron_lite.parallel import comms
from megatron_lite.parallel.audit import DeviceDisciplineError, match
from megatron_lite.parallel.host_syncs import MOE_SYNC_KIND, HostSyncCounter

TINY = ["--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--seq-length", "32", "--vocab-size", "250", "--micro-batch-size", "1",
        "--global-batch-size", "2"]


def _syncs(cp: int, layers: int) -> dict[str, int]:
    cfg = parse_config([*TINY, "--num-layers", str(layers), "--context-parallel-size", str(cp),
                        "--reset-attention-mask"])
    result = dry_run.run_rank(cfg, cp, 0)
    assert result.host_step_s > 0 and "host_syncs_per_step" in result.record()
    assert result.host_syncs_per_step == sum(result.host_syncs_by_kind.values())
    return result.host_syncs_by_kind


@pytest.mark.quick
def test_syncs_per_step_do_not_grow_with_layers_or_cp() -> None:
    counts = {(cp, layers): _syncs(cp, layers) for cp in (2, 4) for layers in (2, 4)}
    first = counts[(2, 2)]
    assert all(c == first for c in counts.values()), counts
    assert sum(first.values()) <= 6, first


def test_a_planted_cpu_per_layer_is_counted_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    clean = sum(_syncs(2, 2).values())
    real = Attention.core

    def planted(self, qkv, batch):
        batch.token_index.cpu()  # the bug: a host copy in every layer
        return real(self, qkv, batch)

    # Counted alone, each read of a meta tensor is answered by a stand-in and counted.
    x = torch.zeros(3, device="meta")
    with HostSyncCounter() as syncs:
        x.cpu(), x.sum().item(), bool(x[0]), x.tolist()
    assert syncs.total == 4, syncs.by_kind
    # In the dry run a read the code does not make on purpose has no value to give: it fails,
    # naming the line.
    monkeypatch.setattr(Attention, "core", planted)
    cfg = parse_config([*TINY, "--num-layers", "2", "--context-parallel-size", "2",
                        "--reset-attention-mask"])
    with pytest.raises(DeviceDisciplineError, match="planted"):
        dry_run.run_rank(cfg, 2, 0)
    assert clean <= 6


def test_lost_plan_with_documents_is_counted() -> None:
    """A device caller with documents and no plan pays C + 1 syncs per call (seen on meta)."""
    q = torch.empty(1, 4, 8, 16, device="meta", requires_grad=True)
    k = v = torch.empty(1, 2, 8, 16, device="meta", requires_grad=True)
    docs = torch.zeros(1, 8, dtype=torch.int32, device="meta")
    with HostSyncCounter() as syncs:
        attention_out = attn.attention(q, k, v, token_index=torch.arange(8, device="meta"),
                                       documents=docs)
    assert attention_out.shape == q.shape and syncs.total == 2  # one ring step + the local ids


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        self.calls.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


def test_gqa_flash_path_keeps_kv_at_their_head_count() -> None:
    """bf16 on a device (meta here): K/V reach the flash kernels at hkv heads and nothing
    builds a K/V copy at hq heads; the fp32 memory-efficient path alone repeats them."""
    b, hq, hkv, s, d = 1, 8, 2, 16, 16
    plan = attn.attention_plan(s, 1, 0, b, torch.tensor([[0] * 6 + [1] * 10]))

    def run(dtype: torch.dtype) -> list[tuple[str, list[tuple[int, ...]]]]:
        q = torch.empty(b, hq, s, d, device="meta", dtype=dtype, requires_grad=True)
        k = torch.empty(b, hkv, s, d, device="meta", dtype=dtype, requires_grad=True)
        v = torch.empty(b, hkv, s, d, device="meta", dtype=dtype, requires_grad=True)
        with _Ops() as ops:
            out = attn.attention(q, k, v, token_index=torch.arange(s, device="meta"),
                                 documents=torch.zeros(b, s, device="meta"), plan=plan)
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        return ops.calls

    calls = run(torch.bfloat16)
    # (q, k, v, ...) forward, (dout, q, k, v, ...) backward: the key's heads
    keys = [shapes[2 if "backward" in name else 1][1] for name, shapes in calls
            if "flash_attention" in name]
    assert keys == [hkv] * 2 * len(plan.steps[0])
    assert not [name for name, _ in calls if "repeat" in name or "expand" in name]
    fp32 = run(torch.float32)
    assert [name for name, _ in fp32 if "repeat_interleave" in name or "expand" in name]


@pytest.mark.parametrize("cp", [2, 4])
def test_host_plan_equals_the_plan_from_travelling_ids(cp: int) -> None:
    s, b = 32, 2
    docs = torch.tensor([[0] * 5 + [1] * 20 + [2] * 7, [0] * 16 + [1] * 16])
    for rank in range(cp):
        plan = attn.attention_plan(s, cp, rank, b, docs)
        ids = [attn._rank_ids(attn.zigzag_token_index(s, cp, r), docs) for r in range(cp)]
        want = [attn.block_pairs(ids[rank], ids[(rank - j) % cp], b) for j in range(cp)]
        assert [list(p) for p in plan.steps] == want
        assert plan.seq == s // cp and len(plan.steps) == cp


MOE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--num-query-groups", "2", "--seq-length", "32", "--vocab-size", "250",
       "--micro-batch-size", "1", "--global-batch-size", "8", "--num-experts", "8",
       "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
       "--expert-model-parallel-size", "2", "--bf16"]
"""Two MoE layers, EP2 over 2 ranks, 4 micro-batches a step."""


@pytest.mark.parametrize("extra", [["--moe-token-dispatcher-type", "alltoall"],
                                   ["--moe-token-dispatcher-type", "allgather"],
                                   ["--moe-token-dispatcher-type", "alltoall", "--fp8-format",
                                    "hybrid", "--fp8-recipe", "tensorwise"]])
def test_moe_dispatch_reads_once_per_layer_and_micro_batch(extra: list[str]) -> None:
    """Counts exchanged once, every size derived on the host from that one read: 1 sync per
    MoE layer per micro-batch, in the JSONL record; the rest of the step stays <= 6. The
    meta counts are the skewed stand-in's (uneven, one expert empty), so FP8 experts meet
    CUDA's grouped-GEMM alignment for real and the uneven all-to-alls match pairwise."""
    cfg = parse_config([*MOE, *extra])
    results = {r: dry_run.run_rank(cfg, 2, r, time_host=False) for r in range(2)}
    assert match({r: res.ops for r, res in results.items()}) is None
    for res in results.values():
        record = res.record()
        assert record["moe_syncs_per_layer"] == 1.0, res.host_syncs_by_kind
        assert res.host_syncs_by_kind[MOE_SYNC_KIND] == 2 * 4
        assert res.host_syncs_per_step - res.host_syncs_by_kind[MOE_SYNC_KIND] <= 6
    if "alltoall" in extra:  # the rows exchanged are the stand-in's uneven ones
        assert [op.splits for op in results[0].ops if op.splits and op.shapes[0][0] % 16]


def test_a_planted_tolist_in_moe_dispatch_is_counted_or_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An extra `.tolist()` of the counts in the dispatch: counted by a plain counter, and
    in the dry run (no value to give) a failure naming the line."""
    real = MoE._by_local_expert

    def planted(self, received, rows):
        received.tolist()  # the bug: a second host read per layer
        return real(self, received, rows)

    cfg = parse_config([*MOE, "--moe-token-dispatcher-type", "alltoall"])
    layer_syncs = {}
    for name in ("clean", "planted"):
        if name == "planted":
            monkeypatch.setattr(MoE, "_by_local_expert", planted)
        with HostSyncCounter() as syncs:
            dry_run.run_rank(cfg, 2, 0, time_host=False)
        layer_syncs[name] = syncs.total
    assert layer_syncs["planted"] >= layer_syncs["clean"] + 2 * 4, layer_syncs  # per call
    with pytest.raises(DeviceDisciplineError, match="planted"):
        dry_run.run_rank(cfg, 2, 0, time_host=False)


def test_host_value_is_counted_and_host_tensors_take_no_meta_values() -> None:
    """comms.host_value's skipped read counts as one sync, as does a `repeat_interleave` not
    told its size; `cpu_tensor += meta_tensor`, which
    torch's meta device lets through, fails as it would on a GPU (a device mismatch)."""
    x, host = torch.zeros(3, device="meta"), torch.zeros(3)
    with HostSyncCounter() as syncs:
        assert comms.host_value(x, [0.0] * 3) == [0.0] * 3
        with pytest.raises(RuntimeError, match="same device"):
            host += x
        host.copy_(x)  # a read-back: counted, not refused
        repeats = torch.ones(3, dtype=torch.int64, device="meta")
        torch.repeat_interleave(repeats, output_size=3)  # sized on the host: no sync
        torch.repeat_interleave(repeats)  # sized from device values: a sync
    assert syncs.by_kind == {"host_value": 1, "copy_to_cpu": 1, "repeat_interleave": 1}, \
        syncs.by_kind
    host += x  # outside a counter torch allows it: the plant the counter catches


def test_in_place_into_a_host_tensor_fails_the_dry_run(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """A host accumulator fed a meta (device) value inside the step fails the dry run,
    naming the line."""
    real = Attention.core

    def planted(self, qkv, batch):
        out = real(self, qkv, batch)
        total = torch.zeros(())
        total += out.float().sum()  # the bug: a host tensor accumulating a device value
        return out

    monkeypatch.setattr(Attention, "core", planted)
    cfg = parse_config([*TINY, "--num-layers", "1"])
    with pytest.raises(DeviceDisciplineError, match="planted"):
        dry_run.run_rank(cfg, 1, 0, time_host=False)
