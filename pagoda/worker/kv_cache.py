"""Size the paged KV cache from a memory budget and allocate its per-layer tensors.

bytes per token = layers x 2 (K and V) x kv_heads x head_dim x dtype bytes; the number of blocks
is the budget divided by the bytes of one block (block_size tokens).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.model.llama import ArchConfig

logger = logging.getLogger(__name__)

# Default budget when none is given: this share of the memory available now, capped. The cap
# keeps a laptop or a shared CI box responsive; pass --kv-cache-memory for more.
DEFAULT_KV_SHARE = 0.2
DEFAULT_KV_CAP = 4 * 1024**3


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3  # no /proc (not Linux): assume a modest machine


def default_kv_cache_memory() -> int:
    return int(min(available_memory() * DEFAULT_KV_SHARE, DEFAULT_KV_CAP))


@dataclass(frozen=True)
class KVCachePlan:
    bytes_per_token: int
    bytes_per_block: int
    block_size: int
    num_blocks: int
    budget_bytes: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_concurrency(self, context_len: int) -> float:
        """Sequences of `context_len` tokens that fit at once (whole blocks per sequence)."""
        blocks_per_seq = -(-context_len // self.block_size)
        return self.num_blocks / blocks_per_seq


def plan_kv_cache(arch: ArchConfig, dtype: torch.dtype, block_size: int, budget_bytes: int) -> KVCachePlan:
    per_token = arch.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
    per_block = per_token * block_size
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory of {budget_bytes} bytes holds no block; one block of "
                         f"{block_size} tokens needs {per_block} bytes")
    return KVCachePlan(per_token, per_block, block_size, num_blocks, budget_bytes)


def allocate_kv_cache(arch: ArchConfig, plan: KVCachePlan, dtype: torch.dtype
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each (num_blocks, block_size, num_kv_heads, head_dim), zeroed.

    Zeroed, not empty: padded decode gathers read unused slots, and garbage could hold NaNs. The
    memory comes from one calloc'd numpy buffer, so the kernel hands out zero pages lazily instead
    of us writing gigabytes of zeros at start-up.
    """
    shape = (plan.num_blocks, plan.block_size, arch.num_kv_heads, arch.head_dim)
    elem = torch.empty((), dtype=dtype).element_size()
    per_tensor = plan.num_blocks * plan.block_size * arch.num_kv_heads * arch.head_dim
    flat = torch.from_numpy(np.zeros(2 * arch.num_layers * per_tensor * elem, dtype=np.uint8)).view(dtype)
    caches = flat.view(arch.num_layers, 2, *shape)
    return [(caches[i, 0], caches[i, 1]) for i in range(arch.num_layers)]
