"""GPU-only ring-attention bugs, planted, that the rank dry run must catch now that the ring
runs from a host plan (no document ids travel with K/V):

- a receive buffer created on the host (an NCCL group has no backend for it);
- the ring direction swapped on odd CP ranks (CP=4: sends meet sends);
- the backward's K/V and dK/dV transfers posted in the other order on odd CP ranks (equal
  shapes and dtypes, so only the call-site identities tell them apart).

Each case also runs unplanted, so the check is shown to pass on today's code.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lite.arguments import parse_config
from megatron_lite.dry_run import run_rank
from megatron_lite.layers import attention
from megatron_lite.layers.attention import Ring
from megatron_lite.parallel.audit import DeviceDisciplineError, match

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--num-query-groups", "1", "--seq-length", "32", "--vocab-size", "64",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--dry-run"]


def _match_ring(cp: int) -> str | None:
    cfg = parse_config([*TINY, "--context-parallel-size", str(cp)])
    return match({r: run_rank(cfg, cp, r, time_host=False).ops for r in range(cp)})


def test_unplanted_rings_match() -> None:
    assert _match_ring(2) is None
    assert _match_ring(4) is None


def test_a_host_receive_buffer_is_named(monkeypatch) -> None:
    real = attention._Posted.__init__

    def planted(self, ring, tensors, tag, names, step):
        empty_like = torch.empty_like
        monkeypatch.setattr(torch, "empty_like", lambda t: empty_like(t, device="cpu"))
        try:
            real(self, ring, tensors, tag, names, step)
        finally:
            monkeypatch.setattr(torch, "empty_like", empty_like)

    monkeypatch.setattr(attention._Posted, "__init__", planted)
    with pytest.raises(DeviceDisciplineError, match=r"recv over ranks \[0, 1\].* is on cpu"):
        _match_ring(2)


def test_ring_direction_swapped_on_odd_ranks_fails(monkeypatch) -> None:
    def nxt(self: Ring) -> int:
        step = -1 if self.rank % 2 else 1
        return self.ranks[(self.rank + step) % self.size]

    def prv(self: Ring) -> int:
        step = 1 if self.rank % 2 else -1
        return self.ranks[(self.rank + step) % self.size]

    monkeypatch.setattr(Ring, "next", property(nxt))
    monkeypatch.setattr(Ring, "prev", property(prv))
    problem = _match_ring(4)
    print(problem)
    assert problem is not None and problem.startswith("rank ")
    assert "(ring_kv, ring_step 0)" in problem


def test_backward_kv_and_dkv_posted_in_the_other_order_on_odd_ranks_fails(monkeypatch
                                                                          ) -> None:
    """Odd ranks hold each backward K/V send back until the step's dK/dV is posted, so the
    pair sees (dkv, kv) where the even rank expects (kv, dkv): same shape, same dtype."""
    real = attention._Posted
    held: list[tuple] = []

    class Deferred:
        def __init__(self, ring, tensors, tag, names, step) -> None:
            self.inner = None
            if names == ("ring_kv_backward",) and ring.rank % 2:
                held.append((self, (ring, tensors, tag, names, step)))
                return
            self.inner = real(ring, tensors, tag, names, step)
            while held:
                waiting, args = held.pop()
                waiting.inner = real(*args)

        def wait(self) -> list[torch.Tensor]:
            while held:
                waiting, args = held.pop()
                waiting.inner = real(*args)
            return self.inner.wait()

    monkeypatch.setattr(attention, "_Posted", Deferred)
    problem = _match_ring(2)
    print(problem)
    assert problem is not None
    assert "(ring_kv_backward, ring_step 0)" in problem and "expects (ring_dkv" in problem
    assert "same shapes, different identities" in problem
