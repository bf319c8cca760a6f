"""Portable torch attention over the paged KV cache: the reference other backends are tested against.

GQA is handled by grouping query heads per KV head ((Hkv, group) views) so K/V are never repeated.
The cache may be quantized: it quantizes on write and dequantizes on gather (`PagedKVCache`).
"""

from __future__ import annotations

import torch

from pagoda.layers.attention.backend import DecodeGroup, PagedAttentionBackend
from pagoda.layers.attention.paged_kv import PagedKVCache


class TorchAttentionBackend(PagedAttentionBackend):
    name = "torch"

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: PagedKVCache,
                block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
        n, hq, d = q.shape
        keys, values = kv_cache.gather(block_table, q.dtype)  # (num_blocks_i, bs, Hkv, D)
        keys, values = keys.flatten(0, 1)[:seq_len], values.flatten(0, 1)[:seq_len]  # (L, Hkv, D)
        hkv = keys.shape[1]
        # Query i sits at position seq_len - n + i and sees keys 0..that position.
        q_pos = torch.arange(seq_len - n, seq_len).unsqueeze(1)  # (n, 1)
        mask = torch.arange(seq_len).unsqueeze(0) <= q_pos  # (n, L)
        qg = q.view(n, hkv, hq // hkv, d).permute(1, 2, 0, 3)  # (Hkv, G, n, D)
        scores = torch.einsum("kgnd,lkd->kgnl", qg, keys) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("kgnl,lkd->nkgd", probs, values)  # (n, Hkv, G, D)
        return out.reshape(n, hq, d)

    def decode(self, q: torch.Tensor, kv_cache: PagedKVCache, group: DecodeGroup, scale: float) -> torch.Tensor:
        bd, hq, d = q.shape
        keys, values = kv_cache.gather(group.block_tables, q.dtype)  # (Bd, max_blocks, bs, Hkv, D)
        keys, values = keys.flatten(1, 2), values.flatten(1, 2)  # (Bd, L_max, Hkv, D)
        hkv = keys.shape[2]
        qg = q.view(bd, hkv, hq // hkv, d)  # (Bd, Hkv, G, D)
        scores = torch.einsum("bkgd,blkd->bkgl", qg, keys) * scale
        valid = torch.arange(keys.shape[1]).unsqueeze(0) < group.seq_lens.unsqueeze(1)  # (Bd, L_max)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bkgl,blkd->bkgd", probs, values)
        return out.reshape(bd, hq, d)
