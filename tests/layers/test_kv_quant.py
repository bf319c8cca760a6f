"""Quantized KV cache: round-trip error bounds, paged writes (per token and per block), and the
torch attention backend over an int8 / fp8 cache against the unquantized one on random data."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagoda.layers.attention import AttentionMetadata, PagedKVCache
from pagoda.layers.attention.backend import build_attention_metadata
from pagoda.layers.attention.paged_kv import allocate_scales, k_cache_layout
from pagoda.layers.attention.torch_ref import TorchAttentionBackend
from pagoda.layers.kv_quant import (
    QMAX,
    SCALE_DTYPE,
    KVCacheSpec,
    compute_scale,
    dequantize,
    kv_cache_spec,
    quantize_rows,
    write_block_scaled,
    write_token_scaled,
)

INT8, FP8 = torch.int8, torch.float8_e4m3fn


def random_rows(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """(64, 4, 64) rows whose magnitudes span 1e-3..1e3, an outlier channel, a zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 4, 64, generator=g, dtype=torch.float64)
    x *= 10 ** torch.empty(64, 4, 1, dtype=torch.float64).uniform_(-3, 3, generator=g)
    x[:, :, 5] *= 20  # K often has a few large channels
    x[3, 1] = 0
    return x.to(dtype)


def error_bound(x: torch.Tensor, scale: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """Per element: int8 rounds to half a step of its row's scale; e4m3 keeps 3 mantissa bits (half an
    ulp is 1/16 relative) down to its subnormals (steps of 2^-9 scale). The float16 scale may round
    down by 2^-11, which the saturation at qmax can cost on the largest element."""
    s = scale.double().unsqueeze(-1)
    amax = x.double().abs().amax(-1, keepdim=True)
    slack = amax * 2**-10 + 1e-12
    if x.dtype == torch.bfloat16:  # the dequantized value is rounded to bfloat16 (8 bits)
        slack = slack + x.double().abs() * 2**-8
    if storage == INT8:
        return 0.5 * s + slack
    return torch.maximum(x.double().abs() / 16, 2**-10 * s) + slack


@pytest.mark.parametrize("storage", [INT8, FP8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_round_trip_error_is_within_half_a_step(storage: torch.dtype, dtype: torch.dtype) -> None:
    x = random_rows(dtype)
    q, scale = quantize_rows(x, storage)
    assert q.dtype == storage and scale.dtype == SCALE_DTYPE and scale.shape == x.shape[:-1]
    back = dequantize(q, scale.unsqueeze(-1), dtype)
    assert back.dtype == dtype and torch.isfinite(back).all()
    err = (back.double() - x.double()).abs()
    assert (err <= error_bound(x, scale, storage)).all()
    assert torch.equal(back[3, 1], torch.zeros(64, dtype=dtype))  # a zero row stays exactly zero
    # Relative to each row's largest element, int8 keeps ~0.4% and e4m3 ~6% (bfloat16 adds its own 0.4%).
    rel = (err / x.double().abs().amax(-1, keepdim=True).clamp_min(1e-30)).max()
    assert rel <= (0.0041 if storage == INT8 else 0.07) + (2**-8 if dtype == torch.bfloat16 else 0)


def test_scales_stay_in_float16_range() -> None:
    amax = torch.tensor([0.0, 1e-30, 1.0, 1e30])
    s = compute_scale(amax, QMAX[INT8])
    assert s.dtype == SCALE_DTYPE and (s > 0).all() and torch.isfinite(s).all()


def test_spec_names_and_errors() -> None:
    assert kv_cache_spec("auto", torch.bfloat16) == KVCacheSpec(torch.bfloat16)
    # under a weight quantization, auto is float16 (llama.cpp's default); float32 keeps a float32 model's own
    for scheme in ("q4_1", "q8_0"):
        assert kv_cache_spec("auto", torch.float32, quantization=scheme) == KVCacheSpec(torch.float16)
        assert kv_cache_spec("float32", torch.float32, quantization=scheme) == KVCacheSpec(torch.float32)
    assert kv_cache_spec("float32", torch.float32) == KVCacheSpec(torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype 'float32' needs a float32 model"):
        kv_cache_spec("float32", torch.bfloat16)
    assert kv_cache_spec("int8", torch.float32).name == "int8 per token"
    assert kv_cache_spec("fp8", torch.float32, "block").name == "fp8 per block"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_spec("int4", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_scale_granularity"):
        kv_cache_spec("int8", torch.float32, "channel")


# ---- paged writes ----------------------------------------------------------------------------

def make_cache(spec: KVCacheSpec, num_blocks: int = 16, block_size: int = 4, hkv: int = 2, d: int = 8
               ) -> PagedKVCache:
    """Laid out as the engine allocates it (K and its per-token scales with the tokens innermost: `k_cache_layout`,
    `allocate_scales`)."""
    scales = allocate_scales(spec, num_blocks, block_size, hkv)
    k = k_cache_layout(torch.zeros((num_blocks, hkv, d, block_size), dtype=spec.storage_dtype))
    return PagedKVCache(k, torch.zeros((num_blocks, block_size, hkv, d), dtype=spec.storage_dtype), spec, *scales)


@pytest.mark.parametrize("storage", [INT8, FP8])
def test_token_scaled_write_quantizes_each_token_on_its_own(storage: torch.dtype) -> None:
    spec = KVCacheSpec(storage, "token")
    cache = make_cache(spec)
    x = torch.randn(6, 2, 8)
    slots = torch.tensor([9, 10, 11, 12, 0, 1])  # across a block boundary, and another block
    assert cache.k_scale is not None
    write_token_scaled(cache.k, cache.k_scale, slots, x)
    q, s = quantize_rows(x, storage)
    assert torch.equal(cache.k.reshape(-1, 2, 8)[slots].float(), q.float())
    assert torch.equal(cache.k_scale.reshape(-1, 2)[slots], s)


def test_block_scaled_incremental_writes_stay_close() -> None:
    """Tokens written one at a time (as decodes) into per-block scales. The final scale is the block's
    absmax scale; each time it grows, the older tokens are rounded again, by at most half a step of the
    new scale: a token's error is bounded by half the sum of the scales from its write on."""
    torch.manual_seed(0)
    data, scale = torch.zeros(4, 8, 2, 16, dtype=INT8), torch.zeros(4, 2, dtype=SCALE_DTYPE)
    x = torch.randn(8, 2, 16) * torch.linspace(0.1, 3.0, 8)[:, None, None]  # growing: re-quantizes often
    history = []  # the block's scale (2,) after each write
    for t in range(8):
        write_block_scaled(data, scale, torch.tensor([16 + t]), x[t: t + 1])  # block 2
        history.append(scale[2].float().clone())
    assert torch.equal(scale[2], compute_scale(x.abs().amax(dim=(0, 2)), 127.0))
    back = dequantize(data[2], scale[2][None, :, None], torch.float32)
    for t in range(8):
        grown = [history[t]] + [history[j] * (history[j] > history[j - 1]) for j in range(t + 1, 8)]
        bound = 0.5 * torch.stack(grown).sum(0) + 1e-6  # (2,)
        assert ((back[t] - x[t]).abs() <= bound[:, None]).all()
    # All at once (a prefill chunk): one quantization, half a step.
    write_block_scaled(data, scale, torch.arange(8, 16), x)  # block 1
    back = dequantize(data[1], scale[1][None, :, None], torch.float32)
    assert ((back - x).abs() <= 0.5 * scale[1].float()[None, :, None] + 1e-6).all()


def test_block_scale_restarts_when_a_block_is_reused() -> None:
    data, scale = torch.zeros(2, 4, 1, 8, dtype=INT8), torch.zeros(2, 1, dtype=SCALE_DTYPE)
    write_block_scaled(data, scale, torch.arange(4, 8), torch.full((4, 1, 8), 100.0))  # block 1, large
    small = torch.randn(2, 1, 8) * 0.01
    write_block_scaled(data, scale, torch.tensor([4, 5]), small)  # freed and reused from offset 0
    assert float(scale[1, 0]) < 0.001
    back = dequantize(data[1, :2], scale[1][None, :, None], torch.float32)
    assert torch.allclose(back, small, atol=float(scale[1, 0]))


@pytest.mark.parametrize("granularity", ["token", "block"])
def test_copy_blocks_copies_scales(granularity: str) -> None:
    cache = make_cache(KVCacheSpec(INT8, granularity))
    cache.write(torch.arange(4, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8))  # block 1
    cache.copy_blocks(torch.tensor([1]), torch.tensor([5]))
    k1, v1 = cache.gather(torch.tensor([1]), torch.float32)
    k5, v5 = cache.gather(torch.tensor([5]), torch.float32)
    assert torch.equal(k1, k5) and torch.equal(v1, v5)


# ---- attention over a quantized paged cache --------------------------------------------------

def step_metadata(seqs: list[tuple[torch.Tensor, int, int]], block_size: int) -> AttentionMetadata:
    """seqs: (block_table, start position, new tokens) per sequence, as the model runner builds it."""
    return build_attention_metadata([(t.tolist(), start, n) for t, start, n in seqs], block_size)


# Per step: (sequence, start, new tokens). Prompt chunks (one continuing an earlier chunk) and decodes
# mixed in one step, then decodes only.
STEPS = [[(0, 0, 21), (1, 0, 16)], [(0, 21, 1), (1, 16, 13), (2, 0, 5)], [(0, 22, 1), (1, 29, 1), (2, 5, 1)],
         [(0, 23, 1), (1, 30, 1), (2, 6, 9)], [(0, 24, 1), (1, 31, 1), (2, 15, 1)]]


def run_steps(spec: KVCacheSpec, dtype: torch.dtype, seed: int = 0, backend: Any = None, bs: int = 4
              ) -> list[torch.Tensor]:
    hq, hkv, d = 8, 2, 64
    g = torch.Generator().manual_seed(seed)
    cache = make_cache(spec, num_blocks=40, block_size=bs, hkv=hkv, d=d)
    # Non-contiguous, shuffled blocks per sequence.
    perm = torch.randperm(40, generator=g)
    tables = [perm[0:10], perm[10:20], perm[20:30]]
    backend, outs = backend or TorchAttentionBackend(), []
    for step in STEPS:
        t = sum(n for _, _, n in step)
        q = torch.randn(t, hq, d, generator=g, dtype=torch.float64).to(dtype)
        k = (torch.randn(t, hkv, d, generator=g, dtype=torch.float64) * 2).to(dtype)
        v = torch.randn(t, hkv, d, generator=g, dtype=torch.float64).to(dtype)
        meta = step_metadata([(tables[i], start, n) for i, start, n in step], bs)
        outs.append(backend.forward(q, k, v, cache, meta, d**-0.5))
    return outs


@pytest.mark.parametrize("granularity", ["token", "block"])
@pytest.mark.parametrize("storage,tol", [(INT8, 0.025), (FP8, 0.08)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_attention_over_quantized_cache_is_close(storage: torch.dtype, tol: float, granularity: str,
                                                 dtype: torch.dtype) -> None:
    """Relative error of the attention output per step: ~1% with int8 and ~4% with e4m3 on this data."""
    ref = run_steps(KVCacheSpec(dtype), dtype)
    got = run_steps(KVCacheSpec(storage, granularity), dtype)
    for r, o in zip(ref, got, strict=True):
        assert o.dtype == dtype and torch.isfinite(o).all()
        assert float((o.double() - r.double()).norm() / r.double().norm()) < tol
