"""Size the paged KV cache from a memory budget and allocate its per-layer tensors.

bytes per token = layers x 2 (K and V) x kv_heads x (head_dim x element bytes + scale bytes); the
number of blocks is the budget divided by the bytes of one block (block_size tokens). Elements are
in the model dtype (kv_cache_dtype "auto", which is float16 under a weight quantization; or "float32"), in
bfloat16 / float16, or int8 / fp8 with float16 scales per
(token, kv head) or per (block, kv head) (see pagoda/layers/kv_quant.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.layers.attention import PagedKVCache
from pagoda.layers.attention.paged_kv import allocate_scales, k_cache_layout
from pagoda.layers.kv_quant import KVCacheSpec, kv_cache_spec
from pagoda.model.llama import ArchConfig
from pagoda.worker.host_memory import huge_page_zeros, small_page_zeros, touch_pages

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
    bytes_per_token: int | float  # bytes_per_block / block_size: fractional with per-block scales
    bytes_per_block: int
    block_size: int
    num_blocks: int
    budget_bytes: int
    spec: KVCacheSpec  # storage dtype and scale layout
    scale_bytes_per_block: int = 0  # of bytes_per_block, what the float16 scales take

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_concurrency(self, context_len: int) -> float:
        """Sequences of `context_len` tokens that fit at once (whole blocks per sequence)."""
        blocks_per_seq = -(-context_len // self.block_size)
        return self.num_blocks / blocks_per_seq


def plan_kv_cache(arch: ArchConfig, dtype: torch.dtype, block_size: int, budget_bytes: int,
                  kv_cache_dtype: str = "auto", scale_granularity: str = "token",
                  quantization: str = "none") -> KVCachePlan:
    """dtype: the model's; kv_cache_dtype and quantization (the model's weight quantization, which 'auto'
    depends on): as kv_cache_spec takes them."""
    spec = kv_cache_spec(kv_cache_dtype, dtype, scale_granularity, quantization=quantization)
    per_block = arch.num_layers * 2 * spec.bytes_per_block(block_size, arch.num_kv_heads, arch.head_dim)
    scale_bytes = arch.num_layers * 2 * spec.scale_bytes_per_block(block_size, arch.num_kv_heads)
    per_token = per_block // block_size if per_block % block_size == 0 else per_block / block_size
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory of {budget_bytes} bytes holds no block; one block of "
                         f"{block_size} tokens needs {per_block} bytes")
    return KVCachePlan(per_token, per_block, block_size, num_blocks, budget_bytes, spec, scale_bytes)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, prefault: bool) -> torch.Tensor:
    """A zeroed tensor whose pages the kernel hands out as they are first written, or with prefault all now
    (host_memory.touch_pages) and on huge pages where the system allows (host_memory.huge_page_zeros).

    Lazily backed, on 4 KiB pages: on this project's VMs memory the host has not backed yet costs at its first write,
    and a fresh huge page (2 MiB at once, from memory the guest had handed back) cost far more per byte than 4 KiB
    pages, most of which the guest's earlier use had left backed: backing a 4 GiB cache took 6.9-10.2 s on huge
    pages against 1.9 s on 4 KiB ones, and a fresh engine's 128-request q4_1 run (1.25 GB of KV first written inside
    it) ran 1.10x faster on 4 KiB pages. Once backed, huge pages spare the decode kernel TLB misses (it read a
    float16 cache 1.01x and an int8 one 1.04x faster from them; BENCHMARKS.md): so where every page is backed at
    start-up anyway (`--kv-cache-prefault`, a server's choice for its steady state), huge pages."""
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = int(np.prod(shape)) * elem
    if not prefault:
        return small_page_zeros(nbytes).view(dtype).view(shape)
    buf = huge_page_zeros(nbytes)
    touch_pages(buf)
    return buf.view(dtype).view(shape)


def allocate_kv_cache(arch: ArchConfig, plan: KVCachePlan, dtype: torch.dtype,
                      prefault: bool = False) -> list[PagedKVCache]:
    """Per layer K and V, each (num_blocks, block_size, num_kv_heads, head_dim) in the plan's storage
    dtype, plus their scales when quantized; all zeroed. K is stored with each block's tokens innermost
    (`k_cache_layout`, for the C++ decode kernel); both are indexed the same way.

    Zeroed, not empty: padded decode gathers read unused slots, and garbage could hold NaNs (a zero
    scale dequantizes to zeros too). dtype is the model's; the plan's spec holds the storage's. prefault: every
    page backed now (`--kv-cache-prefault`), not at its first write.
    """
    spec = plan.spec
    assert spec.quantized or spec.storage_dtype.is_floating_point, (spec, dtype)
    shape = (plan.num_blocks, plan.block_size, arch.num_kv_heads, arch.head_dim)
    # One tensor each, not views of one buffer: a compiled graph that writes into caches aliasing one
    # base (--compile-model's one-stream decode) would copy the whole base on every call.
    def layer() -> PagedKVCache:
        k = k_cache_layout(_zeros((plan.num_blocks, arch.num_kv_heads, arch.head_dim, plan.block_size),
                                  spec.storage_dtype, prefault))
        v = _zeros(shape, spec.storage_dtype, prefault)
        scales = allocate_scales(spec, plan.num_blocks, plan.block_size, arch.num_kv_heads,
                                 lambda shape, dtype: _zeros(shape, dtype, prefault))
        return PagedKVCache(k, v, spec, *scales)

    return [layer() for _ in range(arch.num_layers)]
