"""One layer's paged KV cache: what an attention backend writes new K/V into and reads context from.

Stored in the model dtype, or quantized (int8 / fp8 with float16 scales, see `pagoda.layers.kv_quant`):
quantized on write, dequantized on gather, so a backend never sees the storage format unless it wants to.

K and V are indexed alike, (num_blocks, block_size, Hkv, D), but K is stored with each block's tokens
innermost: physically (num_blocks, Hkv, D, block_size), `k` being a permuted view (`k_cache_layout`).
The C++ decode kernel (`cpp_kernel.cpp`) takes a block's scores as one vector over its tokens that way;
torch code sees the logical shape and never depends on the storage order (writes go through
`write_slots`, which works on any strides). Per-token scales follow K: physically (num_blocks, Hkv,
block_size) behind the logical (num_blocks, block_size, Hkv) (`allocate_scales`), so the kernel loads a
block's scales for one KV head as one vector, as it loads its scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagoda.layers.kv_quant import (
    SCALE_DTYPE,
    KVCacheSpec,
    dequantize,
    write_block_scaled,
    write_slots,
    write_token_scaled,
)


@dataclass
class PagedKVCache:
    k: torch.Tensor  # (num_blocks, block_size, Hkv, D) in spec.storage_dtype
    v: torch.Tensor
    spec: KVCacheSpec
    # float16 scales when quantized: (num_blocks, block_size, Hkv) per token or (num_blocks, Hkv) per block
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (T, Hkv, D) go to slot_mapping (T,) = block_id * block_size + offset."""
        if self.k_scale is None or self.v_scale is None:
            write_slots(self.k, slot_mapping, k.to(self.k.dtype))
            write_slots(self.v, slot_mapping, v.to(self.v.dtype))
            return
        write = write_token_scaled if self.spec.scale_granularity == "token" else write_block_scaled
        write(self.k, self.k_scale, slot_mapping, k)
        write(self.v, self.v_scale, slot_mapping, v)

    def gather(self, block_tables: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """block_tables (..., n) -> K, V (..., n, block_size, Hkv, D) in dtype."""
        return (self._gather(self.k, self.k_scale, block_tables, dtype),
                self._gather(self.v, self.v_scale, block_tables, dtype))

    def _gather(self, data: torch.Tensor, scale: torch.Tensor | None, block_tables: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        blocks = _take(data, block_tables)  # (..., n, bs, Hkv, D)
        if scale is None:
            return blocks.to(dtype)
        s = _take(scale, block_tables)  # (..., n, bs, Hkv) per token, (..., n, Hkv) per block
        s = s.unsqueeze(-1) if self.spec.scale_granularity == "token" else s[..., None, :, None]
        return dequantize(blocks, s, dtype)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks src[i] -> dst[i] (copy-on-write), scales included."""
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None:
                t[dst] = t[src]


def k_cache_layout(storage: torch.Tensor) -> torch.Tensor:
    """A K cache stored (num_blocks, Hkv, D, block_size) as its logical view (num_blocks, block_size, Hkv, D)."""
    return storage.permute(0, 3, 1, 2)


def is_k_cache_layout(k: torch.Tensor) -> bool:
    """Whether k is laid out as `k_cache_layout` makes it (what the C++ kernel reads)."""
    return k.permute(0, 2, 3, 1).is_contiguous()


def allocate_scales(spec: KVCacheSpec, num_blocks: int, block_size: int, num_kv_heads: int,
                    zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One layer's K and V scales for a cache of spec (None, None when not quantized), zeroed by zeros(shape,
    dtype) (torch.zeros by default). Per token, they are stored (num_blocks, Hkv, block_size) and returned as
    their logical view (num_blocks, block_size, Hkv) (`is_scale_layout`); per block, as they are indexed."""
    shape = spec.scale_shape(num_blocks, block_size, num_kv_heads)
    if shape is None:
        return None, None
    make = zeros or (lambda shape, dtype: torch.zeros(shape, dtype=dtype))

    def one() -> torch.Tensor:
        if spec.scale_granularity == "token":
            return make((num_blocks, num_kv_heads, block_size), SCALE_DTYPE).permute(0, 2, 1)
        return make(shape, SCALE_DTYPE)

    return one(), one()


def is_scale_layout(scale: torch.Tensor, granularity: str | None) -> bool:
    """Whether scales of this granularity are laid out as `allocate_scales` makes them (what the C++ kernel
    reads)."""
    return (scale.permute(0, 2, 1) if granularity == "token" else scale).is_contiguous()


def _take(data: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """data[block_tables] via index_select on the flattened table: same result, but decode steps ran
    1.46x faster than with multi-dimensional advanced indexing on CPU (BENCHMARKS.md)."""
    return data.index_select(0, block_tables.reshape(-1)).view(*block_tables.shape, *data.shape[1:])
