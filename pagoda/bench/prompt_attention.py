"""Time attention on one causal prompt, the default model's head shapes (9 query, 3 KV heads, head_dim 64).

    python -m pagoda.bench.prompt_attention --tokens 512
    python -m pagoda.bench.prompt_attention --tokens 512 --paged [--context 1024]

Default: torch's SDPA called with 3-D (heads, tokens, head_dim) and with 4-D (1, heads, tokens, head_dim)
tensors; torch 2.13 on CPU runs its flash kernel only for 4-D inputs, 3-D ones go to the unfused math path.

--paged: the cpp backend's prompt kernels (pagoda/layers/attention/cpp_kernel.cpp: the float32 loop, and
`cpp_bf16` the bfloat16 kernel over float16 and bfloat16 caches, and on AMX int8 ones, where the CPU has it) against
SDPA as the engine calls it, over a paged cache of scattered blocks of 16. With --context C the prompt is a chunk of
--tokens queries after C tokens already in the cache: SDPA's path then gathers the context and masks; without, SDPA
takes the chunk's own K and V.
--versus-rev REV adds the loop as of git revision REV (`cpp_rev`; `cpp_rev_over_cpp` > 1: the checkout's is
faster). Calls alternate in one process (the machine's speed drifts).

Prints one JSON line per dtype (with --paged: per query and cache dtype, float32 queries over a float32, a
float16 and an int8 cache, bfloat16 over bfloat16): milliseconds per call (median of --iters) of each side.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagoda.bench.common import machine_info


def _time_ms(f: Callable[[], torch.Tensor], iters: int) -> float:
    times = []
    for _ in range(iters + 3):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3


def _kernel(f: Callable[[], torch.Tensor]) -> str:
    with torch.profiler.profile() as prof:
        f()
    names = [e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")]
    return names[0] if names else "?"


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batched: bool) -> torch.Tensor:
    if batched:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _paged(args: argparse.Namespace) -> None:
    from pagoda.layers.attention.cpp import bf16_prefill_available, paged_prefill, paged_prefill_bf16
    from pagoda.layers.attention.paged_kv import PagedKVCache, allocate_scales, k_cache_layout
    from pagoda.layers.attention.sdpa import SDPAAttentionBackend
    from pagoda.layers.kv_quant import KVCacheSpec

    g = torch.Generator().manual_seed(0)
    n, seq_len, bs = args.tokens, args.context + args.tokens, 16
    num_blocks = 2 * -(-seq_len // bs) + 64
    table = torch.randperm(num_blocks, generator=g)[: -(-seq_len // bs)]
    # (queries, cache): a float32 model's own cache, its float16 one (what --quantization runs: auto), its int8 one
    # (a scale per token, quantized as the engine writes it), bfloat16's
    for dtype, cache_dtype in ((torch.float32, torch.float32), (torch.float32, torch.float16),
                               (torch.float32, torch.int8), (torch.bfloat16, torch.bfloat16)):
        if cache_dtype == torch.int8:
            spec = KVCacheSpec(torch.int8, "token")
            cache = PagedKVCache(k_cache_layout(torch.zeros(num_blocks, 3, 64, bs, dtype=torch.int8)),
                                 torch.zeros(num_blocks, bs, 3, 64, dtype=torch.int8), spec,
                                 *allocate_scales(spec, num_blocks, bs, 3))
            slots = torch.arange(num_blocks * bs)
            cache.write(slots, *(torch.randn(slots.numel(), 3, 64, generator=g) for _ in range(2)))
        else:
            cache = PagedKVCache(k_cache_layout(torch.randn(num_blocks, 3, 64, bs, generator=g).to(cache_dtype)),
                                 torch.randn(num_blocks, bs, 3, 64, generator=g).to(cache_dtype),
                                 KVCacheSpec(cache_dtype))
        q = torch.randn(n, 9, 64, generator=g).to(dtype)
        keys, values = cache.gather(table, dtype)
        k, v = keys.flatten(0, 1)[seq_len - n: seq_len], values.flatten(0, 1)[seq_len - n: seq_len]
        sides: dict[str, Callable[[], torch.Tensor]] = {
            "sdpa": functools.partial(SDPAAttentionBackend().prefill, q, k, v, cache, table, seq_len, 0.125),
            "cpp": functools.partial(paged_prefill, q, cache, table, seq_len, 0.125)}
        if args.versus_rev is not None:
            sides["cpp_rev"] = functools.partial(paged_prefill, q, cache, table, seq_len, 0.125, args.versus_rev)
        if bf16_prefill_available(cache, 9):
            sides["cpp_bf16"] = functools.partial(paged_prefill_bf16, q, cache, table, seq_len, 0.125)
        times: dict[str, list[float]] = {name: [] for name in sides}
        for i in range(args.iters + 3):
            for name, f in sides.items():
                start = time.perf_counter()
                f()
                if i >= 3:
                    times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        want = sides["sdpa"]().float()
        print(json.dumps({"dtype": str(dtype).removeprefix("torch."),
                          "kv_cache": cache.spec.name, "tokens": n, "context": args.context}
                         | {f"ms_{name}": round(m, 3) for name, m in ms.items()}
                         | {f"sdpa_over_{name}": round(ms["sdpa"] / m, 2) for name, m in ms.items() if name != "sdpa"}
                         | ({"cpp_rev_over_cpp": round(ms["cpp_rev"] / ms["cpp"], 3)} if "cpp_rev" in ms else {})
                         | {f"max_abs_diff_{name}": float((f().float() - want).abs().max())
                            for name, f in sides.items() if name != "sdpa"}
                         | {"machine": machine_info()}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--paged", action="store_true", help="the cpp backend's prompt kernels against SDPA")
    p.add_argument("--context", type=int, default=0, help="with --paged: tokens already in the cache before "
                   "the prompt's --tokens")
    p.add_argument("--versus-rev", default=None, metavar="REV", help="with --paged: also time the loop kernel "
                   "as of git revision REV (its cpp_kernel.cpp and cpp_vector.h), alternated with the others")
    args = p.parse_args()
    for flag, value in (("--context", args.context), ("--versus-rev", args.versus_rev)):
        if value and not args.paged:
            p.error(f"{flag} needs --paged")
    if args.paged:
        return _paged(args)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(9, args.tokens, 64, generator=g).to(dtype)
        k, v = (torch.randn(3, args.tokens, 64, generator=g).to(dtype) for _ in range(2))

        three_d = functools.partial(_attend, q, k, v, False)
        four_d = functools.partial(_attend, q, k, v, True)
        ms3, ms4 = _time_ms(three_d, args.iters), _time_ms(four_d, args.iters)
        print(json.dumps({"dtype": str(dtype).removeprefix("torch."), "tokens": args.tokens,
                          "ms_3d": round(ms3, 3), "kernel_3d": _kernel(three_d),
                          "ms_4d": round(ms4, 3), "kernel_4d": _kernel(four_d), "speedup": round(ms3 / ms4, 2),
                          "max_abs_diff": float((three_d().float() - four_d().float()).abs().max()),
                          "machine": machine_info()}))


if __name__ == "__main__":
    main()
