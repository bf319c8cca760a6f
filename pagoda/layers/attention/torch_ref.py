"""Portable torch attention over the paged KV cache: the reference other backends are tested against.

GQA is handled by grouping query heads per KV head ((Hkv, group) views) so K/V are never repeated.
"""

from __future__ import annotations

import torch

from pagoda.layers.attention.backend import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_blocks, block_size, hkv, d = k_cache.shape
        k_cache.view(-1, hkv, d)[meta.slot_mapping] = k.to(k_cache.dtype)
        v_cache.view(-1, hkv, d)[meta.slot_mapping] = v.to(v_cache.dtype)
        out = torch.empty_like(q)
        if meta.decode_idx:
            out[meta.decode_rows] = self._decode(q[meta.decode_rows], k_cache, v_cache, meta, scale)
        for i in meta.prefill_idx:
            lo, hi = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[lo:hi] = self._prefill(q[lo:hi], k_cache, v_cache, meta.block_tables[i],
                                       meta.seq_lens[i], scale)
        return out

    @staticmethod
    def _gather(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
        """(num_blocks, bs, Hkv, D) -> this sequence's context (seq_len, Hkv, D)."""
        return cache[block_table].flatten(0, 1)[:seq_len]

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
        n, hq, d = q.shape
        keys = self._gather(k_cache, block_table, seq_len).to(q.dtype)  # (L, Hkv, D)
        values = self._gather(v_cache, block_table, seq_len).to(q.dtype)
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

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        bd, hq, d = q.shape
        hkv = k_cache.shape[2]
        tables = meta.decode_block_tables  # (Bd, max_blocks)
        keys = k_cache[tables].flatten(1, 2).to(q.dtype)  # (Bd, L_max, Hkv, D)
        values = v_cache[tables].flatten(1, 2).to(q.dtype)
        qg = q.view(bd, hkv, hq // hkv, d)  # (Bd, Hkv, G, D)
        scores = torch.einsum("bkgd,blkd->bkgl", qg, keys) * scale
        valid = torch.arange(keys.shape[1]).unsqueeze(0) < meta.decode_seq_lens.unsqueeze(1)  # (Bd, L_max)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bkgl,blkd->bkgd", probs, values)
        return out.reshape(bd, hq, d)
