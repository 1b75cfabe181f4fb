"""Range arithmetic of the gradient-buffer layout, without processes."""

from __future__ import annotations

import itertools
from math import lcm

import pytest

from megatron_lite.optim.buffers import (
    BUCKET_ALIGN,
    PARAM_ALIGN,
    Range,
    build_layout,
    intersections,
    merge,
)


def test_range_intersect_and_relative() -> None:
    assert Range(0, 10).intersect(Range(5, 20)) == Range(5, 10)
    assert Range(0, 10).intersect(Range(10, 20)) is None
    assert Range(3, 7).intersect(Range(0, 100)) == Range(3, 7)
    assert Range(12, 15).relative_to(10) == Range(2, 5)
    with pytest.raises(ValueError):
        Range(5, 4)


def test_merge_joins_touching_ranges() -> None:
    assert merge([Range(5, 8), Range(0, 2), Range(2, 4), Range(7, 9)]) == [
        Range(0, 4), Range(5, 9)]


@pytest.mark.parametrize("dp,bucket_size",
                         list(itertools.product([1, 2, 3, 8, 64, 96], [1, 7, 40, 200, 10**6])))
def test_layout_invariants(dp: int, bucket_size: int) -> None:
    numels = [13, 1, 64, 5, 29, 3, 100, 0, 128]
    groups = [0, 0, 0, 1, 1, 1, 1, 1, 1]
    order = list(reversed(range(len(numels))))
    layout = build_layout(numels, groups, order, bucket_size, dp)
    align = lcm(dp, BUCKET_ALIGN)
    # Every parameter has a slot of its size at an aligned start; slots are disjoint and in
    # the given order, each as close to its predecessor as the alignment allows.
    assert [r.size for r in layout.param_ranges] == numels
    assert all(r.start % PARAM_ALIGN == 0 for r in layout.param_ranges)
    placed = [layout.param_ranges[i] for i in order]
    for a, b in itertools.pairwise(placed):
        assert a.end <= b.start
    # Buckets tile the buffer, each aligned, holding whole params of one group.
    assert layout.buckets[0].range.start == 0
    for a, b in itertools.pairwise(layout.buckets):
        assert a.range.end == b.range.start
    assert layout.buckets[-1].range.end == layout.numel
    assert layout.numel % align == 0
    assert sorted(i for b in layout.buckets for i in b.params) == list(range(len(numels)))
    for b in layout.buckets:
        assert b.range.start % align == 0 and b.range.end % align == 0
        assert len({groups[i] for i in b.params}) == 1
        for i in b.params:
            assert b.range.intersect(layout.param_ranges[i]) in (layout.param_ranges[i], None)
            assert b.range.start <= layout.param_ranges[i].start <= b.range.end
        # Padding is only what alignment needs: a gap under PARAM_ALIGN before each
        # parameter, under `align` after the last one.
        members = [layout.param_ranges[i] for i in b.params]
        assert members[0].start == b.range.start
        for x, y in itertools.pairwise(members):
            assert y.start - x.end < PARAM_ALIGN
        assert b.range.end - members[-1].end < align
        # The DP shards of a bucket tile it exactly.
        shards = [b.shard(dp, r) for r in range(dp)]
        assert shards[0].start == b.range.start and shards[-1].end == b.range.end
        assert all(s.size == b.range.size // dp for s in shards)
        assert all(x.end == y.start for x, y in itertools.pairwise(shards))
    assert layout.padding == layout.numel - sum(numels)


def _llama3_8b_numels() -> list[int]:
    """Llama-3-8B's weights in registration order (untied embedding and output)."""
    hidden, ffn, vocab = 4096, 14336, 128256
    layer = [hidden, (hidden + 2 * 1024) * hidden, hidden * hidden, hidden,
             2 * ffn * hidden, hidden * ffn]
    return [vocab * hidden, *layer * 32, hidden, vocab * hidden]


@pytest.mark.parametrize("dp", [1, 8, 64, 96])
def test_llama3_8b_padding_is_below_one_percent(dp: int) -> None:
    numels = _llama3_8b_numels()
    assert sum(numels) == 8_030_261_248
    order = list(reversed(range(len(numels))))
    layout = build_layout(numels, [0] * len(numels), order, 40_000_000, dp)
    overhead = layout.padding / layout.numel
    print(f"llama3-8b dp={dp}: {len(layout.buckets)} buckets, {layout.padding} padding "
          f"elements ({100 * overhead:.6f}% of the buffer)")
    assert overhead <= 0.01
    align = lcm(dp, BUCKET_ALIGN)
    assert all(r.start % PARAM_ALIGN == 0 for r in layout.param_ranges)
    assert all(b.range.start % align == 0 and b.range.end % align == 0
               for b in layout.buckets)


def test_bucket_closes_at_size_and_group() -> None:
    layout = build_layout([4, 4, 4, 4], [0, 0, 0, 1], [0, 1, 2, 3], bucket_size=8, dp_size=1)
    assert [b.params for b in layout.buckets] == [(0, 1), (2,), (3,)]


@pytest.mark.quick
def test_aligned_layout_by_hand() -> None:
    # Backward order: param 2 first. 100 elements -> the next start is 128; the bucket of
    # params 2 and 1 (>= 150 elements) ends at 256 = lcm(4, 128) * 2; param 0 starts a new one.
    layout = build_layout([10, 70, 100], [0, 0, 0], [2, 1, 0], bucket_size=150, dp_size=4)
    assert layout.param_ranges == (Range(256, 266), Range(128, 198), Range(0, 100))
    assert [(b.range, b.params) for b in layout.buckets] == [
        (Range(0, 256), (2, 1)), (Range(256, 384), (0,))]
    assert layout.padding == 384 - 180
    assert layout.buckets[1].shard(4, 3) == Range(352, 384)


def test_shard_intersections_cover_every_element_once() -> None:
    numels = [10, 3, 17, 1, 9]
    layout = build_layout(numels, [0] * 5, [4, 3, 2, 1, 0], bucket_size=25, dp_size=4)
    covered = dict.fromkeys(range(len(numels)), 0)
    for bucket, rank in itertools.product(layout.buckets, range(4)):
        for i, overlap in intersections(bucket.shard(4, rank), layout.param_ranges,
                                        bucket.params):
            assert layout.param_ranges[i].intersect(overlap) == overlap
            covered[i] += overlap.size
    assert covered == dict(enumerate(numels))


def test_order_must_be_a_permutation() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        build_layout([1, 2], [0, 0], [0, 0], bucket_size=10, dp_size=1)
