"""Engine configuration: frozen dataclasses validated at construction.

What is discovered at run time (number of KV blocks, EOS ids, the model's own limits) lives in
`EngineLimits`, never written back into these configs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"

# sdpa: torch's fused attention; compiled: paged decode kernel from torch.compile; torch: the plain reference
ATTENTION_BACKENDS = ("sdpa", "compiled", "torch")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_size(value: int | str, field: str = "kv_cache_memory") -> int:
    """Parse a byte count: an int, or a string such as '512MiB', '2GiB', '1.5GB', '4096'."""
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a byte count or a size such as '512MiB', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _SIZE_UNITS:
            raise ValueError(f"{field} must be a byte count or a size such as '512MiB' or '2GB', got {value!r}")
        n = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if n <= 0:
        raise ValueError(f"{field} must be positive, got {value!r}")
    return n


def _positive_int(field: str, value: object, upper: int = 2**31) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= upper:
        raise ValueError(f"{field} must be an integer in [1, {upper}], got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    model: str = DEFAULT_MODEL  # alias, HF folder or .gguf file
    dtype: str = "auto"  # auto = float32 on CPU
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0  # seeds the generators of requests that give no seed
    attention_backend: str = "sdpa"  # one of ATTENTION_BACKENDS

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len, 1 << 20)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float32 if self.dtype == "auto" else DTYPES[self.dtype]


KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # auto: the model dtype; fp8: float8 e4m3
KV_CACHE_SCALE_GRANULARITIES = ("token", "block")  # int8/fp8 scales per (token, kv head) or (block, kv head)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: a share of free RAM (see worker/kv_cache.py)
    kv_cache_dtype: str = "auto"
    # Per token: the more accurate in BENCHMARKS.md, and independent of chunking; per block: ~3% more tokens.
    kv_cache_scale_granularity: str = "token"
    enable_prefix_caching: bool = True
    kv_offload_memory: int | None = None  # bytes of the second KV tier (host pool); None or 0: no tier

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size!r}")
        if self.kv_cache_memory is not None:
            _positive_int("kv_cache_memory", self.kv_cache_memory, 1 << 50)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_scale_granularity not in KV_CACHE_SCALE_GRANULARITIES:
            raise ValueError(f"kv_cache_scale_granularity must be one of "
                             f"{', '.join(KV_CACHE_SCALE_GRANULARITIES)}; got {self.kv_cache_scale_granularity!r}")
        if self.kv_offload_memory:
            _positive_int("kv_offload_memory", self.kv_offload_memory, 1 << 50)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256  # requests running at once

    def __post_init__(self) -> None:
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens, 1 << 20)
        _positive_int("max_num_seqs", self.max_num_seqs, 1 << 16)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """Build from keyword options named like the CLI flags (dashes become underscores)."""
        groups: dict[str, dict[str, object]] = {"model": {}, "cache": {}, "scheduler": {}}
        fields = {
            "model": ModelConfig.__dataclass_fields__,
            "cache": CacheConfig.__dataclass_fields__,
            "scheduler": SchedulerConfig.__dataclass_fields__,
        }
        for key, value in options.items():
            if value is None:
                continue
            if key in ("kv_cache_memory", "kv_offload_memory"):
                value = parse_size(value, key)  # type: ignore[arg-type]
            group = next((g for g, f in fields.items() if key in f), None)
            if group is None:
                allowed = sorted(k for f in fields.values() for k in f)
                raise ValueError(f"unknown engine option {key!r}; allowed: {', '.join(allowed)}")
            groups[group][key] = value
        return cls(
            model=ModelConfig(**groups["model"]),  # type: ignore[arg-type]
            cache=CacheConfig(**groups["cache"]),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(**groups["scheduler"]),  # type: ignore[arg-type]
        )
