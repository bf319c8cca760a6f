"""KV cache storage: the model dtype, another 16-bit float (bfloat16, float16), or quantized: int8 or fp8 (e4m3)
elements with float16 absmax scales.

A 16-bit cache under a float32 model halves the bytes a decode reads (the K and V of every context token, every
layer) and doubles the tokens a budget holds; each element is rounded once, on write (to nearest even, as
torch's `.to` rounds). float16 keeps 3 more mantissa bits than bfloat16 but saturates at 65504.

Symmetric absmax quantization: scale = amax / qmax, q = x / scale (rounded for int8, cast for fp8),
x ~= q * scale. The scale covers one (token, kv head) row of head_dim elements, or one (block, kv head):
  - per (token, kv head): each token is quantized once, on its own, whatever the batch or chunking;
    int8 costs head_dim + 2 bytes per (token, head) instead of head_dim x 4 (float32): 3.88x at 64.
  - per (block, kv head): one scale for block_size tokens (a little more capacity), but a block
    fills incrementally, so when a new token raises the block's amax the block is re-quantized
    with the larger scale (its older tokens are rounded a second time).
Scales are float16 to keep the overhead at 2 bytes; they are rounded to float16 *before* quantizing
so that writing and reading use exactly the same scale.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16
SCALE_BYTES = 2
# Smallest positive float16 (a subnormal): a row of zeros still gets a usable, non-zero scale.
_MIN_SCALE = 2.0**-24
_MAX_SCALE = torch.finfo(SCALE_DTYPE).max

STORAGE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # quantized, with scales
PLAIN_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16}  # no scales
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_GRANULARITIES = ("token", "block")


@dataclass(frozen=True)
class KVCacheSpec:
    """How one layer's K and V are stored: the element dtype and, when quantized, where scales sit.

    scale_granularity None: no scales; the model dtype or a 16-bit float.
    """

    storage_dtype: torch.dtype
    scale_granularity: str | None = None  # None, "token" or "block"

    def __post_init__(self) -> None:
        assert self.scale_granularity in (None, *SCALE_GRANULARITIES), self.scale_granularity
        assert self.scale_granularity is None or self.storage_dtype in QMAX, self.storage_dtype

    @property
    def quantized(self) -> bool:
        return self.scale_granularity is not None

    def rounds(self, model_dtype: torch.dtype) -> bool:
        """Whether reading gives back other values than the model wrote: quantized, or stored in another dtype."""
        return self.quantized or self.storage_dtype != model_dtype

    @property
    def qmax(self) -> float:
        return QMAX[self.storage_dtype]

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.storage_dtype).element_size()

    def scale_shape(self, num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, ...] | None:
        """Shape of one layer's K (or V) scale tensor, or None when not quantized."""
        if self.scale_granularity == "token":
            return (num_blocks, block_size, num_kv_heads)
        if self.scale_granularity == "block":
            return (num_blocks, num_kv_heads)
        return None

    def scale_bytes_per_block(self, block_size: int, num_kv_heads: int) -> int:
        """Bytes of one layer's K (or V) scales for one block (0 when not quantized)."""
        shape = self.scale_shape(1, block_size, num_kv_heads)
        return 0 if shape is None else SCALE_BYTES * torch.Size(shape).numel()

    def bytes_per_block(self, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one layer's K (or V) for one block: elements plus scales."""
        data = block_size * num_kv_heads * head_dim * self.element_bytes
        return data + self.scale_bytes_per_block(block_size, num_kv_heads)

    @property
    def name(self) -> str:
        """For logs and reports, e.g. 'int8 per token' or 'float32'."""
        dtype = next((k for k, v in STORAGE_DTYPES.items() if v == self.storage_dtype),
                     str(self.storage_dtype).removeprefix("torch."))
        return dtype if self.scale_granularity is None else f"{dtype} per {self.scale_granularity}"


@functools.cache
def fp8_supported(device: str = "cpu") -> bool:
    """Can torch cast to and from float8_e4m3fn on this device?"""
    try:
        x = torch.tensor([1.5, -3.0], device=device)
        return bool(torch.equal(x.to(torch.float8_e4m3fn).to(torch.float32), x))
    except (RuntimeError, TypeError):
        return False


def kv_cache_spec(kv_cache_dtype: str, model_dtype: torch.dtype, scale_granularity: str = "token",
                  device: str = "cpu", quantization: str = "none") -> KVCacheSpec:
    """'auto', 'float32' (a float32 model's only), 'bfloat16', 'float16', 'int8' or 'fp8' -> a KVCacheSpec;
    ValueError naming the field otherwise. 'auto' is the model dtype, except under a weight quantization
    (quantization not 'none': q4_1, q8_0), where it is float16: those modes trade accuracy for speed already,
    their activations are float32 only because their kernels compute so, and llama.cpp keeps its cache in
    float16 by default; a float16 cache halves attention's reads (one stream 1.05-1.14x, 128 requests
    1.08-1.18x, BENCHMARKS.md) for 99.8% greedy agreement with a float32 one. 'float32' keeps their float32
    cache."""
    if kv_cache_dtype == "auto":
        return KVCacheSpec(torch.float16 if quantization != "none" else model_dtype)
    if kv_cache_dtype == "float32":
        if model_dtype != torch.float32:
            raise ValueError(f"kv_cache_dtype 'float32' needs a float32 model (dtype float32 or auto), got "
                             f"{str(model_dtype).removeprefix('torch.')}; use auto for the model's dtype")
        return KVCacheSpec(torch.float32)
    if kv_cache_dtype in PLAIN_DTYPES:
        return KVCacheSpec(PLAIN_DTYPES[kv_cache_dtype])
    if kv_cache_dtype not in STORAGE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, float32, "
                         f"{', '.join([*PLAIN_DTYPES, *STORAGE_DTYPES])}; "
                         f"got {kv_cache_dtype!r}")
    if scale_granularity not in SCALE_GRANULARITIES:
        raise ValueError(f"kv_cache_scale_granularity must be one of {', '.join(SCALE_GRANULARITIES)}; "
                         f"got {scale_granularity!r}")
    if kv_cache_dtype == "fp8" and not fp8_supported(device):
        raise ValueError(f"kv_cache_dtype 'fp8' needs float8_e4m3fn casts, which this torch lacks on {device}; "
                         f"use 'int8'")
    return KVCacheSpec(STORAGE_DTYPES[kv_cache_dtype], scale_granularity)


# ---- the arithmetic ---------------------------------------------------------------------

def compute_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """amax (any shape, >= 0) -> float16 scales, clamped to float16's range (never 0)."""
    return (amax.float() / qmax).clamp(_MIN_SCALE, _MAX_SCALE).to(SCALE_DTYPE)


def quantize(x: torch.Tensor, scale: torch.Tensor, storage_dtype: torch.dtype) -> torch.Tensor:
    """x / scale (scale broadcast against x) -> storage_dtype, saturating at +-qmax."""
    qmax = QMAX[storage_dtype]
    y = (x.float() / scale.float()).clamp(-qmax, qmax)
    if storage_dtype == torch.int8:
        y = y.round()
    return y.to(storage_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale (scale broadcast against q) in dtype. The product is taken in at least float32:
    in bfloat16 the scale alone would lose 1/512 of itself, a quarter of an int8 step at q = 127."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(compute) * scale.to(compute)).to(dtype)


def quantize_rows(x: torch.Tensor, storage_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (q (..., D), scale (...,)): one scale per row of the last dimension."""
    scale = compute_scale(x.abs().amax(dim=-1), QMAX[storage_dtype])
    return quantize(x, scale.unsqueeze(-1), storage_dtype), scale


# ---- writes into a paged cache ------------------------------------------------------------

def write_slots(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache (num_blocks, block_size, ...) of any strides; x (T, ...) goes to slots (T,) = block * block_size +
    offset."""
    block_size = cache.shape[1]
    cache[slots // block_size, slots % block_size] = x


def write_token_scaled(data: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """data (num_blocks, bs, H, D), scale (num_blocks, bs, H); x (T, H, D) goes to slots (T,)."""
    q, s = quantize_rows(x, data.dtype)
    write_slots(data, slots, q)
    write_slots(scale, slots, s)


def write_block_scaled(data: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """data (num_blocks, bs, H, D), scale (num_blocks, H); x (T, H, D) goes to slots (T,).

    A block's scale only grows while it fills; when it grows, the tokens already in the block are
    re-quantized to the new scale. A block written from offset 0 starts afresh (it may have been
    freed and reused, and its old scale must not carry over).
    """
    bs, h = data.shape[1:3]
    blocks, offsets = slots // bs, slots % bs
    fresh = blocks[offsets == 0]
    scale[fresh], data[fresh] = 0, 0  # stale contents must not meet the re-quantization below
    touched, inverse = torch.unique(blocks, return_inverse=True)  # (U,), (T,)
    old = scale[touched].float()  # (U, H)
    amax = old * QMAX[data.dtype]
    amax.scatter_reduce_(0, inverse[:, None].expand(-1, h), x.abs().amax(dim=-1).float(), "amax")  # (U, H)
    new = compute_scale(amax, QMAX[data.dtype])
    grew = (new.float() > old).any(dim=-1)  # (U,)
    if bool(grew.any()):
        ids = touched[grew]
        # (G, bs, H, D) with scales (G, 1, H, 1); a fresh block (zeros, old scale 0) stays zeros.
        values = dequantize(data[ids], old[grew][:, None, :, None], torch.float32)
        data[ids] = quantize(values, new[grew][:, None, :, None], data.dtype)
    scale[touched] = new
    write_slots(data, slots, quantize(x, new[inverse].unsqueeze(-1), data.dtype))
