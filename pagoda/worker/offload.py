"""The second KV tier's storage: a bounded host pool of block copies, one slot per block.

Every tensor of every layer's paged cache (K, V, and their scales when quantized) has a twin here
shaped (num_slots, ...one block...). On a CPU host the pool is plain memory beside the main cache
(bounded by --kv-offload-memory); on an accelerator it would be pinned host memory.
"""

from __future__ import annotations

import torch

from pagoda.layers.attention.paged_kv import PagedKVCache


def _tensors(cache: PagedKVCache) -> list[torch.Tensor]:
    return [t for t in (cache.k, cache.v, cache.k_scale, cache.v_scale) if t is not None]


def bytes_per_block(caches: list[PagedKVCache]) -> int:
    """Bytes one block occupies across every layer and tensor (what one slot costs)."""
    return sum(t[0].numel() * t.element_size() for c in caches for t in _tensors(c))


class OffloadStore:
    def __init__(self, caches: list[PagedKVCache], num_slots: int) -> None:
        self.caches = caches
        self.num_slots = num_slots
        self.slots = [[torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype) for t in _tensors(c)] for c in caches]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (block -> slot) for every layer."""
        self._copy([b for b, _ in pairs], [s for _, s in pairs], to_slots=True)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (slot -> block) for every layer."""
        self._copy([b for _, b in pairs], [s for s, _ in pairs], to_slots=False)

    def _copy(self, blocks: list[int], slots: list[int], to_slots: bool) -> None:
        if not blocks:
            return
        b = torch.tensor(blocks, dtype=torch.long)
        s = torch.tensor(slots, dtype=torch.long)
        for cache, stored in zip(self.caches, self.slots, strict=True):
            for main, host in zip(_tensors(cache), stored, strict=True):
                if to_slots:
                    host[s] = main[b]
                else:
                    main[b] = host[s]
