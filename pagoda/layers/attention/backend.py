"""The attention backend interface and the per-step metadata every backend reads.

A step's tokens are flattened: sequence i owns query rows [query_start_loc[i], query_start_loc[i+1]).
Its K/V for this step are written to the paged cache at `slot_mapping`; then each query attends
causally to the whole context of its sequence (earlier chunks already in the cache included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagoda.layers.attention.paged_kv import PagedKVCache


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: block_id * block_size + offset for each new token
    query_start_loc: list[int]  # (B + 1,) row offsets of each sequence's queries
    seq_lens: list[int]  # (B,) context length of each sequence after this step
    block_tables: list[torch.Tensor]  # B tensors (num_blocks_i,) int64
    # Sequences with exactly one query (decodes), batched together:
    decode_idx: list[int]  # sequence indices
    decode_rows: torch.Tensor  # (Bd,) int64 query rows
    decode_block_tables: torch.Tensor  # (Bd, max_blocks) int64, padded with 0
    decode_seq_lens: torch.Tensor  # (Bd,) int64
    prefill_idx: list[int]  # sequences with more than one query

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: PagedKVCache,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: (T, Hq, D); k, v: (T, Hkv, D), written to kv_cache at meta.slot_mapping -> (T, Hq, D)."""
        ...


ATTENTION_BACKENDS = ("sdpa", "torch")


def get_attention_backend(name: str = "sdpa") -> AttentionBackend:
    """sdpa: torch's fused attention (the default); torch: the plain reference the others are tested against."""
    from pagoda.layers.attention.sdpa import SDPAAttentionBackend
    from pagoda.layers.attention.torch_ref import TorchAttentionBackend

    backends: dict[str, type] = {"sdpa": SDPAAttentionBackend, "torch": TorchAttentionBackend}
    if name not in backends:
        raise ValueError(f"attention backend must be one of {sorted(backends)}, got {name!r}")
    return backends[name]()  # type: ignore[no-any-return]
