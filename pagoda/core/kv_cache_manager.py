"""Per-request block tables over a BlockPool: allocate slots for new tokens, free on finish/preempt."""

from __future__ import annotations

from pagoda.core.block_pool import BlockPool
from pagoda.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        table = self.block_tables.get(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(table))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(request, num_new_tokens) <= self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`; False (and no change) if it can't."""
        needed = self.blocks_needed(request, num_new_tokens)
        if needed > self.pool.num_free_blocks:
            return False
        table = self.block_tables.setdefault(request.request_id, [])
        if needed:
            table.extend(self.pool.allocate(needed))
        return True

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self.pool.free(table)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    def num_blocks_in_use(self) -> int:
        """Blocks held by at least one request."""
        return self.pool.num_used_blocks

    def check_invariants(self) -> None:
        """free + held + cached-free == total; each block's ref count == tables holding it."""
        self.pool.check_invariants()
        holders = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                holders[block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_count == holders[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != {holders[block.block_id]} tables")
        held = sum(1 for h in holders if h)
        assert held + self.pool.num_free_blocks == self.pool.num_blocks
