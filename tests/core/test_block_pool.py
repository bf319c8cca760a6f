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
