"""Chained block hashes for prefix caching.

hash(block i) = SHA-256(hash(block i-1) || token ids || extra keys). The chain's root mixes in the
model's identity, so a cache can never serve another model's K/V; the first block mixes in the
request's cache salt, so a different salt (or none) changes every hash of the chain; an adapter id
slot is kept for LoRA. Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable


def root_hash(model_identity: str) -> bytes:
    return hashlib.sha256(b"pagoda-kv-v1\0" + model_identity.encode()).digest()


def block_hash(parent: bytes, token_ids: list[int], *, cache_salt: str | None = None,
               adapter_id: int | None = None) -> bytes:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    # Extra keys, each tagged so that no two encodings collide.
    if cache_salt is not None:
        h.update(b"\1salt\0" + cache_salt.encode("utf-8", "surrogatepass") + b"\0")
    if adapter_id is not None:
        h.update(b"\1adapter\0" + struct.pack("<q", adapter_id))
    return h.digest()


def extend_hashes(hashes: list[bytes], root: bytes, blocks: Iterable[list[int]], cache_salt: str | None) -> None:
    """Append the hashes of `blocks` (token ids of the next full blocks) to the chain `hashes`."""
    for tokens in blocks:
        parent = hashes[-1] if hashes else root
        hashes.append(block_hash(parent, tokens, cache_salt=None if hashes else cache_salt))
