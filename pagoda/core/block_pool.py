"""KV blocks, their reference counts and an O(1) free list.

A block is free when its ref count is 0. Free blocks sit in `_free` in eviction order (front
first). A free block may still carry a hash (its K/V is valid and can be reused by a prefix hit):
such blocks are "cached-free"; they are handed out only after the blocks without a hash, and in
LRU order among themselves.

Blocks without a hash hold nothing worth keeping, so their order is free to serve locality: a
sequence's blocks are taken as consecutive ids where they can be (`allocate`'s `after` and `room`).
Decode attention reads each block's K and V as runs of a few KiB; where a sequence's blocks follow
each other in memory the hardware prefetcher runs on from one to the next, and the kernel read a
128-sequence cache 1.19-1.25x faster from memory than with the blocks scattered. Handing out the queue's
front alone gave a prompt consecutive blocks but each later decode block wherever the queue stood, after
other sequences' blocks (69% of a 128-request run's adjacent blocks consecutive; now all of them, and the
run 1.028x faster end to end, a decode-heavy one 1.083x, measured with the room kept on a request's first
allocation only: BENCHMARKS.md, "How scattered the engine's blocks are, and keeping them consecutive").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, keep_freed_hashes: bool = True,
                 on_evict: Callable[[int, bytes], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Two queues keep "reuse blocks without a hash first" O(1): uncached first, then cached LRU.
        self._free_uncached: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self.hash_to_block: dict[bytes, int] = {}
        # False (prefix caching off): a block forgets its hash when its last holder frees it.
        self.keep_freed_hashes = keep_freed_hashes
        self.on_evict = on_evict  # told (block_id, hash) before a cached block's content is reused

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (including cached-free ones, which get evicted)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self, n: int, after: int | None = None, room: int = 0) -> list[int]:
        """n blocks. after: the block the caller's table ends with; each block is the one after the previous
        (after + 1, ...) where that one is free without a hash, else the queue's front. room: how many blocks the
        caller expects to append later; that many free blocks without a hash right after the last one allocated
        move to the back of their queue, so that other callers take them last (they stay free: when the rest
        runs out, anyone gets them)."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks with {self.num_free_blocks} free")
        out = []
        prev = after
        for _ in range(n):
            if prev is not None and prev + 1 in self._free_uncached:
                block_id = prev + 1
                del self._free_uncached[block_id]
            elif self._free_uncached:
                block_id, _ = self._free_uncached.popitem(last=False)
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                block_hash = self.blocks[block_id].block_hash
                if self.on_evict is not None and block_hash is not None:
                    self.on_evict(block_id, block_hash)
                self._evict_hash(self.blocks[block_id])
            block = self.blocks[block_id]
            assert block.ref_count == 0
            block.ref_count = 1
            out.append(block_id)
            prev = block_id
        if prev is not None:
            for block_id in range(prev + 1, min(prev + 1 + room, self.num_blocks)):
                if block_id not in self._free_uncached:
                    break
                self._free_uncached.move_to_end(block_id)
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the back of the free queue.

        Callers pass a request's blocks in table order; freeing in reverse makes a chain's tail
        evicted before its head.
        """
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if not self.keep_freed_hashes:
                    self._evict_hash(block)
                queue = self._free_cached if block.block_hash is not None else self._free_uncached
                queue[block_id] = None

    def touch(self, block_id: int) -> None:
        """Take one more reference to a block (a prefix-cache hit), reviving it if free."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._free_cached.pop(block_id, None)
            self._free_uncached.pop(block_id, None)
        block.ref_count += 1

    def register_hash(self, block_id: int, block_hash: bytes) -> None:
        """Record that a full block holds the tokens named by `block_hash`."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.hash_to_block:
            return  # already cached (same content elsewhere): keep the first copy
        block.block_hash = block_hash
        self.hash_to_block[block_hash] = block_id

    def lookup(self, block_hash: bytes) -> int | None:
        return self.hash_to_block.get(block_hash)

    def _evict_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self.hash_to_block[block.block_hash]
            block.block_hash = None

    def reset_cache(self) -> None:
        """Forget every cached hash of a free block (their K/V will be overwritten)."""
        while self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)
            self._evict_hash(self.blocks[block_id])
            self._free_uncached[block_id] = None

    def check_invariants(self) -> None:
        free_ids = set(self._free_uncached) | set(self._free_cached)
        assert len(free_ids) == len(self._free_uncached) + len(self._free_cached), "block in both free queues"
        for block in self.blocks:
            assert (block.ref_count == 0) == (block.block_id in free_ids), f"block {block.block_id} state"
            assert block.ref_count >= 0
            if block.block_id in self._free_cached:
                assert block.block_hash is not None
            if block.block_hash is not None:
                assert self.hash_to_block[block.block_hash] == block.block_id
        assert len(self.hash_to_block) == sum(b.block_hash is not None for b in self.blocks)
