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
