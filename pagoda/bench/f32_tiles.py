"""The engine's tile kernels (pagoda/layers/f32_tiles.cpp: 12 rows x 32 columns of sums under AVX-512 over
weights packed as (N / 32, K, 32), bfloat16 ones in pairs of k, linear.py's pack_tiles) against oneDNN on weights
reordered into its blocked layout (`_reorder_linear_weight`, then `_linear_pointwise`: the engine's float32 linears
before the tiles, its bfloat16 ones' 1-1,024-row steps before the bfloat16 tiles, and still where the kernels
cannot be built), at the default model's shapes (q/k/v, o, gate/up, down, the lm_head). In bfloat16 also F.linear
on the plain weight (what bfloat16 steps of over 1,024 rows ran), and at 1-4 rows the GEMV (gemv.cpp, what both
dtypes' steps ran at those rows before the tiles). The sides alternate call by call; medians over --iters calls.
The tiles' output is checked against F.linear in float32 on the same values (max_abs_diff: sums in another order,
and in bfloat16 the rounding of the output). BENCHMARKS.md, "Float32 linears on tiles of our own", "The tiles
replace the plain weights; bfloat16 linears on the tiles" and "An AVX2 build through the engine's own compiler".

    python -m pagoda.bench.f32_tiles --rows 16,128,2048
    python -m pagoda.bench.f32_tiles --step --rows 128     # one decode step's matmuls: 30 layers, each its own weight
    python -m pagoda.bench.f32_tiles --dtype bfloat16 --rows 1,16,128,2048

An AVX2 CPU's build, timed on a newer CPU: the kernels are compiled by torch's inductor, which reads
TORCHINDUCTOR_CPP_MARCH and ATEN_CPU_CAPABILITY, and oneDNN reads ONEDNN_MAX_CPU_ISA (a flag added through
load_library's extra_flags does not narrow the build: inductor's own -march and -mavx512f stay):

    TORCHINDUCTOR_CPP_MARCH=haswell ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
        python -m pagoda.bench.f32_tiles --step --rows 1,4

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
from pagoda.layers.linear import (
    GEMV_MAX_ROWS,
    _gemv_for,
    _gemv_library,
    pack_tiles,
    packable_rows,
    tiles_function,
    tiles_library,
)

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
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args()
    lib = tiles_library()
    g = torch.Generator().manual_seed(0)
    shapes = SHAPES * args.layers + [LM_HEAD] if args.step else SHAPES + [LM_HEAD]
    for rows in (int(r) for r in args.rows.split(",")):
        for row in _measure(lib, rows, shapes, args.step, args.iters, g, getattr(torch, args.dtype)):
            print(json.dumps(row | ({"layers": args.layers} if args.step else {}) | {"dtype": args.dtype,
                                                                                      "machine": machine_info()}))


Layer = tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]  # in, out, tiles, oneDNN's packed, plain


def _measure(lib: Any, rows: int, shapes: list[tuple[int, int]], step: bool, iters: int, g: torch.Generator,
             dtype: torch.dtype = torch.float32) -> list[dict[str, object]]:
    """One result per shape (or, with step, one for all of them in turn) at this many rows."""
    onednn_packs = packable_rows(dtype) is not None  # bfloat16 not on AVX2 CPUs: no oneDNN side there
    layers: list[Layer] = []
    for k, n in shapes:
        w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
        layers.append((k, n, pack_tiles(w, lib.pagoda_f32_tiles_panel()),
                       torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) if onednn_packs else w, w))
    xs = {k: torch.randn(rows, k, generator=g).to(dtype) for k in {k for k, _ in shapes}}
    ys = {n: torch.empty(rows, n, dtype=dtype) for n in {n for _, n in shapes}}
    kernel = tiles_function(lib, dtype)

    def onednn(group: list[Layer]) -> Callable[[], object]:
        return lambda: [torch.ops.mkldnn._linear_pointwise(xs[k], packed, None, "none", [], "")
                        for k, _, _, packed, _ in group]

    def tiles(group: list[Layer]) -> Callable[[], object]:
        return lambda: [kernel(xs[k].data_ptr(), wp.data_ptr(), None, ys[n].data_ptr(), rows, n, k)
                        for k, n, wp, _, _ in group]

    def f_linear(group: list[Layer]) -> Callable[[], object]:
        return lambda: [torch.nn.functional.linear(xs[k], w) for k, _, _, _, w in group]

    def gemv(group: list[Layer]) -> Callable[[], object]:
        call = _gemv_for(_gemv_library())
        return lambda: [call(xs[k], w, None) for k, _, _, _, w in group]

    results: list[dict[str, object]] = []
    for group in [layers] if step else [[layer] for layer in layers]:
        k, n, _, _, w = group[-1]
        tiles(group[-1:])()
        diff = (ys[n].float() - torch.nn.functional.linear(xs[k].float(), w.float())).abs().max()
        sides = {"onednn_packed": onednn(group)} if onednn_packs else {}
        sides["tiles"] = tiles(group)
        if dtype == torch.bfloat16:
            sides["f_linear"] = f_linear(group)
        if rows <= GEMV_MAX_ROWS:
            sides["gemv"] = gemv(group)
        ms = _median_ms(sides, iters)
        flop = sum(2 * rows * k * n for k, n, _, _, _ in group)
        results.append({"rows": rows, **({} if step else {"in": k, "out": n}),
                        **{f"{side}_ms": round(v, 3) for side, v in ms.items()},
                        **{f"{side}_gflops": round(flop / v / 1e6, 1) for side, v in ms.items()},
                        **({"tiles_speedup": round(ms["onednn_packed"] / ms["tiles"], 3)} if onednn_packs else {}),
                        "tiles_over_best_other": round(min(v for s, v in ms.items() if s != "tiles") / ms["tiles"], 3),
                        "max_abs_diff": float(diff)})
    return results


if __name__ == "__main__":
    main()
