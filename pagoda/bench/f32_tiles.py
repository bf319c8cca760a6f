"""The engine's float32 tile kernel (pagoda/layers/f32_tiles.cpp: 12 rows x 32 columns of sums under AVX-512 over
weights packed as (N / 32, K, 32), linear.py's pack_tiles) against oneDNN on weights reordered into its blocked
layout (`_reorder_linear_weight`, then `_linear_pointwise`: the engine's float32 linears before the tiles, and still
where the kernel cannot be built), at the default model's shapes (q/k/v, o, gate/up, down, the lm_head). The sides
alternate call by call; medians over --iters calls. Each side's output is checked against the other's
(max_abs_diff; float32 sums in another order). BENCHMARKS.md, "Float32 linears on tiles of our own".

    python -m pagoda.bench.f32_tiles --rows 16,128,2048
    python -m pagoda.bench.f32_tiles --step --rows 128     # one decode step's matmuls: 30 layers, each its own weight

`--step`: per row count, every linear of a decode step in turn (--layers layers of the four shapes and the lm_head,
~540 MB of float32 weights at 30, streamed from memory as the model streams them) instead of one shape at a time
with its weight in the caches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pagoda.bench.common import machine_info
from pagoda.layers.linear import pack_tiles, tiles_library

# (in, out) of the default model's linears as Pagoda runs them, then its lm_head
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
LM_HEAD = (576, 49152)
PACK_ROWS_HINT = 16  # the batch size oneDNN's reorder is told, as pagoda/layers/linear.py's prepack_linears tells it


def _median_ms(sides: dict[str, Callable[[], object]], iters: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(iters + 1):  # the first round warms up
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            if i:
                times[name].append(1e3 * (time.perf_counter() - start))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="16,128,2048")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--step", action="store_true", help="a decode step's linears in turn, each its own weight")
    p.add_argument("--layers", type=int, default=30, help="layers of the step (--step)")
    args = p.parse_args()
    lib = tiles_library()
    g = torch.Generator().manual_seed(0)
    shapes = SHAPES * args.layers + [LM_HEAD] if args.step else SHAPES + [LM_HEAD]
    for rows in (int(r) for r in args.rows.split(",")):
        for row in _measure(lib, rows, shapes, args.step, args.iters, g):
            print(json.dumps(row | ({"layers": args.layers} if args.step else {}) | {"machine": machine_info()}))


def _measure(lib: Any, rows: int, shapes: list[tuple[int, int]], step: bool, iters: int,
             g: torch.Generator) -> list[dict[str, object]]:
    """One result per shape (or, with step, one for all of them in turn) at this many rows."""
    layers = []
    for k, n in shapes:
        w = torch.randn(n, k, generator=g) * 0.05
        layers.append((k, n, pack_tiles(w, lib.pagoda_f32_tiles_panel()),
                       torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)))
    xs = {k: torch.randn(rows, k, generator=g) for k in {k for k, _ in shapes}}
    ys = {n: torch.empty(rows, n) for n in {n for _, n in shapes}}

    def onednn(group: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> Callable[[], object]:
        return lambda: [torch.ops.mkldnn._linear_pointwise(xs[k], packed, None, "none", [], "")
                        for k, _, _, packed in group]

    def tiles(group: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> Callable[[], object]:
        return lambda: [lib.pagoda_f32_tiles_linear(xs[k].data_ptr(), wp.data_ptr(), None, ys[n].data_ptr(), rows,
                                                    n, k) for k, n, wp, _ in group]

    results: list[dict[str, object]] = []
    for group in [layers] if step else [[layer] for layer in layers]:
        k, n, _, packed = group[-1]
        tiles(group[-1:])()
        diff = (ys[n] - torch.ops.mkldnn._linear_pointwise(xs[k], packed, None, "none", [], "")).abs().max()
        ms = _median_ms({"onednn_packed": onednn(group), "tiles": tiles(group)}, iters)
        flop = sum(2 * rows * k * n for k, n, _, _ in group)
        results.append({"rows": rows, **({} if step else {"in": k, "out": n}),
                        **{f"{side}_ms": round(v, 3) for side, v in ms.items()},
                        **{f"{side}_gflops": round(flop / v / 1e6, 1) for side, v in ms.items()},
                        "tiles_speedup": round(ms["onednn_packed"] / ms["tiles"], 3), "max_abs_diff": float(diff)})
    return results


if __name__ == "__main__":
    main()
