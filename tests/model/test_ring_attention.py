"""The ring over 2 and 4 gloo ranks against full-sequence SDPA with the boolean mask: each rank
holds its zigzag chunks, K/V (and dK/dV) travel by batched p2p, and the rank's outputs and
q/k/v gradients equal the reference's rows for its tokens (float64: within EXACT, the worst
observed ~5e-16; bf16: within a measured floor). Every rank also counts its kernel
calls, so a skipped block is seen not to run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_lite.layers import attention as attn
from megatron_lite.layers.attention import Ring, attention, zigzag_token_index
from tests.distributed import run_ranks
from tests.model.test_attention import (
    bf16_floor,
    exact_of,
    grads,
    inputs,
    random_documents,
    reference,
)
from tests.numerics import EXACT, rel_err, within_floor

S = 32


def _ring_cases(ring: Ring, cases: list[dict]) -> list[dict]:
    size, rank = ring.size, ring.rank
    calls: list[int] = []
    real = attn._block_forward

    def counting(q, k, v, causal):
        calls.append(q.shape[2] * k.shape[2] / (2 if causal else 1))  # score entries
        return real(q, k, v, causal)

    attn._block_forward = counting
    results = []
    for case in cases:
        q, k, v = inputs(s=S, hkv=case["hkv"], dtype=case["dtype"])
        docs = (None if case["docs"] is None
                else random_documents(2, S, case["docs"], torch.Generator().manual_seed(7)))
        index = zigzag_token_index(S, size, rank)
        local = [x.detach()[:, :, index].requires_grad_() for x in (q, k, v)]
        calls.clear()
        out = attention(*local, token_index=index, ring=ring,
                        documents=None if docs is None else docs[:, index])
        forward_calls = list(calls)
        # The same output gradient as the reference's, restricted to this rank's tokens.
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
        got = torch.autograd.grad(out, local, dout[:, :, index])
        exact_in = exact_of((q, k, v))  # float64: the exact answer for these inputs
        ref = reference(*exact_in, docs)
        want = grads(ref, exact_in, via=q.dtype)
        results.append(dict(
            out=rel_err(out, ref[:, :, index]), out_floor=bf16_floor(ref[:, :, index]),
            grads=[rel_err(g, w[:, :, index]) for g, w in zip(got, want, strict=True)],
            grad_floors=[bf16_floor(w[:, :, index]) for w in want],
            area=sum(forward_calls), calls=len(forward_calls)))
    attn._block_forward = real
    return results


def _rank_fn(pstate, cases: list[dict]) -> dict[int, list[dict]]:
    """Rings of 2 (ranks 0-1 and 2-3) and of 4 in one 4-rank job."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ring2 = Ring(pairs[rank // 2], (rank // 2 * 2, rank // 2 * 2 + 1), rank % 2)
    ring4 = Ring(dist.new_group([0, 1, 2, 3]), (0, 1, 2, 3), rank)
    return {2: _ring_cases(ring2, cases), 4: _ring_cases(ring4, cases)}


CASES = [dict(hkv=4, dtype=torch.float64, docs=None),
         dict(hkv=1, dtype=torch.float64, docs=4),
         dict(hkv=2, dtype=torch.bfloat16, docs=3)]


@pytest.fixture(scope="module")
def rings(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, list[dict]]]:
    return run_ranks(_rank_fn, 4, tmp_path_factory.mktemp("ring"), cases=CASES)


def _check(results: list[list[dict]], size: int) -> None:
    """float64 cases within EXACT of one process; the bf16 case (the core runs in fp32 on
    CPU) within 4x of the exact answer's own bf16 rounding error."""
    local = S // size
    for rank, per_case in enumerate(results):
        for case, r in zip(CASES, per_case, strict=True):
            if case["dtype"] == torch.float64:
                assert r["out"] <= EXACT and max(r["grads"]) <= EXACT, (rank, case, r)
            else:
                within_floor(r["out"], r["out_floor"], f"rank {rank} bf16 output")
                for err, floor in zip(r["grads"], r["grad_floors"], strict=True):
                    within_floor(err, floor, f"rank {rank} bf16 gradient")
        # No documents: the zigzag gives every rank the same work, half of its queries x all
        # keys (2 chunk^2 per block), and nothing of a skipped half is computed.
        no_docs = per_case[0]
        chunk = local // 2
        assert no_docs["area"] == 2 * chunk * chunk * size, no_docs
        assert no_docs["calls"] == (1 if rank % size == size - 1 else 3) + (size - 1), no_docs
        # Documents only remove work.
        assert per_case[1]["area"] <= no_docs["area"]


def test_ring_of_two(rings: list[dict[int, list[dict]]]) -> None:
    _check([r[2] for r in rings], 2)


@pytest.mark.quick
def test_ring_of_four(rings: list[dict[int, list[dict]]]) -> None:
    _check([r[4] for r in rings], 4)


def test_dry_run_ring_on_meta_issues_the_p2p_traffic() -> None:
    """On meta under the fake process group (what --dry-run runs), the ring moves device
    tensors only, and issues its traffic: forward K/V + token metadata C-1 times, backward
    K/V C-1 times and dK/dV C times, sends balanced by receives."""
    from megatron_lite.config import Config, ParallelConfig
    from megatron_lite.parallel import state as parallel_state
    from megatron_lite.parallel.audit import CommAudit

    size = 4
    pstate = parallel_state.initialize_fake(Config(parallel=ParallelConfig()), size, 1)
    try:
        ring = Ring(pstate.dp_group, tuple(range(size)), 1)
        q, k, v = (x.detach().to("meta").requires_grad_() for x in inputs(hkv=2))
        docs = torch.zeros(2, S, dtype=torch.int32, device="meta")
        with CommAudit(torch.device("meta")) as audit:
            out = attention(q, k, v, token_index=torch.arange(S, device="meta"),
                            documents=docs, ring=ring)
            forward = [op.op for op in audit.ops]
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        backward = [op.op for op in audit.ops][len(forward):]
        assert out.shape == q.shape and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        assert forward.count("send") == forward.count("recv") == 2 * (size - 1)
        assert backward.count("send") == backward.count("recv") == (size - 1) + size
        assert {op.peer for op in audit.ops} == {0, 2}
    finally:
        parallel_state.destroy(pstate)
