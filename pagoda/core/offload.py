"""The second KV tier's index: which block hashes live in which slot of a bounded host pool.

Cached blocks about to be evicted from the main pool are copied into a slot here (LRU when full);
a later prefix lookup that misses the main pool continues its chain here and copies the blocks
back instead of recomputing them. The copies themselves are done by the worker (`swap_out` /
`swap_in` in SchedulerOutput), out before in, before the step's forward pass.
"""

from __future__ import annotations

from collections import OrderedDict


class OffloadIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"kv_offload_memory must hold at least one block, got {num_slots} slots")
        self.num_slots = num_slots
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recent first
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()  # slots read this step: not to be overwritten before the copy
        self.queries = 0  # blocks looked up here
        self.hits = 0  # blocks found here
        self.stores = 0  # blocks written here

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._lru

    def lookup(self, block_hash: bytes) -> int | None:
        self.queries += 1
        slot = self._lru.get(block_hash)
        if slot is not None:
            self.hits += 1
            self._lru.move_to_end(block_hash)
            self._pinned.add(slot)
        return slot

    def insert(self, block_hash: bytes) -> int | None:
        """A slot for `block_hash` (evicting the least recently used); None if every slot is pinned."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return None  # already stored: nothing to copy
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((h for h, s in self._lru.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self._lru.pop(victim)
        self._lru[block_hash] = slot
        self.stores += 1
        return slot

    def end_step(self) -> None:
        self._pinned.clear()

    def clear(self) -> None:
        self._lru.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._pinned.clear()
