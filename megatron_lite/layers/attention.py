"""Causal attention over token indices: document masks and ring context parallelism.

`attention(q, k, v, token_index=..., documents=..., ring=...)` is exact causal attention in
which query t sees key u iff u <= t by *full-sequence* token index and both are in the same
document. Under context parallelism (`ring`, C ranks) rank i holds chunks i and 2C-1-i of the
2C equal chunks (the zigzag that gives every rank the same causal work) and K/V blocks travel
round the ring. Without a ring and without documents the call is today's plain causal SDPA
(the CP=1 fast path; token_index is then 0..s-1 and not read).

How a block is computed. Attention between a query block and a key block (with their token
indices and documents) is cut into *pairs* (`block_pairs`): maximal runs of consecutive token
indices inside one document on each side, matched by document, and each match split into a
fully visible part and a diagonal part. A fully visible pair runs the flash kernel unmasked,
a diagonal one causal, and a pair where no query sees a key is never computed; so an
all-future block (or one whose documents cannot meet) costs nothing, and no mask tensor is
ever built. Partial results are merged by log-sum-exp in fp32 (online softmax), and the
backward calls the block backward kernel with the *final* out and lse per pair (the softmax
gradient needs only those). Kernels: `aten._scaled_dot_product_flash_attention_for_cpu` and its
backward on the CPU (native GQA); on CUDA the memory-efficient kernel pair (fp32 and bf16, GQA
by expanding K/V heads per pair; written against the op schemas, not yet run on a GPU). On
the CPU a bf16 core runs in fp32, as the model's attention always did. On meta (the dry run)
no values exist to plan with: shapes come out right, the ring's p2p traffic is issued, and q,
k, v, out, lse are saved as a flash kernel would.

Document masks: per-document pairs (the variable-length path) rather than one masked call.
Measured on this CPU (`python bench/context_parallel.py`, 1 thread, b=1, 8 heads of 64, fwd +
bwd, documents cut at random; pairs / SDPA with the s x s boolean mask): s=2048: 0.60x with 1
document, 0.20x with 8, 0.08x with 32; s=4096: 0.57x, 0.12x, 0.08x. The masked SDPA is slower
than plain causal attention even with one document (1.6-2.0x: it cannot skip the masked
tiles), while the pairs run 0.16-0.34x of plain causal at 8-32 documents because they skip the
cross-document work; with one document they match it (1.01x at s=1024, 15 repeats). They are
exact and build no s x s mask; their cost is a host copy of the token indices and document ids
of each block to plan with (a device sync on CUDA) and one kernel call per document run.
FlexAttention block masks would be the CUDA answer to very many tiny documents, but they have
no CPU backward, so they could not be checked here against this path; not used.

Ring backward: K/V travel round the ring a second time with their dK/dV accumulator one step
behind (as in the published ring-attention implementations), so a rank holds one received block
and one in flight, never all C; the traffic is K/V plus fp32 dK/dV per step. Keeping every
received block instead would save the K/V resend at C-1 extra blocks of memory per layer.

Host syncs. The plan of every ring step (`AttentionPlan`, which pairs run) is made once per
micro-batch on the host by the loader (`attention_plan`, from the host batch's token indices and
the *whole* sequence's document ids before the CP split) and rides in the batch to every layer
and to recomputation; every rank derives every other rank's zigzag token indices, so no ids
travel the ring and nothing is copied back to the host (0 syncs per layer). Without a plan
and without documents a plan is derived from the zigzag alone (also 0 syncs); only a caller
that passes documents on a device without a plan pays today's way: ids travel with K/V and
each block is copied to the host to plan (C + 1 syncs per layer; on meta they are counted as
such by `parallel.host_syncs.HostSyncCounter`).

GQA. K/V are never repeated to the query head count on the kernels a run uses: the CPU kernel
and the CUDA flash kernel (bf16/fp16: the training dtypes) take hkv < hq heads natively (flash
sums dK/dV over each group inside its backward). Only the CUDA memory-efficient kernel (fp32,
used for checks, not training) needs equal heads, so that path alone repeats K/V per pair.

dK/dV bytes. The accumulator that travels with the backward is fp32 at the KV heads: per step
2 x b x hkv x s/C x d x 4 bytes, twice the bf16 K/V that travel beside it. 70B at TP8 (1 KV head
of 128 per rank), S = 128K, C = 8, b = 1: K/V 8 MiB and dK/dV 16 MiB per step, 24 MiB x 7 steps
per layer = 168 MiB; at ~360 GB/s NVLink that is ~0.5 ms against ~17 ms of the layer's
attention backward on an H100, hidden behind it. In bf16 the dK/dV sum over C steps would round
C times at 2^-9 relative (8 bits of mantissa: C = 8 loses ~3 of them on the last added blocks)
and save 8 MiB per step of traffic that is already hidden, so the fp32 accumulator stays.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megatron_lite.kernels._precision import math_dtype, upcast
from megatron_lite.parallel import host_syncs
from megatron_lite.parallel.audit import batch_identity, group_kind, identity


@dataclass(frozen=True)
class Ring:
    """The context-parallel ring of this rank (its `LayerContext` builds it from the CP
    group)."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    """Global ranks of the CP group, indexed by cp rank."""
    rank: int
    """This rank's cp rank."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next(self) -> int:
        return self.ranks[(self.rank + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.ranks[(self.rank - 1) % self.size]


@dataclass(frozen=True)
class Pair:
    """One kernel call: queries [q) x keys [k) of batch rows [rows), all visible or causal."""

    rows: tuple[int, int]
    q: tuple[int, int]
    k: tuple[int, int]
    causal: bool


def zigzag_token_index(seq_length: int, size: int, rank: int) -> Tensor:
    """Token indices of cp rank `rank` of `size`: chunks rank and 2 size-1-rank of 2 size."""
    if seq_length % (2 * size):
        raise ValueError(f"sequence length {seq_length} is not a multiple of 2 x CP ({size})")
    chunk = seq_length // (2 * size)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)])


def _segments(index: Tensor, docs: Tensor | None) -> list[tuple[int, int, int, int]]:
    """Maximal runs of consecutive token indices within one document, as
    (start, stop, first token index, document)."""
    cut = index[1:] != index[:-1] + 1
    if docs is not None:
        cut |= docs[1:] != docs[:-1]
    starts = [0, *(torch.nonzero(cut).flatten() + 1).tolist()]
    stops = [*starts[1:], index.numel()]
    firsts = index[starts].tolist()
    ids = docs[starts].tolist() if docs is not None else [0] * len(starts)
    return list(zip(starts, stops, firsts, ids, strict=True))


def _match(qseg: tuple[int, int, int, int], kseg: tuple[int, int, int, int],
           rows: tuple[int, int]) -> list[Pair]:
    """The pairs of two runs of one document: keys before every query are fully visible,
    the shared token range is causal, and queries after it see it fully."""
    qs, qe, a, _ = qseg
    ks, ke, c, _ = kseg
    b, d = a + qe - qs - 1, c + ke - ks - 1  # last token index of each run
    if c > b:
        return []  # every key is after every query
    if d <= a:
        return [Pair(rows, (qs, qe), (ks, ke), False)]
    lo, hi = max(a, c), min(b, d)
    shared = (ks + lo - c, ks + hi + 1 - c)
    pairs = [Pair(rows, (qs + lo - a, qs + hi + 1 - a), shared, True)]
    if c < lo:
        pairs.append(Pair(rows, (qs, qe), (ks, ks + lo - c), False))
    if b > hi:
        pairs.append(Pair(rows, (qs + hi + 1 - a, qe), shared, False))
    return pairs


def _coalesce(pairs: list[Pair]) -> list[Pair]:
    """Merge pairs that tile one larger kernel call: visible pairs adjacent in queries (same
    keys) or in keys (same queries), and any pairs adjacent in rows."""
    def merge(items: list[Pair], key, field: str, allow_causal: bool) -> list[Pair]:
        groups: dict = defaultdict(list)
        for p in items:
            groups[key(p)].append(p)
        merged = []
        for group in groups.values():
            group.sort(key=lambda p: getattr(p, field))
            run = group[0]
            for p in group[1:]:
                lo, hi = getattr(run, field)
                if getattr(p, field)[0] == hi and (allow_causal or not p.causal):
                    run = replace(run, **{field: (lo, getattr(p, field)[1])})
                else:
                    merged.append(run)
                    run = p
            merged.append(run)
        return merged

    pairs = merge(pairs, lambda p: (p.causal, p.rows, p.k), "q", False)
    pairs = merge(pairs, lambda p: (p.causal, p.rows, p.q), "k", False)
    pairs = merge(pairs, lambda p: (p.causal, p.q, p.k), "rows", True)
    return sorted(pairs, key=lambda p: (p.rows, p.q, p.k))


def block_pairs(q_ids: Tensor, k_ids: Tensor, batch: int) -> list[Pair]:
    """The kernel calls of one (query block, key block): empty when no query sees any key.

    An ids tensor is int64 [1, s] (token indices) or [1 + batch, s] (token indices, then each
    row's document ids), on the host."""
    if q_ids.shape[0] == 1:
        rows = [((0, batch), None, None)]
    else:
        rows = [((r, r + 1), q_ids[1 + r], k_ids[1 + r]) for r in range(batch)]
    pairs = []
    for span, q_docs, k_docs in rows:
        by_doc = defaultdict(list)
        for kseg in _segments(k_ids[0], k_docs):
            by_doc[kseg[3]].append(kseg)
        for qseg in _segments(q_ids[0], q_docs):
            for kseg in by_doc.get(qseg[3], ()):
                pairs += _match(qseg, kseg, span)
    return _coalesce(pairs)


@dataclass(frozen=True)
class AttentionPlan:
    """Every ring step's kernel calls for one micro-batch on one CP rank, made on the host once
    and reused by every layer (and by recomputation): step j pairs this rank's queries with
    the K/V block of cp rank (rank - j) mod C. A ring of one has one step, the local block."""

    batch: int
    seq: int
    """Local tokens (the sequence / C)."""
    steps: tuple[tuple[Pair, ...], ...]


def _rank_ids(index: Tensor, documents: Tensor | None) -> Tensor:
    ids = index.to(torch.int64).unsqueeze(0)
    return ids if documents is None else torch.cat([ids, documents[:, index].to(torch.int64)])


def attention_plan(seq_length: int, cp_size: int, cp_rank: int, batch: int,
                   documents: Tensor | None = None) -> AttentionPlan:
    """The plan of cp rank `cp_rank`: zigzag token indices for every rank (derived, not
    received) and, with `documents`, the *whole* sequence's document ids [batch, seq_length]
    on the host (the loader has them before the CP split)."""
    if documents is not None and tuple(documents.shape) != (batch, seq_length):
        raise ValueError(f"attention_plan: documents must be [{batch}, {seq_length}], got "
                         f"{tuple(documents.shape)}")
    if documents is None:
        return _derived_plan(seq_length, cp_size, cp_rank, batch)
    documents = documents.cpu()  # a host tensor already (the loader's); no device sync
    ids = [_rank_ids(zigzag_token_index(seq_length, cp_size, r), documents)
           for r in range(cp_size)]
    steps = tuple(tuple(block_pairs(ids[cp_rank], ids[(cp_rank - j) % cp_size], batch))
                  for j in range(cp_size))
    return AttentionPlan(batch, seq_length // cp_size, steps)


def _derived_plan(seq_length: int, cp_size: int, cp_rank: int, batch: int) -> AttentionPlan:
    """Without documents the plan depends only on the shapes and the zigzag (a few small
    host calls; not cached, so that a patched `block_pairs` is always the one planning)."""
    ids = [_rank_ids(zigzag_token_index(seq_length, cp_size, r), None) for r in range(cp_size)]
    steps = tuple(tuple(block_pairs(ids[cp_rank], ids[(cp_rank - j) % cp_size], batch))
                  for j in range(cp_size))
    return AttentionPlan(batch, seq_length // cp_size, steps)


def _expand_heads(x: Tensor, heads: int) -> Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _flash(dtype: torch.dtype) -> bool:
    """The CUDA flash kernel (native GQA) runs the 16-bit dtypes; fp32 needs memory-efficient."""
    return dtype in (torch.bfloat16, torch.float16)


def _philox(device: torch.device) -> tuple[Tensor, Tensor]:
    # No dropout: the backward does not read the RNG state; shaped as the forward returns it.
    return (torch.zeros(2, dtype=torch.int64, device=device),
            torch.zeros((), dtype=torch.int64, device=device))


def _block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    """(out, lse fp32 [b, h, sq]) of one pair."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    if _flash(q.dtype):  # K/V at their own head count: flash-attention takes GQA natively
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
        return out, lse
    q, k, v = q.contiguous(), _expand_heads(k, q.shape[1]), _expand_heads(v, q.shape[1])
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k.contiguous(), v.contiguous(), None, True, 0.0, causal)[:2]
    return out, lse[..., : q.shape[2]]  # the CUDA kernel pads lse to a multiple of 32


def _block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one pair, given the final out and lse of its queries."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal)
    if _flash(q.dtype):
        seed, offset = _philox(q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2],
            0.0, causal, seed, offset)
    hkv, heads = k.shape[1], q.shape[1]
    ke, ve = (_expand_heads(x, heads).contiguous() for x in (k, v))
    lse = F.pad(lse, (0, -q.shape[2] % 32)).contiguous()
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: unused
    dq, dk, dv = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q.contiguous(), ke, ve, None, out.contiguous(), lse, seed, seed, 0.0,
        [True, True, True, False], causal)[:3]
    if hkv != heads:
        dk, dv = (g.unflatten(1, (hkv, heads // hkv)).sum(2) for g in (dk, dv))
    return dq, dk, dv


_FORWARD_TAG, _KV_TAG, _DKV_TAG = 0, 2, 3  # distinct p2p tags: gloo matches sends by tag


class _Posted:
    """Tensors sent to the next ring rank and received from the previous one, in flight.

    `names` say what each tensor is; with the ring step they are the ops' identities under
    an audit (NCCL matches the sends and receives of a pair in posting order, not by tag).
    """

    def __init__(self, ring: Ring, tensors: list[Tensor], tag: int, names: tuple[str, ...],
                 step: int) -> None:
        self.received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, ring.next, ring.group, tag + i) for i, t in
               enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, ring.prev, ring.group, tag + i) for i, t in
                enumerate(self.received)]
        with batch_identity(lambda: [(op.tensor, identity(n, ring_step=step))
                                     for op, n in zip(ops, names * 2)]), group_kind("cp"):
            self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[Tensor]:
        for work in self.works:
            work.wait()
        return self.received


def _view(x: Tensor, p: Pair, side: str) -> Tensor:
    lo, hi = getattr(p, side)
    return x[p.rows[0]:p.rows[1], :, lo:hi]


class _RingAttention(torch.autograd.Function):
    """Blockwise attention over the ring (a ring of one: the local block only)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ids: Tensor, ring: Ring | None,
                *planned: AttentionPlan | None) -> Tensor:
        plan = planned[0] if planned else None
        ctx.extra_inputs = len(planned)
        steps = ring.size if ring is not None else 1
        b, hq, s, _ = q.shape
        acc = math_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full((b, hq, s), -math.inf, dtype=acc, device=q.device)
        # Without a host plan the ids travel with K/V and each block is planned from a host
        # copy (the CPU, where that costs no sync; or a device caller with documents).
        traveling = plan is None
        computed = not traveling or q.device.type != "meta"
        if traveling and q.device.type != "cpu":
            host_syncs.note_meta_syncs(q.device, steps + 1)  # what the GPU pays, seen on meta
        local = ids.cpu() if traveling and computed else None
        kv, block_ids, plans = torch.stack([k, v]), ids, []
        for step in range(steps):
            posted = None
            if step + 1 < steps:
                posted = (_Posted(ring, [kv, block_ids], _FORWARD_TAG, ("ring_kv", "ring_ids"),
                                  step) if traveling else
                          _Posted(ring, [kv], _FORWARD_TAG, ("ring_kv",), step))
            if not traveling:
                step_plan = list(plan.steps[step])
            else:
                step_plan = block_pairs(local, block_ids.cpu(), b) if computed else []
            for p in step_plan:
                o, o_lse = _block_forward(_view(q, p, "q"), _view(kv[0], p, "k"),
                                          _view(kv[1], p, "k"), p.causal)
                acc_o, acc_l = _view(out, p, "q"), lse[p.rows[0]:p.rows[1], :, p.q[0]:p.q[1]]
                new_l = torch.logaddexp(acc_l, o_lse)
                acc_o.mul_(torch.exp(acc_l - new_l).unsqueeze(-1))
                acc_o.add_(upcast(o) * torch.exp(o_lse - new_l).unsqueeze(-1))
                acc_l.copy_(new_l)
            plans.append(step_plan)
            if posted is not None:
                received = posted.wait()
                kv, block_ids = (received[0], received[1]) if traveling else (received[0], ids)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.plans = ring, plans
        return out

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring, plans = ctx.ring, ctx.plans
        steps = len(plans)
        dout = dout.contiguous()
        acc = math_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv, dkv_posted, dkv = torch.stack([k, v]), None, None
        for step in range(steps):
            kv_posted = (_Posted(ring, [kv], _KV_TAG, ("ring_kv_backward",), step)
                         if step + 1 < steps else None)
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
            for p in plans[step]:
                gq, gk, gv = _block_backward(
                    _view(dout, p, "q"), _view(q, p, "q"), _view(kv[0], p, "k"),
                    _view(kv[1], p, "k"), _view(out, p, "q"),
                    lse[p.rows[0]:p.rows[1], :, p.q[0]:p.q[1]], p.causal)
                _view(dq, p, "q").add_(gq)
                _view(dkv[0], p, "k").add_(gk)
                _view(dkv[1], p, "k").add_(gv)
            if dkv_posted is not None:  # the accumulator of the block in hand, one step behind
                dkv += dkv_posted.wait()[0]
            if ring is not None:
                dkv_posted = _Posted(ring, [dkv], _DKV_TAG, ("ring_dkv",), step)
            if kv_posted is not None:
                kv = kv_posted.wait()[0]
        if dkv_posted is not None:
            dkv = dkv_posted.wait()[0]  # back home: the sum over every rank's queries
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None,
                *[None] * ctx.extra_inputs)


def attention(q: Tensor, k: Tensor, v: Tensor, *, token_index: Tensor,
              documents: Tensor | None = None, ring: Ring | None = None,
              plan: AttentionPlan | None = None) -> Tensor:
    """Causal (and, with `documents`, same-document) attention by full-sequence token index.

    q [b, hq, s, d]; k, v [b, hkv, s, d] with hq a multiple of hkv; token_index [s] int64, each
    local token's index in the full sequence (0..s-1 without a ring); documents [b, s] int
    document ids, non-decreasing along the full sequence, or None; `plan` the micro-batch's
    host plan (`attention_plan`), which then decides the kernel calls (token_index and
    documents are not read). Returns [b, hq, s, d] in q's dtype.
    """
    b, hq, s, _ = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != s or hq % k.shape[1]:
        raise ValueError(f"attention: q {tuple(q.shape)} and k/v {tuple(k.shape)}/"
                         f"{tuple(v.shape)} are not [b, hq, s, d] and [b, hkv, s, d] with hq a "
                         "multiple of hkv")
    if tuple(token_index.shape) != (s,) or (documents is not None
                                           and tuple(documents.shape) != (b, s)):
        raise ValueError(f"attention: token_index must be [{s}] and documents [{b}, {s}], got "
                         f"{tuple(token_index.shape)} and "
                         f"{None if documents is None else tuple(documents.shape)}")
    if ring is not None and ring.size == 1:
        ring = None
    steps = ring.size if ring is not None else 1
    if plan is not None and (plan.batch, plan.seq, len(plan.steps)) != (b, s, steps):
        raise ValueError(f"attention: the plan is for batch {plan.batch}, {plan.seq} local "
                         f"tokens and {len(plan.steps)} ring steps, not {b}, {s} and {steps}")
    dtype = q.dtype
    if q.device.type == "cpu" and dtype == torch.bfloat16:
        # The CPU flash-attention backward is ~4x slower in bf16 than in fp32 at small head
        # dims (bench/shakespeare.py), so the CPU core runs in fp32.
        q, k, v = q.float(), k.float(), v.float()
    if ring is None and documents is None:
        # One causal block: today's plain SDPA call, as fast as before.
        if q.device.type == "meta":
            # A dry run stands in for a GPU run, where SDPA picks the flash kernel (it saves
            # q, k, v, out and the log-sum-exp); on meta SDPA would take the math path and
            # materialise the s x s scores, which no GPU run does.
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=k.shape[1] != q.shape[1])
        return out.to(dtype)
    if plan is None and documents is None and q.device.type != "cpu":
        plan = _derived_plan(s * steps, steps, ring.rank if ring is not None else 0, b)
    if plan is not None:
        ids = token_index[:0]  # not read, not sent
    else:
        ids = token_index.to(torch.int64).unsqueeze(0)
        if documents is not None:
            ids = torch.cat([ids, documents.to(torch.int64)])
    return _RingAttention.apply(q, k, v, ids, ring, plan).to(dtype)
