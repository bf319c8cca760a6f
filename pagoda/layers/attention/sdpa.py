"""Attention over the paged cache with torch's fused scaled_dot_product_attention (the CPU default).

Same contract as the reference backend (`torch_ref.py`), which it is tested against. Differences:
- the fused kernel (flash attention on CPU) instead of separate matmul / mask / softmax ops;
- a prompt chunk with no earlier context attends to its own K/V as computed this step (causal),
  without gathering them back from the cache, unless the cache rounds them (quantized, or a dtype other
  than the model's): then every query reads the stored values, so results do not depend on how the prompt
  was chunked;
- GQA through `enable_gqa`, without repeating K/V in our code.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagoda.layers.attention.backend import DecodeGroup, PagedAttentionBackend
from pagoda.layers.attention.paged_kv import PagedKVCache

logger = logging.getLogger(__name__)


class SDPAAttentionBackend(PagedAttentionBackend):
    name = "sdpa"

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: PagedKVCache,
                block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
        n = q.shape[0]
        if seq_len == n and not kv_cache.spec.rounds(q.dtype):
            return _attend(q, k, v, None, scale)  # the whole context is this chunk: causal, no gather
        keys, values = kv_cache.gather(block_table, q.dtype)  # (num_blocks_i, bs, Hkv, D)
        q_pos = torch.arange(seq_len - n, seq_len).unsqueeze(1)  # (n, 1): each query's position
        mask = torch.arange(seq_len).unsqueeze(0) <= q_pos  # (n, L)
        return _attend(q, keys.flatten(0, 1)[:seq_len], values.flatten(0, 1)[:seq_len], mask, scale)

    def decode(self, q: torch.Tensor, kv_cache: PagedKVCache, group: DecodeGroup, scale: float) -> torch.Tensor:
        keys, values = kv_cache.gather(group.block_tables, q.dtype)  # (Bd, max_blocks, bs, Hkv, D)
        keys, values = keys.flatten(1, 2), values.flatten(1, 2)  # (Bd, L_max, Hkv, D)
        mask = None
        if q.shape[0] == 1:  # one sequence: cut its context to length instead of masking the padding
            n = int(group.seq_lens[0])
            keys, values = keys[:, :n], values[:, :n]
        else:
            valid = torch.arange(keys.shape[1]).unsqueeze(0) < group.seq_lens.unsqueeze(1)  # (Bd, L_max)
            mask = valid[:, None, None, :]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),  # (Bd, H, 1 | L, D)
            attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(2)  # (Bd, Hq, D)


class KernelBackend(SDPAAttentionBackend):
    """A backend whose decodes run a kernel built at start-up (`compiled`, `cpp`), with SDPA's path as the
    fallback. strict (asked for by name): a failed build is an error. Not strict (chosen by "auto"): it is
    logged, and decodes use SDPA's gather-then-attend path."""

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict
        self.fallback = False

    def build(self, kernel: Callable[[], object]) -> float:
        """Run kernel() once, which builds the kernel (compiles, or loads a cached build); its seconds."""
        start = time.perf_counter()
        try:
            kernel()
        except Exception as e:  # no C++ compiler, an inductor bug, ...
            if self.strict:
                raise RuntimeError(f"attention_backend {self.name!r} could not compile its kernel: {e}") from e
            logger.warning("could not compile the %s paged decode kernel (%s); decodes use sdpa", self.name, e)
            self.fallback = True
            self.name = "sdpa"  # what the engine reports as in use
        seconds = time.perf_counter() - start
        if not self.fallback:
            logger.info("%s paged decode attention ready in %.1f s", self.name, seconds)
        return seconds


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """q (n, Hq, D), k/v (L, Hkv, D), mask (n, L) or None for causal with L == n -> (n, Hq, D).

    Inputs get a batch dimension of 1: given 3-D tensors, torch 2.13 on CPU silently takes its unfused
    math path instead of the flash kernel, 4.4x (float32) to 10x (bfloat16) slower on a 512-token
    prompt (`python -m pagoda.bench.prompt_attention`, BENCHMARKS.md)."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
