"""layers/attention.py against SDPA with the equivalent boolean mask (causal by full-sequence
token index, same document), forward and q/k/v gradients.

Single process: the C-rank zigzag layout is laid out in one process (ring=None with the
permuted token order), which runs the same block planning and merging as a ring rank's diagonal
and off-diagonal blocks; tests/model/test_ring_attention.py runs the real ring over gloo."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.layers import attention as attn
from megatron_lite.layers.attention import Pair, attention, block_pairs, zigzag_token_index
from tests.numerics import assert_close, rel_err, within_floor


def reference(q, k, v, documents=None):
    """Full-sequence SDPA with an explicit s x s boolean mask."""
    s = q.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    if documents is not None:
        mask = mask & (documents[:, None, :, None] == documents[:, None, None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                          enable_gqa=k.shape[1] != q.shape[1])


def random_documents(b: int, s: int, n_docs: int, gen: torch.Generator) -> torch.Tensor:
    """Non-decreasing ids with n_docs - 1 random cuts per row."""
    docs = torch.zeros(b, s, dtype=torch.int32)
    for r in range(b):
        cuts = torch.randperm(s - 1, generator=gen)[: n_docs - 1] + 1
        docs[r, cuts] = 1
    return docs.cumsum(1).to(torch.int32)


def inputs(b=2, hq=4, hkv=2, s=32, d=16, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=gen).to(dtype).requires_grad_()
            for h in (hq, hkv, hkv)]


def grads(out, tensors, seed=1, via=None):
    """Gradients for a fixed random output gradient, rounded to `via` first when given (so a
    float64 reference sees the bf16 output gradient a bf16 run sees)."""
    gen = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=gen).to(via or out.dtype).to(out.dtype)
    return torch.autograd.grad(out, tensors, dout)


def exact_of(tensors):
    """float64 leaf copies of (bf16) inputs: the exact answer for those very values."""
    return [x.detach().double().requires_grad_() for x in tensors]


def bf16_floor(exact: torch.Tensor) -> float:
    """What rounding the exact answer to bf16 alone costs."""
    return rel_err(exact.bfloat16(), exact)


def zigzag_order(s: int, size: int) -> torch.Tensor:
    return torch.cat([zigzag_token_index(s, size, r) for r in range(size)])


def blockwise(q, k, v, token_index, documents=None):
    """The blockwise core with a ring of one: what `attention` runs for a ring rank (it takes
    the plain SDPA call when there is neither a ring nor documents)."""
    ids = token_index[None]
    if documents is not None:
        ids = torch.cat([ids, documents.long()])
    return attn._RingAttention.apply(q, k, v, ids, None)


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("n_docs", [None, 1, 5])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_matches_masked_sdpa(size: int, n_docs: int | None, hkv: int) -> None:
    q, k, v = inputs(hkv=hkv)
    docs = None if n_docs is None else random_documents(2, 32, n_docs, torch.Generator()
                                                        .manual_seed(n_docs))
    ref = reference(q, k, v, docs)
    ref_grads = grads(ref, (q, k, v))
    order = zigzag_order(32, size)
    qp, kp, vp = (x[:, :, order] for x in (q, k, v))
    core = attention if size == 1 else blockwise
    out = core(qp, kp, vp, token_index=order, documents=None if docs is None else docs[:, order])
    assert out.dtype == q.dtype == torch.float64
    assert_close(out, ref[:, :, order], what="output")
    back = out[:, :, torch.argsort(order)]  # full-sequence order, as the reference
    for got, want, name in zip(grads(back, (q, k, v)), ref_grads, "qkv", strict=True):
        assert_close(got, want, what=f"d{name}")


def test_bf16_cpu_core_runs_in_fp32_and_returns_bf16() -> None:
    """The fp32 core's only loss is the final rounding to bf16: output and gradients within 4x
    of the exact answer's own bf16 rounding error."""
    q, k, v = inputs(dtype=torch.bfloat16)
    docs = random_documents(2, 32, 3, torch.Generator().manual_seed(3))
    out = attention(q, k, v, token_index=torch.arange(32), documents=docs)
    assert out.dtype == torch.bfloat16
    exact_in = exact_of((q, k, v))
    exact = reference(*exact_in, docs)
    within_floor(rel_err(out, exact), bf16_floor(exact), "bf16 output")
    got = grads(out, (q, k, v))
    for g, want, name in zip(got, grads(exact, exact_in, via=torch.bfloat16), "qkv",
                             strict=True):
        assert g.dtype == torch.bfloat16
        within_floor(rel_err(g, want), bf16_floor(want), f"bf16 d{name}")


def test_bf16_blocks_merge_in_fp32() -> None:
    """The blockwise core in bf16 (as on a GPU): partial outputs and lse merged in fp32. Its
    error against the exact answer stays within 4x of bf16 SDPA's own (the measured floor)."""
    q, k, v = inputs(dtype=torch.bfloat16)
    order = zigzag_order(32, 4)
    docs = random_documents(2, 32, 3, torch.Generator().manual_seed(4))
    qp, kp, vp = (x[:, :, order] for x in (q, k, v))
    out = blockwise(qp, kp, vp, order, docs[:, order])
    assert out.dtype == torch.bfloat16
    exact_in = exact_of((q, k, v))
    exact = reference(*exact_in, docs)
    sdpa_in = [x.detach().requires_grad_() for x in (q, k, v)]
    sdpa = reference(*sdpa_in, docs)  # bf16 SDPA with the boolean mask
    assert sdpa.dtype == torch.bfloat16
    within_floor(rel_err(out, exact[:, :, order]), rel_err(sdpa, exact), "bf16 output")
    back = out[:, :, torch.argsort(order)]
    want = grads(exact, exact_in, via=torch.bfloat16)
    for g, floor_g, w, name in zip(grads(back, (q, k, v)), grads(sdpa, sdpa_in), want, "qkv",
                                   strict=True):
        within_floor(rel_err(g, w), rel_err(floor_g, w), f"bf16 d{name}")


def test_packed_documents_equal_documents_run_separately() -> None:
    lengths = [7, 12, 1, 12]
    q, k, v = inputs(b=1, s=sum(lengths))
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    packed = attention(q, k, v, token_index=torch.arange(sum(lengths)), documents=docs)
    start = 0
    for n in lengths:
        piece = [x[:, :, start:start + n] for x in (q, k, v)]
        alone = attention(*piece, token_index=torch.arange(n))
        assert_close(packed[:, :, start:start + n], alone, what=f"document of {n}")
        start += n


def test_fast_path_is_plain_causal_sdpa() -> None:
    q, k, v = inputs()
    out = attention(q, k, v, token_index=torch.arange(32))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(out, want)


def _ids(index: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
    return index[None] if docs is None else torch.cat([index[None], docs.long()])


def test_zigzag_blocks_skip_the_future() -> None:
    """Rank r of C=4 holds chunks r, 7-r (4 tokens each): against an earlier rank's block only
    its first chunk is visible (one unmasked call); against a later rank's block only r's
    second chunk sees anything (one unmasked call); its own block is two causal diagonals
    plus the second chunk over the first; a future-only block is empty."""
    idx = [zigzag_token_index(32, 4, r) for r in range(4)]
    assert block_pairs(_ids(idx[2]), _ids(idx[1]), 2) == [Pair((0, 2), (0, 8), (0, 4), False)]
    assert block_pairs(_ids(idx[1]), _ids(idx[2]), 2) == [Pair((0, 2), (4, 8), (0, 8), False)]
    assert block_pairs(_ids(idx[1]), _ids(idx[1]), 2) == [
        Pair((0, 2), (0, 4), (0, 4), True), Pair((0, 2), (4, 8), (0, 4), False),
        Pair((0, 2), (4, 8), (4, 8), True)]
    # rank 3 of 4 holds chunks 3 and 4: one contiguous run, one causal call
    assert block_pairs(_ids(idx[3]), _ids(idx[3]), 2) == [Pair((0, 2), (0, 8), (0, 8), True)]
    # a block of only future tokens
    assert block_pairs(_ids(torch.arange(0, 8)), _ids(torch.arange(8, 16)), 2) == []


def test_blocks_whose_documents_cannot_meet_are_skipped() -> None:
    q_docs = torch.tensor([[0] * 4 + [1] * 4, [0] * 8])
    k_docs = torch.tensor([[2] * 8, [0] * 4 + [1] * 4])
    pairs = block_pairs(_ids(torch.arange(8, 16), q_docs), _ids(torch.arange(8), k_docs), 2)
    # row 0: documents {0, 1} against {2}: nothing; row 1: document 0 against its 4 keys
    assert pairs == [Pair((1, 2), (0, 8), (0, 4), False)]


def test_kernel_calls_follow_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward runs exactly the planned pairs: three documents in one row take three
    causal calls, none of them over the whole sequence and no mask."""
    calls = []
    real = attn._block_forward

    def counting(q, k, v, causal):
        calls.append((q.shape[2], k.shape[2], causal))
        return real(q, k, v, causal)

    monkeypatch.setattr(attn, "_block_forward", counting)
    q, k, v = inputs(b=1)
    docs = torch.tensor([[0] * 10 + [1] * 6 + [2] * 16])
    attention(q, k, v, token_index=torch.arange(32), documents=docs)
    assert calls == [(10, 10, True), (6, 6, True), (16, 16, True)]


def test_meta_shapes_and_saved_tensors() -> None:
    q, k, v = (x.detach().to("meta").requires_grad_() for x in inputs())
    docs = torch.zeros(2, 32, dtype=torch.int32, device="meta")
    for documents in (None, docs):
        out = attention(q, k, v, token_index=torch.arange(32, device="meta"),
                        documents=documents)
        assert out.shape == q.shape and out.device.type == "meta"
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_cuda_kernel_calls_fit_the_op_schemas() -> None:
    """The CUDA branch of the block kernels, on meta (shape functions only; no GPU here): the
    memory-efficient pair accepts these arguments, lse comes back unpadded, and GQA key/value
    gradients fold back to the KV heads."""
    q = torch.empty(2, 4, 40, 16, device="meta")
    k = v = torch.empty(2, 2, 24, 16, device="meta")
    out, lse = attn._block_forward(q, k, v, False)
    assert out.shape == q.shape and lse.shape == (2, 4, 40) and lse.dtype == torch.float32
    dq, dk, dv = attn._block_backward(out, q, k, v, out, lse, False)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_rejects_mismatched_shapes() -> None:
    q, k, v = inputs()
    with pytest.raises(ValueError, match="multiple of hkv"):
        attention(q, k[:, :, :16], v, token_index=torch.arange(32))
    with pytest.raises(ValueError, match="token_index must be"):
        attention(q, k, v, token_index=torch.arange(16))


@pytest.mark.quick
def test_sequence_first_views_as_the_model_passes_them() -> None:
    """The model hands [b, h, s, d] views of [s, b, h, d] tensors (not contiguous)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(32, 2, h, 16, generator=gen, dtype=torch.float64).requires_grad_()
               for h in (4, 2, 2))
    order = zigzag_order(32, 2)
    docs = random_documents(2, 32, 4, gen)
    views = [x.permute(1, 2, 0, 3) for x in (q, k, v)]
    ref = reference(*views, docs)
    got = blockwise(*(x[:, :, order] for x in views), order, docs[:, order])
    assert_close(got, ref[:, :, order], what="blockwise output")
    plain = attention(*views, token_index=torch.arange(32), documents=docs)
    assert_close(plain, ref, what="output")
    for a, b, name in zip(grads(plain, (q, k, v)), grads(ref, (q, k, v)), "qkv", strict=True):
        assert_close(a, b, what=f"d{name}")
