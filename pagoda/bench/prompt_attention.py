"""Time torch's SDPA on one causal prompt, called with 3-D (heads, tokens, head_dim) and with 4-D
(1, heads, tokens, head_dim) tensors, the default model's head shapes (9 query, 3 KV heads, head_dim 64).

    python -m pagoda.bench.prompt_attention --tokens 512

torch 2.13 on CPU runs its flash kernel only for 4-D inputs; 3-D ones go to the unfused math path.
Prints one JSON line per dtype: milliseconds per call (median of --iters) and the kernel each took.
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
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
