import pytest

from zeroshard.partition import assign_buckets, flat_layout, round_up


def test_round_up():
    assert [round_up(v, 4) for v in (0, 1, 4, 5, 8)] == [0, 4, 4, 8, 8]


def test_flat_layout_offsets_padding_and_shards():
    layout = flat_layout(["a", "b", "c"], [(2, 3), (5,), (1,)], shard_count=4)
    assert [s.offset for s in layout.slots] == [0, 6, 11]
    assert layout.numel == 12 and layout.padded_numel == 12 and layout.padding == 0
    layout = flat_layout(["a", "b"], [(3,), (4,)], shard_count=4)
    assert layout.numel == 7 and layout.padded_numel == 8 and layout.shard_numel == 2 and layout.padding == 1
    assert [layout.shard_range(r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="shard rank 4"):
        layout.shard_range(4)


def test_segments_cover_every_element_exactly_once():
    shapes = [(3, 5), (7,), (1,), (4, 4)]
    layout = flat_layout(list("abcd"), shapes, shard_count=3)
    covered = {}
    for rank in range(3):
        lo, _ = layout.shard_range(rank)
        for seg in layout.segments(rank):
            assert seg.flat_start == lo + seg.shard_start
            for i in range(seg.numel):
                key = seg.flat_start + i
                assert key not in covered
                covered[key] = seg.slot.name
    assert len(covered) == layout.numel
    # a parameter split across two shards appears in both
    assert {s.slot.name for s in layout.segments(0)} & {s.slot.name for s in layout.segments(1)}


def test_assign_buckets():
    assert assign_buckets([4, 4, 4], 8) == [[0, 1], [2]]
    assert assign_buckets([10, 1, 1], 8) == [[0], [1, 2]]  # oversize parameter alone
    assert assign_buckets([3, 3, 3], 0) == [[0, 1, 2]]  # 0 = one bucket
    assert assign_buckets([], 8) == []


def test_empty_layout_still_has_one_element_per_shard():
    layout = flat_layout([], [], shard_count=2)
    assert layout.numel == 0 and layout.padded_numel == 2
