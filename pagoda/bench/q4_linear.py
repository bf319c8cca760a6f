"""Time the Q4_1 linear (`--quantization q4_1`: activations rounded to int8, then the 4-bit kernel;
pagoda/layers/q4_linear.py) against F.linear on float32 weights, at the default model's shapes (fused q/k/v,
o, fused gate/up, down) and the given row counts. The two alternate call by call, so that both see the same
machine; medians over --iters calls.

    python -m pagoda.bench.q4_linear --rows 1,4,16,128,512,2048
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
from pagoda.layers.q4_linear import Q4Linear, q4_library

# (in, out) of the default model's linears as Pagoda runs them
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]


def _median_us(fns: dict[str, Callable[[], object]], iters: int) -> dict[str, float]:
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,4,16,128,512,2048")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    lib = q4_library()
    g = torch.Generator().manual_seed(0)
    results = []
    for k, n in SHAPES:
        w = torch.randn(n, k, generator=g) * 0.05
        layer = Q4Linear(w, None, lib)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=g)
            us = _median_us({"float32": functools.partial(F.linear, x, w), "q4_1": functools.partial(layer, x)},
                            args.iters)
            macs = rows * k * n
            results.append({"in": k, "out": n, "rows": rows, "float32_us": round(us["float32"], 1),
                            "q4_1_us": round(us["q4_1"], 1), "q4_1_speedup": round(us["float32"] / us["q4_1"], 2),
                            "float32_gflops": round(2 * macs / us["float32"] / 1e3, 1),
                            "q4_1_gflops_equivalent": round(2 * macs / us["q4_1"] / 1e3, 1)})
    print(json.dumps({"results": results, "machine": machine_info()}))


if __name__ == "__main__":
    main()
