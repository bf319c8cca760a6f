"""Time the Q4_1 linear (`--quantization q4_1`: activations rounded to int8, then the 4-bit kernel;
pagoda/layers/q4_linear.py) against F.linear on float32 weights, at the default model's shapes (fused q/k/v,
o, fused gate/up, down) and the given row counts, and with `--versus-rev REV` against the kernel as of git
revision REV. The sides alternate call by call, so that all see the same machine; medians over --iters calls.
The kernel against itself (`--versus-rev HEAD` on an unchanged checkout) reads 0.83-0.88x at one row and 0.92-1.03x
at 16-512 (BENCHMARKS.md, "Bias in the A/B tools"): smaller differences than that need both orders.

    python -m pagoda.bench.q4_linear --rows 1,4,16,128,512,2048

`--layers N`: one stream's decode instead, from memory: N layers of the four shapes (N = 30: the default model's
66 MB), called in turn at one row as a step calls them, against reading a buffer of their bytes (torch's sum: the
bandwidth floor) and, with `--versus-rev REV`, against the kernel as of git revision REV, with a read of that
buffer between the two kernels either way (unbiased: the kernel against itself reads 0.99-1.02x); alternated call
sequence by call sequence, medians over --iters sequences.

    python -m pagoda.bench.q4_linear --layers 30 --versus-rev HEAD~1
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

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
    p.add_argument("--layers", type=int, default=None, help="time one stream's calls over this many layers")
    p.add_argument("--versus-rev", default=None, metavar="REV",
                   help="also time the kernel as of git revision REV, alternated (versus_over_q4_1 > 1: the "
                        "checkout's is faster)")
    args = p.parse_args()
    if args.layers is not None:
        print(json.dumps(_one_stream(args.layers, args.iters, args.versus_rev) | {"machine": machine_info()}))
        return
    lib = q4_library()
    lib_rev = None if args.versus_rev is None else q4_library(rev=args.versus_rev)
    g = torch.Generator().manual_seed(0)
    results = []
    for k, n in SHAPES:
        w = torch.randn(n, k, generator=g) * 0.05
        layer = Q4Linear(w, None, lib)
        layer_rev = None if lib_rev is None else Q4Linear(w, None, lib_rev)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=g)
            sides: dict[str, Callable[[], object]] = {"float32": functools.partial(F.linear, x, w),
                                                      "q4_1": functools.partial(layer, x)}
            if layer_rev is not None:
                sides["versus_rev"] = functools.partial(layer_rev, x)
            us = _median_us(sides, args.iters)
            macs = rows * k * n
            row: dict[str, object] = {"in": k, "out": n, "rows": rows, "float32_us": round(us["float32"], 1),
                                      "q4_1_us": round(us["q4_1"], 1),
                                      "q4_1_speedup": round(us["float32"] / us["q4_1"], 2),
                                      "float32_gflops": round(2 * macs / us["float32"] / 1e3, 1),
                                      "q4_1_gflops_equivalent": round(2 * macs / us["q4_1"] / 1e3, 1)}
            if layer_rev is not None:
                row |= {"versus_rev_us": round(us["versus_rev"], 1),
                        "versus_over_q4_1": round(us["versus_rev"] / us["q4_1"], 3)}
            results.append(row)
    print(json.dumps({"results": results, "machine": machine_info()}))


def _one_stream(num_layers: int, iters: int, rev: str | None) -> dict[str, object]:
    """ms per sequence of one-row calls over num_layers layers of SHAPES (and per read of their bytes)."""
    lib = q4_library()
    g = torch.Generator().manual_seed(0)
    layers = [Q4Linear(torch.randn(n, k, generator=g) * 0.05, None, lib) for _ in range(num_layers) for k, n in SHAPES]
    nbytes = sum(layer.nbytes() for layer in layers)
    xs = {k: torch.randn(1, k, generator=g) for k, _ in SHAPES}
    ys = {n: torch.empty(1, n) for _, n in SHAPES}
    buffer = torch.empty(nbytes // 4).normal_(generator=g)

    def calls(kernel: Any) -> Callable[[], None]:
        args = [(xs[layer.in_features].data_ptr(), layer.w.data_ptr(), ys[layer.out_features].data_ptr(),
                 layer.out_features, layer.in_features) for layer in layers]

        def run() -> None:
            for x, w, y, n, k in args:
                kernel(x, w, None, y, 1, n, k)
        return run

    sides: dict[str, Callable[[], object]] = {"q4_1": calls(lib.pagoda_q4_linear), "weights_read": buffer.sum}
    if rev is not None:
        # Both kernels read the same weights: called back to back, the second found the end of them still in L3
        # and came out ~1.1x faster whichever it was. A read of the buffer between them, in both directions (the
        # buffer's second read, unreported), leaves each to start cold.
        sides |= {"versus_rev": calls(q4_library(rev=rev).pagoda_q4_linear), "flush": buffer.sum}
    ms = {k: v / 1e3 for k, v in _median_us(sides, iters).items() if k != "flush"}
    out: dict[str, object] = {"layers": num_layers, "weight_bytes": nbytes,
                              **{f"{k}_ms": round(v, 3) for k, v in ms.items()},
                              "q4_1_over_read": round(ms["q4_1"] / ms["weights_read"], 3)}
    if rev is not None:
        out |= {"versus_rev": rev, "versus_over_q4_1": round(ms["versus_rev"] / ms["q4_1"], 3)}
    return out


if __name__ == "__main__":
    main()
