"""The fused SDPA backend against the plain torch reference: same outputs on mixed steps (fresh
prompts, prompt chunks continuing earlier ones, decodes), for plain and quantized caches."""

from __future__ import annotations

import pytest
import torch

from pagoda.layers.attention.sdpa import SDPAAttentionBackend
from pagoda.layers.kv_quant import KVCacheSpec
from tests.layers.test_kv_quant import run_steps


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("storage", ["model", torch.int8])
def test_sdpa_matches_reference(dtype: torch.dtype, tol: float, storage: object) -> None:
    spec = KVCacheSpec(dtype) if storage == "model" else KVCacheSpec(storage, "token")  # type: ignore[arg-type]
    ref = run_steps(spec, dtype)
    got = run_steps(spec, dtype, backend=SDPAAttentionBackend())
    for r, o in zip(ref, got, strict=True):
        assert o.shape == r.shape and o.dtype == r.dtype
        torch.testing.assert_close(o, r, atol=tol, rtol=tol)


def test_decode_groups_cover_every_decode_once_with_bounded_padding() -> None:
    from pagoda.layers.attention.backend import DECODE_GROUP_PADDING, build_attention_metadata

    lens = [3, 40, 41, 7, 300, 5, 290, 64, 2, 100]  # context lengths after this step
    seqs = [(list(range(100 + 20 * i, 100 + 20 * i + -(-n // 16))), n - 1, 1) for i, n in enumerate(lens)]
    seqs.insert(3, ([1, 2], 0, 20))  # a prompt chunk in the middle of the batch
    meta = build_attention_metadata(seqs, 16)
    rows = sorted(int(r) for g in meta.decode_groups for r in g.rows)
    assert rows == [meta.query_start_loc[i] for i, s in enumerate(seqs) if s[2] == 1]
    assert meta.prefill_idx == [3]
    for g in meta.decode_groups:
        real = sum(-(-int(n) // 16) for n in g.seq_lens)
        assert g.block_tables.numel() <= max(DECODE_GROUP_PADDING * real, g.block_tables.shape[1])
