"""Time one layer's decode attention alone: each backend's `decode` on one group of sequences over a
paged cache with the default model's head shapes (9 query heads, 3 KV heads, head_dim 64, blocks of 16).

    python -m pagoda.bench.decode_attention --num-seqs 128 --context 300:380 --dtype float32

Blocks are scattered at random through a cache larger than the working set, as they are after a while
of serving (`--block-order scattered`, the default); `--block-order consecutive` gives each sequence a run of
consecutive blocks, as the engine's block pool hands a fresh cache's blocks to a prompt (in id order; only the
blocks decodes append later land elsewhere). From memory the scattered order read ~1.3x slower at blocks of 16
on the Zen 4 machine (BENCHMARKS.md). Prints one JSON line per backend with the milliseconds per call
(median of --iters) and the effective read bandwidth (K and V bytes of the real context over that time).
`compiled` times its kernel even below MIN_COMPILED_TOKENS, where the engine would use SDPA instead: that is how
the threshold was chosen.

One layer's cache stays in L3 between calls where it fits (32-300 MiB on the machines measured); in a step,
every layer's comes from memory: `--layers 30` attends 30 caches in turn, as a step does. `--versus-rev REV`
alternates calls with the C++ kernel as it was at git revision REV, in one process (the machine's speed drifts
between runs).
`--versus-read` alternates each backend with torch's sum over a buffer as large as the context's K and V (all
layers'): the plain read of those bytes in this process, since one process's memory can be twice another's on these
VMs; `--block-order shared` gives every sequence the same blocks, which then stay in L2: the arithmetic alone.
`--kernel-only` times the C++ kernel with its arguments bound beforehand, as the one-call one-stream forward
calls it: for one sequence, the backend's Python around the call takes longer than the kernel. Each call still
crosses from Python through ctypes, which the forward's calls from C++ do not: 1.25-1.32 us of a short context's
~5 on the Zen 4 machine (BENCHMARKS.md, "What bounds one q4_1 stream's linears").
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch

from pagoda.bench.common import machine_info, parse_range
from pagoda.config import DTYPES, KV_CACHE_DTYPES
from pagoda.layers.attention.backend import DecodeGroup, get_attention_backend
from pagoda.layers.attention.cpp import paged_decode, prepared_decode
from pagoda.layers.attention.paged_kv import PagedKVCache, allocate_scales, k_cache_layout
from pagoda.layers.kv_quant import SCALE_GRANULARITIES, KVCacheSpec, kv_cache_spec
from pagoda.worker.host_memory import huge_page_zeros, move_to_huge_pages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=128)
    p.add_argument("--context", type=parse_range, default=(300, 380), help="context tokens per sequence MIN:MAX")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--backends", default="sdpa,compiled,cpp")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--kv-cache-scale-granularity", default="token", choices=SCALE_GRANULARITIES)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--block-size", type=int, default=16, help="tokens per cache block (the engine's --block-size)")
    p.add_argument("--block-order", default="scattered", choices=BLOCK_ORDERS,
                   help="each sequence's blocks at random through the cache (scattered), or in one run of "
                        "consecutive blocks (consecutive: a prompt's blocks in a fresh engine), or the same blocks "
                        "for every sequence (shared: they stay in cache, which times the arithmetic alone)")
    p.add_argument("--layers", type=int, default=1,
                   help="caches of this many layers, attended in turn as a step does; with 30 (the default model's "
                        "count) they no longer fit in L3 and come from memory, as in the engine")
    p.add_argument("--kernel-only", action="store_true",
                   help="cpp only: time the kernel called with its arguments prepared once (~1.3 us of ctypes a call), "
                        "as the one-call one-stream forward calls it, not the backend's Python around it (tens of "
                        "us, which hide one sequence's attention)")
    p.add_argument("--versus-rev", default=None, metavar="REV",
                   help="cpp only: alternate calls with the kernel as of git revision REV (its cpp_kernel.cpp and "
                        "cpp_vector.h), in one process, and report both")
    p.add_argument("--versus-read", action="store_true",
                   help="alternate each backend's calls with torch's sum over a buffer of the context's K and V bytes "
                        "(times --layers, on huge pages): what a plain read of those bytes takes in this process, "
                        "whose memory may be twice as fast as another's on these VMs")
    args = p.parse_args()
    for flag, value in (("--versus-rev", args.versus_rev), ("--kernel-only", args.kernel_only)):
        if value and args.backends != "cpp":
            p.error(f"{flag} is for the cpp kernel: use it with --backends cpp")
    dtype, bs, hq, hkv, d = DTYPES[args.dtype], args.block_size, 9, 3, 64
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.context[0], args.context[1] + 1, (args.num_seqs,), generator=g)
    width = int(-(-lens.max() // bs))
    num_blocks = 2 * args.num_seqs * width
    spec = kv_cache_spec(args.kv_cache_dtype, dtype, args.kv_cache_scale_granularity)
    caches = [_cache(spec, dtype, num_blocks, bs, hkv, d, g) for _ in range(args.layers)]
    tables = block_tables(args.num_seqs, width, num_blocks, args.block_order, g)
    group = DecodeGroup(rows=torch.arange(args.num_seqs), block_tables=tables, seq_lens=lens)
    q = torch.randn(args.num_seqs, hq, d, generator=g).to(dtype)
    context_bytes = 2 * int(lens.sum()) * spec.bytes_per_block(bs, hkv, d) // bs
    common = {"dtype": args.dtype, "kv_cache": spec.name, "num_seqs": args.num_seqs, "context": args.context,
              "layers": args.layers, "block_size": bs, "block_order": args.block_order}

    def timed(decode: Callable[[PagedKVCache], object]) -> Callable[[], float]:
        def call() -> float:  # ms per layer
            start = time.perf_counter()
            for cache in caches:
                decode(cache)
            return (time.perf_counter() - start) / args.layers * 1e3
        return call

    read = _plain_read(context_bytes * args.layers, args.layers) if args.versus_read else None
    for name in args.backends.split(","):
        backend = get_attention_backend(name, dtype)
        compile_s = backend.warmup(caches[0], hq, dtype, d**-0.5)
        # The compiled backend's kernel itself, even for groups it would hand to SDPA in the engine.
        decode = getattr(backend, "kernel_decode", None) or backend.decode  # type: ignore[attr-defined]
        sides = {"ms_per_call": timed(functools.partial(_call, decode, q, group, d**-0.5))}
        if args.versus_rev is not None:
            sides["versus_ms_per_call"] = timed(lambda cache: paged_decode(q, cache, tables, lens, d**-0.5,
                                                                           rev=args.versus_rev))
        if args.kernel_only:
            sides = {side: _kernel_only(q, caches, tables, lens, d**-0.5, args.layers,
                                        args.versus_rev if side.startswith("versus") else None) for side in sides}
        if read is not None:
            sides["read_ms"] = read
        times: dict[str, list[float]] = {side: [] for side in sides}
        with torch.inference_mode():
            for i in range(args.iters + 3):
                for side, call in sides.items():
                    took = call()
                    if i >= 3:
                        times[side].append(took)
        ms = {side: statistics.median(t) for side, t in times.items()}
        out: dict[str, object] = {"backend": name, **common, "ms_per_call": round(ms["ms_per_call"], 3),
                                  # 3 significant digits: a tiny context on a loaded machine is a small rate, not 0
                                  "read_gb_per_s": float(f"{context_bytes / ms['ms_per_call'] / 1e6:.3g}")}
        if args.versus_rev is not None:
            out |= {"versus_rev": args.versus_rev, "versus_ms_per_call": round(ms["versus_ms_per_call"], 3),
                    "versus_over_this": round(ms["versus_ms_per_call"] / ms["ms_per_call"], 3)}
        if args.versus_read:
            out |= {"read_ms_per_layer": round(ms["read_ms"], 3),
                    "read_gb_per_s_plain": float(f"{context_bytes / ms['read_ms'] / 1e6:.3g}"),
                    "this_over_read": round(ms["ms_per_call"] / ms["read_ms"], 3)}
        print(json.dumps(out | {"compile_s": round(compile_s, 2), "machine": machine_info()}))


BLOCK_ORDERS = ("scattered", "consecutive", "shared")


def block_tables(num_seqs: int, width: int, num_blocks: int, order: str, g: torch.Generator) -> torch.Tensor:
    """(num_seqs, width) block ids out of num_blocks: distinct, a random permutation's (scattered), or sequence i
    holding blocks i * width .. (i + 1) * width - 1 (consecutive); or every sequence the same blocks 0 .. width - 1
    (shared: not a state the engine is ever in, but one layer's blocks then stay in L2, so that the kernel's
    arithmetic is timed without memory's part)."""
    if order not in BLOCK_ORDERS:
        raise ValueError(f"block order must be one of {BLOCK_ORDERS}, got {order!r}")
    if order == "shared":
        return torch.arange(width).repeat(num_seqs, 1)
    if num_seqs * width > num_blocks:
        raise ValueError(f"{num_seqs} sequences of {width} blocks do not fit in {num_blocks} blocks")
    ids = torch.randperm(num_blocks, generator=g) if order == "scattered" else torch.arange(num_blocks)
    return ids[: num_seqs * width].view(num_seqs, width)


def _plain_read(nbytes: int, layers: int) -> Callable[[], float]:
    """Times torch's sum over one huge-page buffer of nbytes (float32): ms per layer, as the kernel's side reports."""
    buffer = huge_page_zeros(nbytes // 4 * 4).view(torch.float32)
    buffer.normal_()

    def call() -> float:
        start = time.perf_counter()
        buffer.sum()
        return (time.perf_counter() - start) / layers * 1e3
    return call


def _kernel_only(q: torch.Tensor, caches: list[PagedKVCache], tables: torch.Tensor, lens: torch.Tensor, scale: float,
                 layers: int, rev: str | None) -> Callable[[], float]:
    """Times the cpp kernel over the caches in turn, each call's arguments bound beforehand: ms per layer."""
    calls = [prepared_decode(q, cache, tables, lens, scale, rev)[0] for cache in caches]

    def call() -> float:
        start = time.perf_counter()
        for kernel in calls:
            kernel()
        return (time.perf_counter() - start) / layers * 1e3
    return call


def _call(decode: Callable[..., object], q: torch.Tensor, group: DecodeGroup, scale: float,
          cache: PagedKVCache) -> object:
    return decode(q, cache, group, scale)


def _cache(spec: KVCacheSpec, dtype: torch.dtype, num_blocks: int, bs: int, hkv: int, d: int,
           g: torch.Generator) -> PagedKVCache:
    """On huge pages where the system allows, as the engine allocates its cache (allocate_kv_cache), so that the
    kernel is timed over the memory it reads in the engine (on 4 KiB pages every block is a few TLB misses)."""
    k, v = torch.randn(num_blocks, hkv, d, bs, generator=g), torch.randn(num_blocks, bs, hkv, d, generator=g)
    if not spec.quantized:
        k_store, v_store = move_to_huge_pages([k.to(spec.storage_dtype), v.to(spec.storage_dtype)])
        return PagedKVCache(k_cache_layout(k_store), v_store, spec)
    # quantized as the engine writes them: one scale per (token or block, KV head)
    k_store, v_store = move_to_huge_pages([torch.empty(num_blocks, hkv, d, bs, dtype=spec.storage_dtype),
                                           torch.empty(num_blocks, bs, hkv, d, dtype=spec.storage_dtype)])
    cache = PagedKVCache(k_cache_layout(k_store), v_store, spec, *allocate_scales(spec, num_blocks, bs, hkv))
    slots = torch.arange(num_blocks * bs)
    cache.write(slots, k_cache_layout(k).reshape(-1, hkv, d).to(dtype), v.view(-1, hkv, d).to(dtype))
    return cache


if __name__ == "__main__":
    main()
