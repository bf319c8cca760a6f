"""Per-request block tables over a BlockPool: prefix lookup, allocate, register full blocks, free.

Prefix caching: a new request looks up the longest chain of cached full blocks of its tokens (the
last token is always computed, since its logits are needed) and starts after them. Full blocks are
registered under their chained hash as soon as they are computed, so later requests (or this one,
after preemption) can hit them. With caching off, blocks drop their hash when freed, and lookups
are made only by samples of the same request (n > 1), which share the prompt's blocks.

With a second tier (`offload_blocks` > 0), a cached block about to be evicted is first copied to
the tier, and a lookup that misses here continues its chain there: those blocks are allocated
here and copied back (swap-in) before the step's forward pass instead of being recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.core.block_hash import extend_hashes, root_hash
from pagoda.core.block_pool import BlockPool
from pagoda.core.offload import OffloadIndex
from pagoda.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Blocks each allocation of a request keeps free behind its table for its later ones (BlockPool.allocate's room):
# as many as its expected length still needs, at most this many (1,024 tokens at the default block size), so that
# an allocation moves few queue entries; renewed at each allocation, so a longer request keeps room ahead of it.
ROOM_BLOCKS = 64


@dataclass
class PrefixHit:
    blocks: list[int]  # cached blocks in the main pool, in chain order
    tier: list[tuple[bytes, int]]  # then (hash, slot) in the second tier, continuing the chain
    # The next block of the chain is being computed by a running request: waiting a step or two
    # for it beats computing the same prefix twice.
    in_flight: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + len(self.tier)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 model_identity: str = "", offload_blocks: int = 0) -> None:
        self.block_size = block_size
        self.offload = OffloadIndex(offload_blocks) if offload_blocks and enable_caching else None
        self.swap_out: list[tuple[int, int]] = []  # (block, slot) copies pending for this step
        self.swap_in: list[tuple[int, int]] = []  # (slot, block)
        self.pool = BlockPool(num_blocks, keep_freed_hashes=enable_caching,
                              on_evict=self._spill if self.offload is not None else None)
        self.enable_caching = enable_caching
        self.root = root_hash(model_identity)
        self.block_tables: dict[str, list[int]] = {}
        # Hashes of full prompt blocks that admitted requests will compute, until they are registered.
        self._in_flight: dict[bytes, str] = {}
        self._in_flight_by_req: dict[str, list[bytes]] = {}
        self._num_registered: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    # ---- prefix lookup ------------------------------------------------------------------
    def _hashes(self, req: Request, num_full_blocks: int) -> list[bytes]:
        bs = self.block_size
        blocks = (req.token_ids(i * bs, (i + 1) * bs) for i in range(len(req.block_hashes), num_full_blocks))
        extend_hashes(req.block_hashes, self.root, blocks, req.cache_salt)
        return req.block_hashes[:num_full_blocks]

    def lookup_prefix(self, req: Request) -> PrefixHit:
        """The longest cached chain of `req`'s tokens (never its last token): blocks here, then
        slots in the second tier."""
        hit = PrefixHit([], [])
        if not (self.enable_caching or req.follows is not None) or req.params.prompt_logprobs is not None:
            return hit  # prompt logprobs need logits at every prompt position: compute them all
        hashes = self._hashes(req, (req.num_tokens - 1) // self.block_size)
        for h in hashes:
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            hit.blocks.append(block_id)
        if self.offload is not None:
            for h in hashes[len(hit.blocks):]:
                slot = self.offload.lookup(h)
                if slot is None:
                    break
                hit.tier.append((h, slot))
        rest = hashes[hit.num_blocks:]
        hit.in_flight = bool(rest) and self._in_flight.get(rest[0], req.request_id) != req.request_id
        return hit

    def _spill(self, block_id: int, block_hash: bytes) -> None:
        """A cached block is being evicted: keep a copy in the second tier."""
        assert self.offload is not None
        slot = self.offload.insert(block_hash)
        if slot is not None:
            self.swap_out.append((block_id, slot))

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies the worker must make before this step's forward: (swap_out, swap_in)."""
        out, inn = self.swap_out, self.swap_in
        self.swap_out, self.swap_in = [], []
        if self.offload is not None:
            self.offload.end_step()
        return out, inn

    def num_cached_blocks(self, token_ids: list[int], cache_salt: str | None) -> int:
        """How many leading blocks of a prompt not yet queued are cached now (for admission control;
        no side effects, stops hashing at the first miss)."""
        if not self.enable_caching:
            return 0
        bs, count = self.block_size, 0
        hashes: list[bytes] = []
        for i in range((len(token_ids) - 1) // bs):
            extend_hashes(hashes, self.root, [token_ids[i * bs:(i + 1) * bs]], cache_salt)
            if self.pool.lookup(hashes[-1]) is None:
                break
            count += 1
        return count

    def record_lookup(self, req: Request, num_hit_tokens: int) -> None:
        self.prefix_queries += req.num_tokens
        self.prefix_hits += num_hit_tokens

    # ---- allocation ---------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens of `request` (after `prefix`, the cache hits it
        starts with, counted in num_new_tokens); False, and no change, if there is not enough space."""
        hits = prefix.blocks if prefix else []
        table_len = len(self.block_tables.get(request.request_id, [])) + len(hits)
        total = request.num_computed_tokens + num_new_tokens
        needed = max(0, cdiv(total, self.block_size) - table_len)
        revived = sum(1 for b in hits if self.pool.blocks[b].ref_count == 0)  # counted as free now
        if needed + revived > self.pool.num_free_blocks:
            return False
        table = self.block_tables.setdefault(request.request_id, [])
        for block_id in hits:
            self.pool.touch(block_id)
            table.append(block_id)
        if needed:
            # the blocks after the table's last, and room after them for the request's later ones
            later = cdiv(request.max_reachable_tokens, self.block_size) - len(table) - needed
            table.extend(self.pool.allocate(needed, after=table[-1] if table else None,
                                            room=min(ROOM_BLOCKS, max(0, later))))
        for i, (block_hash, slot) in enumerate(prefix.tier if prefix else []):
            block_id = table[len(hits) + i]  # fresh blocks, filled from the tier before the forward
            self.swap_in.append((slot, block_id))
            self.pool.register_hash(block_id, block_hash)
        if prefix and prefix.num_blocks:
            self._num_registered[request.request_id] = prefix.num_blocks
        if prefix is not None and self.enable_caching:
            self._mark_in_flight(request, prefix.num_blocks)
        return True

    def _mark_in_flight(self, req: Request, num_hit_blocks: int) -> None:
        """Note the prompt's full blocks this request will compute (admission only)."""
        mine = [h for h in self._hashes(req, req.num_prompt_tokens // self.block_size)[num_hit_blocks:]
                if h not in self._in_flight and self.pool.lookup(h) is None]
        for h in mine:
            self._in_flight[h] = req.request_id
        if mine:
            self._in_flight_by_req[req.request_id] = mine

    def _clear_in_flight(self, request_id: str) -> None:
        for h in self._in_flight_by_req.pop(request_id, []):
            if self._in_flight.get(h) == request_id:
                del self._in_flight[h]

    def cache_full_blocks(self, req: Request) -> None:
        """Register the blocks that `req` has completely computed under their chained hashes."""
        full = req.num_computed_tokens // self.block_size
        done = self._num_registered.get(req.request_id, 0)
        if full <= done:
            return
        table = self.block_tables[req.request_id]
        for i, h in enumerate(self._hashes(req, full)[done:], start=done):
            self.pool.register_hash(table[i], h)
            if self._in_flight.get(h) == req.request_id:
                del self._in_flight[h]
        self._num_registered[req.request_id] = full

    def free(self, request: Request) -> None:
        self._num_registered.pop(request.request_id, None)
        self._clear_in_flight(request.request_id)
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self.pool.free(table)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks (both tiers); refused (False) while any request holds blocks."""
        if self.block_tables:
            return False
        self.pool.reset_cache()
        if self.offload is not None:
            self.offload.clear()
        return True

    def slot_usage(self, num_cached_tokens: dict[str, int]) -> tuple[int, int]:
        """Of the slots in blocks that requests hold: (how many hold a token, how many there are).

        num_cached_tokens: request id -> tokens of it in the cache. A block shared by several requests
        (a cached prefix, parallel samples) counts once. Blocks kept only as prefix cache (ref count 0)
        are not held by anyone and not counted.
        """
        filled: dict[int, int] = {}
        bs = self.block_size
        for request_id, table in self.block_tables.items():
            n = num_cached_tokens.get(request_id, 0)
            for j, block_id in enumerate(table):
                filled[block_id] = max(filled.get(block_id, 0), min(bs, max(0, n - j * bs)))
        return sum(filled.values()), len(filled) * bs

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

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
