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

Huge pages for what every step reads whole: the weights and the KV cache. Linux backs anonymous memory with
4 KiB pages unless a region asks for transparent huge pages (2 MiB) with madvise, where the system's setting
is `madvise` (`/sys/kernel/mm/transparent_hugepage/enabled`; this project's machines' setting; distributions
ship `always` or `madvise`). A decode step streams through hundreds of MB: on 4 KiB pages every 4 KiB is a TLB
miss and a stop for the hardware prefetchers, which do not cross a page. On this project's AVX2 machine one
150 MB read ran 16.7-22.1 GB/s on 4 KiB pages and 22.6-24.5 GB/s on huge pages, alternated, and one float32
stream's step went from 1.34-1.39x to 1.26-1.30x of its weights' read in one window (in another, no change
beyond the drift; BENCHMARKS.md, "Huge pages"). So the engine copies its weights into one huge-page region at
start-up (`move_to_huge_pages`), hands their old copies back to the kernel (`release_free_heap`: a q8_0 engine's
resident memory went from 1,432 to 608 MiB), and allocates each KV cache tensor in one (`huge_page_zeros`) where
its pages are backed at start-up (`--kv-cache-prefault`); a cache backed at first write is on 4 KiB pages
(`small_page_zeros`), which these VMs back far faster than fresh huge pages (kv_cache._zeros). Set
PAGODA_HUGE_PAGES=0 to keep the weights on 4 KiB pages and leave a prefaulted cache to numpy (which advises huge
pages for arrays of 4 MiB and more itself); where the system's setting is `never`, or the platform has no madvise,
the calls fall back to ordinary memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import os
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

# mallopt parameter numbers from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 30  # blocks above 1 GiB (a KV cache) are still mmapped
_TRIM_THRESHOLD = (1 << 31) - 1

_done: bool | None = None


@functools.cache
def _libc() -> Any:
    """The C library, or None where there is none (not glibc). Opened once: find_library runs ldconfig in a
    subprocess, and HeapReleaser calls malloc_trim every 64 MiB of a load."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _libc_function(name: str) -> Any:
    """The C library's function of that name, or None where there is no such library or function (not glibc)."""
    return getattr(_libc(), name, None)


def keep_freed_memory() -> bool:
    """Applies the settings once per process; returns whether they are in effect."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("PAGODA_KEEP_FREED_MEMORY", "1") == "0":
        logger.info("PAGODA_KEEP_FREED_MEMORY=0: glibc malloc left at its defaults")
        return _done
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return _done  # not glibc
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _done = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return _done


HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and most arm64 kernels
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_enabled() -> bool:
    """Whether huge_page_zeros asks for huge pages: PAGODA_HUGE_PAGES is not 0, the platform has madvise's
    MADV_HUGEPAGE, and the system's transparent huge page setting is `always` or `madvise`."""
    if os.environ.get("PAGODA_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_page_zeros(nbytes: int) -> torch.Tensor:
    """nbytes zeroed bytes (a uint8 tensor) starting on a 2 MiB boundary of an anonymous mapping advised for huge
    pages (huge_pages_enabled), or on a 64-byte boundary of ordinary memory without them. Either way the kernel
    hands out zero pages as they are first touched: a large cache costs no time and no memory until it is written."""
    if not huge_pages_enabled():  # numpy's zeros is calloc: fresh pages, not gigabytes of zeros written now
        buf = torch.from_numpy(np.zeros(nbytes + 64, dtype=np.uint8))
        start = -buf.data_ptr() % 64
        return buf[start:start + nbytes]
    # Whole huge pages from an aligned start, and one more for the alignment: the kernel only maps a huge page where
    # all of its 2 MiB lie inside the mapping. The unused head and tail are never touched, so they take no memory.
    # Private: a shared anonymous mapping is shmem, whose huge pages follow another setting (usually never).
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE)
    buf = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping for its lifetime
    start = -buf.data_ptr() % HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, start, length - start)
    return buf[start:start + nbytes]


def small_page_zeros(nbytes: int) -> torch.Tensor:
    """nbytes zeroed bytes (a uint8 tensor, page-aligned) of an anonymous mapping advised against huge pages where the
    platform has that advice (MADV_NOHUGEPAGE: the system's setting may be `always`). As with huge_page_zeros, the
    kernel hands out its pages as they are first written. For a KV cache whose pages are backed at first use
    (kv_cache._zeros says why not huge ones)."""
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8)[:nbytes]  # the tensor holds the mapping for its lifetime


PAGE = 4096  # bytes of the smallest page on x86-64 and most arm64 kernels


def touch_pages(t: torch.Tensor) -> None:
    """Writes a zero into every PAGE bytes of t (contiguous, zeroed: the contents stay as they were) and into its last
    byte (whose page the stride misses where t starts inside a page), so that the kernel backs all of its pages now
    rather than at their first use. For a KV cache asked to (`--kv-cache-prefault`): on this project's VM memory
    the host has not backed yet costs ~2-8 s per GiB at its first write (BENCHMARKS.md), paid inside the first
    requests' steps unless paid here. torch runs the strided write on its threads."""
    assert t.is_contiguous(), "touch_pages takes a contiguous tensor"
    b = t.view(-1).view(torch.uint8)
    b[::PAGE].zero_()
    b[-1:].zero_()


def huge_page_tensors(specs: Iterable[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """Tensors of these shapes and dtypes (contiguous, zero until written), carved one after another, each 64-byte
    aligned, from one huge_page_zeros region: no page is backed until its tensor is written."""
    specs = list(specs)
    offsets, end = [], 0
    for shape, dtype in specs:
        offsets.append(end)
        end += -(-math.prod(shape) * dtype.itemsize // 64) * 64
    region = huge_page_zeros(end)
    return [region[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for (shape, dtype), offset in zip(specs, offsets, strict=True)]


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the tensors (contiguous, same shapes and dtypes) in one region (huge_page_tensors). Call it once at
    start-up for tensors that stay; free the originals."""
    tensors = list(tensors)
    copies = huge_page_tensors((t.shape, t.dtype) for t in tensors)
    for t, copy in zip(tensors, copies, strict=True):
        copy.copy_(t)
    return copies


# Bytes copy_releasing copies between page drops: at 16 MiB the float32 model's largest tensor (its tied lm_head's
# tiles, 108 MiB) lifts the move's peak by a chunk instead of by itself.
RELEASE_CHUNK = 16 << 20
_MADV_DONTNEED = 4  # Linux's


def sole_holder(t: torch.Tensor, alias: bool = False) -> bool:
    """Whether the caller's tensor is all that holds t's memory: torch allocated it (resizable: not memory a NumPy
    array, a buffer or a file mapping lends, whose other holders torch cannot count), and its storage is t's alone,
    counted by the storage's use count (t, the storage's Python wrapper, and with alias the tensor t aliases: a
    parameter whose `.data` t is). A view, or another tensor over the same storage anywhere, makes it False."""
    storage = t.untyped_storage()
    whole = t.storage_offset() == 0 and t.numel() * t.element_size() == storage.nbytes()
    return whole and storage.resizable() and torch._C._storage_Use_Count(storage._cdata) == 2 + alias


def copy_releasing(dst: torch.Tensor, src: torch.Tensor, release: bool, chunk: int = RELEASE_CHUNK) -> None:
    """dst.copy_(src), chunk bytes at a time; with release, src's whole pages in each chunk are handed back to the
    kernel (madvise MADV_DONTNEED) once copied, so that the copy never holds both tensors whole: src then reads as
    zeros there, so release only a src about to be freed that nothing else reads (sole_holder). Copied whole, the
    float32 model's tied lm_head tiles (108 MiB) made the move to huge pages the start-up's peak (BENCHMARKS.md,
    "The move to huge pages a chunk at a time"). Tensors of other shapes, dtypes or layouts are copied whole."""
    madvise = _libc_function("madvise") if release and src.device.type == "cpu" else None
    same = dst.shape == src.shape and dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous()
    if madvise is None or not same or src.numel() == 0:
        dst.copy_(src)
        return
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    d, s, size = dst.view(-1), src.view(-1), src.element_size()
    page, start = mmap.PAGESIZE, src.data_ptr()
    dropped = -(-start // page) * page  # src's pages from here on are whole and not yet dropped
    per = max(1, chunk // size)
    for i in range(0, s.numel(), per):
        j = min(i + per, s.numel())
        d[i:j].copy_(s[i:j])
        end = (start + j * size) // page * page
        if end > dropped:
            madvise(dropped, end - dropped, _MADV_DONTNEED)
            dropped = end


class HeapReleaser:
    """Hands the free heap back (release_free_heap) each time `every` bytes have been reported freed: a start-up phase
    that replaces weights one by one (quantize_linears, prepack_linears, the move to huge pages) then gives their old
    copies back as it goes, instead of keep_freed_memory's settings holding them all until its end (which had made
    those phases the start-up's peak)."""

    def __init__(self, every: int = 64 << 20) -> None:
        self.every, self._since = every, 0

    def freed(self, nbytes: int) -> None:
        self._since += nbytes
        if self._since >= self.every:
            release_free_heap()
            self._since = 0


def release_free_heap() -> None:
    """Hand glibc's free heap memory back to the kernel (malloc_trim): after the weights move to huge pages, their
    old copies are free heap that keep_freed_memory's settings would otherwise keep resident."""
    malloc_trim = _libc_function("malloc_trim")
    if malloc_trim is not None:  # else not glibc
        malloc_trim(0)
