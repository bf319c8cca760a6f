"""The forward pass's elementwise steps (residual add + RMSNorm, rotary embedding, SiLU-and-multiply), in
torch or fused in C++ (`elementwise.cpp`).

Every module of a model shares one `ElementwiseOps`. It runs torch code (the reference, and what float64
models and the compiled forward use, where inductor fuses these steps itself) until `enable_cpp` builds
the C++ library for the model dtype (float32, bfloat16, float16) at start-up. The C++ versions follow
torch's rounding op by op (the source's header says where they can differ), and are tested against the
torch ones. A step the library does not take (another dtype, strides it does not handle) runs in torch.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pagoda.layers.cpp_build import load_library
from pagoda.layers.rotary import apply_rotary

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("elementwise.cpp")
_ELEM = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def _library(elem: int, portable: bool = False, rev: str | None = None) -> Any:
    """portable: without AVX-512 intrinsics even where the compiler targets AVX-512 (the code other CPUs
    run; tests build it). rev: the sources as of that git revision (`bench.elementwise --versus-rev`)."""
    lib = load_library(_SOURCE, {"ELEM": elem} | ({"PORTABLE": 1} if portable else {}), rev=rev)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pagoda_add_rms_norm.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, ctypes.c_float]
    lib.pagoda_head_rms_norm.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ctypes.c_float]
    lib.pagoda_rotary.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64]
    lib.pagoda_silu_mul.argtypes = [ptr, ptr, i64, ptr, i64, i64]
    for fn in (lib.pagoda_add_rms_norm, lib.pagoda_head_rms_norm, lib.pagoda_rotary, lib.pagoda_silu_mul):
        fn.restype = None
    return lib


class ElementwiseOps:
    def __init__(self) -> None:
        self.lib: Any = None  # the C++ library for self.dtype, once enable_cpp built it
        self.dtype: torch.dtype | None = None

    def enable_cpp(self, dtype: torch.dtype) -> float:
        """Build (or load from the cache) the C++ library for dtype; its seconds. Without a dtype it takes
        (float64), or if building fails (logged), the ops stay torch's."""
        if dtype not in _ELEM:
            return 0.0
        start = time.perf_counter()
        try:
            self.lib = _library(_ELEM[dtype])
        except Exception as e:  # no C++ compiler, ...
            logger.warning("could not compile the fused elementwise ops (%s); they run as torch ops", e)
            return time.perf_counter() - start
        self.dtype = dtype
        seconds = time.perf_counter() - start
        logger.info("fused elementwise ops ready in %.1f s", seconds)
        return seconds

    def disable_cpp(self) -> None:
        """Back to torch ops (before torch.compile traces the forward: inductor fuses them itself)."""
        self.lib = self.dtype = None

    def _takes(self, *tensors: torch.Tensor) -> bool:
        return self.lib is not None and all(t.dtype == self.dtype for t in tensors)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """h = residual + x (x when residual is None) -> (weight * rms_norm(h), h). h may be residual,
        updated in place."""
        dim = x.shape[-1]
        if (self._takes(x, weight) and x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous()
                and (residual is None or (residual.dtype == x.dtype and residual.is_contiguous()
                                          and residual.shape == x.shape))):
            out = torch.empty(x.shape, dtype=x.dtype)
            self.lib.pagoda_add_rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                                         weight.data_ptr(), out.data_ptr(), x.shape[0], dim, eps)
            return out, x if residual is None else residual
        h = x if residual is None else residual + x
        return rms_norm(h, weight, eps), h

    def head_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * rms_norm of each head of x (T, H, D), heads D apart (Qwen3's q and k norms): in the C++ path in
        place (x's rows are a projection's output, read by nothing else), else a new tensor."""
        t, heads, dim = x.shape
        if self._takes(x, weight) and x.stride(2) == 1 and x.stride(1) == dim and weight.is_contiguous():
            self.lib.pagoda_head_rms_norm(x.data_ptr(), x.stride(0), heads, weight.data_ptr(), x.data_ptr(),
                                          x.stride(0), t, dim, eps)
            return x
        return rms_norm(x, weight, eps)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (T, Hq, D), k: (T, Hkv, D), cos and sin (T, 1, D) from RotaryEmbedding.cos_sin. The C++ path
        rotates q and k in place."""
        t, hq, d = q.shape
        if (self._takes(q, k, cos, sin) and q.stride(2) == k.stride(2) == 1 and q.stride(1) == k.stride(1) == d
                and cos.is_contiguous() and sin.is_contiguous() and d % 2 == 0):
            self.lib.pagoda_rotary(q.data_ptr(), q.stride(0), hq, k.data_ptr(), k.stride(0), k.shape[1],
                                   cos.data_ptr(), sin.data_ptr(), t, d)
            return q, k
        return apply_rotary(q, k, cos, sin)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """F.silu(gate) * up for gate, up (T, N)."""
        if (self._takes(gate, up) and gate.dim() == 2 and gate.shape == up.shape and gate.stride() == up.stride()
                and gate.stride(1) == 1):
            out = torch.empty(gate.shape, dtype=gate.dtype)
            self.lib.pagoda_silu_mul(gate.data_ptr(), up.data_ptr(), gate.stride(0), out.data_ptr(), *gate.shape)
            return out
        return F.silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In float32 (or wider) as HF does: weight * (x * rsqrt(mean(x^2) + eps)) cast back to x's dtype."""
    dtype = x.dtype
    h = x.float() if dtype in (torch.float16, torch.bfloat16) else x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)
