"""Host allocator settings for the CPU path.

glibc's malloc serves large blocks (above a threshold that grows only to 32 MiB) with a fresh mmap
and returns them to the kernel on free, and trims the top of its heap when much of it is free.
An engine step allocates the same large temporaries every step (activations, logits of
batch x vocab floats, sampling buffers), so each step page-faults them in again: 128 rows of
49,152 logits are 25 MiB, and on this project's machine one pass over such a fresh buffer cost
more than a pass over a reused one (`python -m pagoda.bench.sampler`: the sampler took 11-32 ms per
call for 128 rows with glibc's defaults, 8.5-15 ms with this setting; BENCHMARKS.md).

`keep_freed_memory()` tells glibc to keep freed memory for reuse (mmap threshold 1 GiB, no trim;
both are needed: either alone left the sampler as slow), which is what CPU inference servers get by
LD_PRELOADing tcmalloc or jemalloc. The cost: the process keeps its peak heap instead of handing it
back. Set PAGODA_KEEP_FREED_MEMORY=0 to leave glibc's
defaults alone; on a C library other than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 30  # blocks above 1 GiB (a KV cache) are still mmapped
_TRIM_THRESHOLD = (1 << 31) - 1

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Applies the settings once per process; returns whether they are in effect."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("PAGODA_KEEP_FREED_MEMORY", "1") == "0":
        logger.info("PAGODA_KEEP_FREED_MEMORY=0: glibc malloc left at its defaults")
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return _done  # not glibc
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _done = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return _done
