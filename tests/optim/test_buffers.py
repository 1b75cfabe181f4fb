"""Range arithmetic of the gradient-buffer layout, without processes."""

from __future__ import annotations

import itertools

import pytest

from megatron_lite.optim.buffers import Range, build_layout, intersections, merge


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
                         list(itertools.product([1, 2, 3, 8], [1, 7, 40, 10**6])))
def test_layout_invariants(dp: int, bucket_size: int) -> None:
    numels = [13, 1, 64, 5, 29, 3, 100]
    groups = [0, 0, 0, 1, 1, 1, 1]
    order = list(reversed(range(len(numels))))
    layout = build_layout(numels, groups, order, bucket_size, dp)
    # Every parameter has a slot of its size, slots are disjoint and in the given order.
    assert [r.size for r in layout.param_ranges] == numels
    starts = [layout.param_ranges[i].start for i in order]
    assert starts == sorted(starts)
    # Buckets tile the buffer, each a multiple of dp, holding whole params of one group.
    assert layout.buckets[0].range.start == 0
    for a, b in itertools.pairwise(layout.buckets):
        assert a.range.end == b.range.start
    assert layout.buckets[-1].range.end == layout.numel
    assert sorted(i for b in layout.buckets for i in b.params) == list(range(len(numels)))
    for b in layout.buckets:
        assert b.range.size % dp == 0
        assert len({groups[i] for i in b.params}) == 1
        for i in b.params:
            assert b.range.intersect(layout.param_ranges[i]) == layout.param_ranges[i]
        # Padding per bucket is below dp elements.
        assert b.range.size - sum(numels[i] for i in b.params) < dp
        # The DP shards of a bucket tile it exactly.
        shards = [b.shard(dp, r) for r in range(dp)]
        assert shards[0].start == b.range.start and shards[-1].end == b.range.end
        assert all(s.size == b.range.size // dp for s in shards)
        assert all(x.end == y.start for x, y in itertools.pairwise(shards))
    assert layout.padding == layout.numel - sum(numels)


def test_bucket_closes_at_size_and_group() -> None:
    layout = build_layout([4, 4, 4, 4], [0, 0, 0, 1], [0, 1, 2, 3], bucket_size=8, dp_size=1)
    assert [b.params for b in layout.buckets] == [(0, 1), (2,), (3,)]


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
