"""The ring over 2 and 4 gloo ranks against full-sequence SDPA with the boolean mask: each rank
holds its zigzag chunks, K/V (and dK/dV) travel by batched p2p, and the rank's outputs and
q/k/v gradients equal the reference's rows for its tokens. Every rank also counts its kernel
calls, so a skipped block is seen not to run."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.layers import attention as attn
from megatron_lite.layers.attention import Ring, attention, zigzag_token_index
from tests.distributed import run_ranks
from tests.model.test_attention import grads, inputs, random_documents, reference

S = 32


def _rank_fn(pstate, cases: list[dict]) -> list[dict]:
    size, rank = dist.get_world_size(), dist.get_rank()
    ring = Ring(dist.new_group(list(range(size))), tuple(range(size)), rank)
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
        ref = reference(*(x.float() for x in (q, k, v)), docs)
        want = grads(ref, (q, k, v))
        results.append(dict(
            out=(out.float() - ref[:, :, index]).abs().max().item(),
            grads=[(g.float() - w[:, :, index].float()).abs().max().item()
                   for g, w in zip(got, want, strict=True)],
            area=sum(forward_calls), calls=len(forward_calls)))
    return results


CASES = [dict(hkv=4, dtype=torch.float32, docs=None),
         dict(hkv=1, dtype=torch.float32, docs=4),
         dict(hkv=2, dtype=torch.bfloat16, docs=3)]


def _check(results: list[list[dict]], size: int) -> None:
    local = S // size
    for rank, per_case in enumerate(results):
        for case, r in zip(CASES, per_case, strict=True):
            tol = 1e-5 if case["dtype"] == torch.float32 else 3e-2
            assert r["out"] < tol, (rank, case, r)
            assert max(r["grads"]) < tol * 2, (rank, case, r)
        # No documents: the zigzag gives every rank the same work, half of its queries x all
        # keys (2 chunk^2 per block), and nothing of a skipped half is computed.
        no_docs = per_case[0]
        chunk = local // 2
        assert no_docs["area"] == 2 * chunk * chunk * size, no_docs
        assert no_docs["calls"] == (1 if rank == size - 1 else 3) + (size - 1), no_docs
        # Documents only remove work.
        assert per_case[1]["area"] <= no_docs["area"]


def test_ring_of_two(tmp_path) -> None:
    _check(run_ranks(_rank_fn, 2, tmp_path, cases=CASES), 2)


def test_ring_of_four(tmp_path) -> None:
    _check(run_ranks(_rank_fn, 4, tmp_path, cases=CASES), 4)


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
