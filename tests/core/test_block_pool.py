from __future__ import annotations

import pytest

from pagoda.core.block_pool import BlockPool


def test_allocate_free_is_lifo_free_of_leaks() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free_blocks == 1
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    pool.free(a)
    assert pool.num_free_blocks == 4
    pool.check_invariants()


def test_ref_counts_and_double_free() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.touch(b)
    assert pool.blocks[b].ref_count == 2
    pool.free([b])
    assert pool.num_free_blocks == 1
    pool.free([b])
    assert pool.num_free_blocks == 2
    with pytest.raises(AssertionError):
        pool.free([b])


def test_cached_blocks_are_reused_after_uncached_in_lru_order() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.register_hash(a, b"ha")
    pool.register_hash(b, b"hb")
    pool.free([a])
    pool.free([b])
    pool.free([c])
    assert pool.num_cached_free_blocks == 2
    assert pool.allocate(1) == [c]  # no hash: first
    assert pool.allocate(1) == [a]  # then the least recently freed cached block, its hash dropped
    assert pool.lookup(b"ha") is None and pool.lookup(b"hb") == b
    pool.check_invariants()


def test_allocate_takes_the_blocks_after_the_tables_last_where_free() -> None:
    """after: the next ids where they are free without a hash; the queue's front where they are not."""
    pool = BlockPool(10)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert pool.allocate(2, after=1) == [3, 4]  # 2 is held: the front (3), then the one after it
    pool.free([3])
    assert pool.allocate(1, after=2) == [3]  # freed, no hash: taken again for the table ending at 2
    assert pool.allocate(1, after=9) == [5]  # past the last block: the front
    pool.check_invariants()


def test_allocate_leaves_room_behind_a_table_for_its_later_blocks() -> None:
    """room: the free blocks right after the last one allocated go to the back of the queue, so that another
    table's allocations pass them by and the first table's next ones find them."""
    pool = BlockPool(12)
    a = pool.allocate(2, room=3)
    assert a == [0, 1]
    b = pool.allocate(2, room=3)
    assert b == [5, 6]  # 2, 3, 4 kept for a
    assert pool.allocate(1, after=a[-1]) == [2] and pool.allocate(1, after=b[-1]) == [7]
    assert pool.allocate(3) == [10, 11, 3]  # the rooms go last, but they go
    pool.check_invariants()


def test_allocate_does_not_evict_a_cached_block_for_locality() -> None:
    """A free block that still holds a cached prefix is not taken as 'the one after': uncached blocks first."""
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.register_hash(b, b"hb")
    pool.free([b])
    assert pool.allocate(1, after=a) == [3]
    assert pool.lookup(b"hb") == b
    pool.check_invariants()
