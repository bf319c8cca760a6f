"""Time one layer's decode attention alone: each backend's `decode` on one group of sequences over a
paged cache with the default model's head shapes (9 query heads, 3 KV heads, head_dim 64, blocks of 16).

    python -m pagoda.bench.decode_attention --num-seqs 128 --context 300:380 --dtype float32

Blocks are scattered at random through a cache larger than the working set, as they are after a while
of serving. Prints one JSON line per backend with the milliseconds per call (median of --iters) and
the effective read bandwidth (K and V bytes of the real context over that time). `compiled` times its
kernel even below MIN_COMPILED_TOKENS, where the engine would use SDPA instead: that is how the
threshold was chosen.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagoda.bench.common import machine_info, parse_range
from pagoda.config import DTYPES, KV_CACHE_DTYPES
from pagoda.layers.attention.backend import DecodeGroup, get_attention_backend
from pagoda.layers.attention.paged_kv import PagedKVCache, k_cache_layout
from pagoda.layers.kv_quant import SCALE_DTYPE, SCALE_GRANULARITIES, kv_cache_spec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=128)
    p.add_argument("--context", type=parse_range, default=(300, 380), help="context tokens per sequence MIN:MAX")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--backends", default="sdpa,compiled,cpp")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--kv-cache-scale-granularity", default="token", choices=SCALE_GRANULARITIES)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    dtype, bs, hq, hkv, d = DTYPES[args.dtype], 16, 9, 3, 64
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(args.context[0], args.context[1] + 1, (args.num_seqs,), generator=g)
    width = int(-(-lens.max() // bs))
    num_blocks = 2 * args.num_seqs * width
    spec = kv_cache_spec(args.kv_cache_dtype, dtype, args.kv_cache_scale_granularity)
    k, v = torch.randn(num_blocks, hkv, d, bs, generator=g), torch.randn(num_blocks, bs, hkv, d, generator=g)
    if spec.quantized:  # quantized as the engine writes them: one scale per (token or block, KV head)
        cache = PagedKVCache(k_cache_layout(torch.empty(num_blocks, hkv, d, bs, dtype=spec.storage_dtype)),
                             torch.empty(num_blocks, bs, hkv, d, dtype=spec.storage_dtype), spec,
                             *[torch.zeros(spec.scale_shape(num_blocks, bs, hkv) or (), dtype=SCALE_DTYPE)
                               for _ in range(2)])
        slots = torch.arange(num_blocks * bs)
        cache.write(slots, k_cache_layout(k).reshape(-1, hkv, d).to(dtype), v.view(-1, hkv, d).to(dtype))
    else:
        cache = PagedKVCache(k_cache_layout(k.to(dtype)), v.to(dtype), spec)
    tables = torch.randperm(num_blocks, generator=g)[: args.num_seqs * width].view(args.num_seqs, width)
    group = DecodeGroup(rows=torch.arange(args.num_seqs), block_tables=tables, seq_lens=lens)
    q = torch.randn(args.num_seqs, hq, d, generator=g).to(dtype)
    context_bytes = 2 * int(lens.sum()) * spec.bytes_per_block(bs, hkv, d) // bs
    for name in args.backends.split(","):
        backend = get_attention_backend(name, dtype)
        compile_s = backend.warmup(cache, hq, dtype, d**-0.5)
        # The compiled backend's kernel itself, even for groups it would hand to SDPA in the engine.
        decode = getattr(backend, "kernel_decode", None) or backend.decode  # type: ignore[attr-defined]
        times = []
        with torch.inference_mode():
            for _ in range(args.iters + 3):
                start = time.perf_counter()
                decode(q, cache, group, d**-0.5)
                times.append(time.perf_counter() - start)
        ms = statistics.median(times[3:]) * 1e3
        print(json.dumps({"backend": name, "dtype": args.dtype, "kv_cache": spec.name, "num_seqs": args.num_seqs,
                          "context": args.context,
                          "ms_per_call": round(ms, 3), "read_gb_per_s": round(context_bytes / ms / 1e6, 2),
                          "compile_s": round(compile_s, 2), "machine": machine_info()}))


if __name__ == "__main__":
    main()
