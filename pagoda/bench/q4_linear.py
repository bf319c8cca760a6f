"""Time the Q4_1 linear (`--quantization q4_1`: activations rounded to int8, then the 4-bit kernel;
pagoda/layers/q4_linear.py) against F.linear on float32 weights, at the default model's shapes (fused q/k/v,
o, fused gate/up, down) and the given row counts, and with `--versus-rev REV` against the kernel as of git
revision REV. The sides alternate call by call, so that all see the same machine; medians over --iters calls.
The kernel against itself (`--versus-rev HEAD` on an unchanged checkout) reads 0.83-0.88x at one row and 0.92-1.03x
at 16-512 (BENCHMARKS.md, "Bias in the A/B tools"): smaller differences than that need both orders.

    python -m pagoda.bench.q4_linear --rows 1,4,16,128,512,2048

`--layers N`: one stream's decode instead, from memory: N layers of the four shapes (N = 30: the default model's
66 MB), their packed weights in one huge-page region in call order as the engine keeps them (move_to_huge_pages),
called in turn at one row from a C++ loop as the one-call decode forward calls them (pagoda/bench/layer_calls.cpp),
against reading a buffer of their bytes (torch's sum: the bandwidth floor), against `split_read`: the weights
themselves read layer by layer, each thread its share of each layer as the kernel splits the tiles, with no
arithmetic (what the calls would cost if the kernel's arithmetic were free), and, with `--versus-rev REV`, against
the kernel as of git revision REV. A read of a 64 MiB buffer runs before each side that reads the weights (else
it finds their end in cache); the kernel against itself read 0.986-1.034x in four runs. Alternated call sequence by
call sequence, medians over --iters sequences.

    python -m pagoda.bench.q4_linear --layers 30 --versus-rev HEAD~1

`--fused`: instead, the calls that fuse a layer's neighbours into it against the calls they replace, at the default
model's shapes and the given row counts, alternated call by call: a norm (residual add and RMSNorm) with the qkv
projection after it (`PackedLinear.after_norm`) against the fused elementwise ops' norm and then the layer; the same
ahead of the MLP in one call (`after_norm` with down) against the norm and then `PackedLinear.mlp`; and the MLP in
one call (`mlp`) against the fused gate_up and SiLU-and-multiply (`silu_mul`) and then the down layer. The outputs
are the same bits (tests/layers/test_q4_linear.py); `*_speedup` > 1: the fused call is faster.

    python -m pagoda.bench.q4_linear --fused --rows 16,128,512,2048
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pagoda.bench.common import machine_info
from pagoda.layers.cpp_build import load_library
from pagoda.layers.q4_linear import NR, Q4Linear, q4_library
from pagoda.worker.host_memory import move_to_huge_pages

# (in, out) of the default model's linears as Pagoda runs them
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]


def _timed(fn: Callable[[], object]) -> Callable[[], float]:
    """fn, returning its wall time in seconds."""
    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return run


def _alternate(sides: dict[str, Callable[[], float]], flush: Callable[[], object], iters: int) -> dict[str, float]:
    """Median seconds of each side (each returns its own), the sides alternated, flush() before each (untimed); the
    first round warms up and is not counted."""
    times: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(iters + 1):  # the first round warms up
        for name, side in sides.items():
            flush()
            seconds = side()
            if i:
                times[name].append(seconds)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,4,16,128,512,2048")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--layers", type=int, default=None, help="time one stream's calls over this many layers")
    p.add_argument("--versus-rev", default=None, metavar="REV",
                   help="also time the kernel as of git revision REV, alternated (versus_over_q4_1 > 1: the "
                        "checkout's is faster)")
    p.add_argument("--fused", action="store_true", help="time the fused calls against the calls they replace")
    args = p.parse_args()
    if args.fused:
        print(json.dumps({"results": _fused(args.rows, args.iters), "machine": machine_info()}))
        return
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
            us = {k: 1e6 * v for k, v in _alternate({k: _timed(f) for k, f in sides.items()}, lambda: None,
                                                      args.iters).items()}
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


def _fused(rows_list: str, iters: int) -> list[dict[str, object]]:
    """Per row count, median microseconds of each fused call and of the calls it replaces, and their ratios."""
    from pagoda.layers.elementwise import ElementwiseOps, _library

    lib = q4_library()
    ops = ElementwiseOps()
    ops.lib, ops.dtype = _library(0), torch.float32
    g = torch.Generator().manual_seed(0)
    (h, qkv_n), _, (_, gate_up_n), (inter, _) = SHAPES
    qkv = Q4Linear(torch.randn(qkv_n, h, generator=g) * 0.05, None, lib)
    gate_up = Q4Linear(torch.randn(gate_up_n, h, generator=g) * 0.05, None, lib)
    down = Q4Linear(torch.randn(h, inter, generator=g) * 0.05, None, lib)
    weight = torch.rand(h, generator=g) + 0.5

    def sides_of(x: torch.Tensor, residual: torch.Tensor) -> dict[str, Callable[[], object]]:
        def normed() -> torch.Tensor:
            return ops.add_rms_norm(x, residual, weight, 1e-5)[0]

        return {"norm_qkv": lambda: qkv.after_norm(x, residual, weight, 1e-5),
                "norm_then_qkv": lambda: qkv(normed()),
                "norm_mlp": lambda: gate_up.after_norm(x, residual, weight, 1e-5, down),
                "norm_then_mlp": lambda: gate_up.mlp(normed(), down),
                "mlp": lambda: gate_up.mlp(x, down),
                "silu_mul_then_down": lambda: down(gate_up.silu_mul(x))}

    results: list[dict[str, object]] = []
    for rows in (int(r) for r in rows_list.split(",")):
        sides = sides_of(torch.randn(rows, h, generator=g), torch.randn(rows, h, generator=g))
        us = {k: 1e6 * v for k, v in _alternate({k: _timed(f) for k, f in sides.items()}, lambda: None,
                                                  iters).items()}
        results.append({"rows": rows, **{f"{k}_us": round(v, 1) for k, v in us.items()},
                        "norm_qkv_speedup": round(us["norm_then_qkv"] / us["norm_qkv"], 3),
                        "norm_mlp_speedup": round(us["norm_then_mlp"] / us["norm_mlp"], 3),
                        "mlp_speedup": round(us["silu_mul_then_down"] / us["mlp"], 3)})
    return results


def _one_stream(num_layers: int, iters: int, rev: str | None) -> dict[str, object]:
    """ms per sequence of one-row calls over num_layers layers of SHAPES (and per read of their bytes)."""
    lib = q4_library()
    loops = load_library(Path(__file__).with_name("layer_calls.cpp"), {})
    loops.pagoda_bench_linear_calls.restype = loops.pagoda_bench_split_read.restype = ctypes.c_double
    g = torch.Generator().manual_seed(0)
    layers = [Q4Linear(torch.randn(n, k, generator=g) * 0.05, None, lib) for _ in range(num_layers) for k, n in SHAPES]
    weights = move_to_huge_pages(layer.w for layer in layers)
    nbytes = sum(w.numel() for w in weights)
    x = torch.randn(1, max(k for k, _ in SHAPES), generator=g)
    y = torch.empty(1, max(n for _, n in SHAPES))
    buffer = torch.empty(nbytes // 4).normal_(generator=g)
    flush = torch.empty(64 * 2**20 // 4).normal_(generator=g)

    def arr(kind: Any, values: list[int]) -> Any:
        return (kind * len(values))(*values)

    ws = arr(ctypes.c_void_p, [w.data_ptr() for w in weights])
    ns = arr(ctypes.c_int64, [layer.out_features for layer in layers])
    ks = arr(ctypes.c_int64, [layer.in_features for layer in layers])
    tiles = [layer.out_features // NR for layer in layers]
    tile_bytes = arr(ctypes.c_int64, [w.numel() // t for w, t in zip(weights, tiles, strict=True)])
    tile_counts = arr(ctypes.c_int64, tiles)

    def calls(kernel: Any) -> Callable[[], float]:
        fn = ctypes.cast(kernel, ctypes.c_void_p)
        return lambda: loops.pagoda_bench_linear_calls(fn, ctypes.c_void_p(x.data_ptr()), ws, ns, ks,
                                                        ctypes.c_int64(len(layers)), ctypes.c_void_p(y.data_ptr()))

    sides: dict[str, Callable[[], float]] = {
        "q4_1": calls(lib.pagoda_q4_linear), "weights_read": _timed(buffer.sum),
        "split_read": lambda: loops.pagoda_bench_split_read(ws, tile_counts, tile_bytes, ctypes.c_int64(len(layers)))}
    if rev is not None:
        sides["versus_rev"] = calls(q4_library(rev=rev).pagoda_q4_linear)
    ms = {k: 1e3 * v for k, v in _alternate(sides, flush.sum, iters).items()}
    out: dict[str, object] = {"layers": num_layers, "weight_bytes": nbytes,
                              **{f"{k}_ms": round(v, 3) for k, v in ms.items()},
                              "q4_1_over_read": round(ms["q4_1"] / ms["weights_read"], 3),
                              "q4_1_over_split_read": round(ms["q4_1"] / ms["split_read"], 3)}
    if rev is not None:
        out |= {"versus_rev": rev, "versus_over_q4_1": round(ms["versus_rev"] / ms["q4_1"], 3)}
    return out


if __name__ == "__main__":
    main()
