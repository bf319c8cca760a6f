"""One decode step's matmuls alone: every linear layer of the default model's shapes as the engine runs
them (30 layers of the merged q/k/v, o, the merged gate/up, down, then the lm_head), each weight its own tensor
so the step streams ~540 MB of float32 weights from memory as the model does, for M rows (the requests in a
decode step). (Before 2026-12-02 the shapes were q, k, v, gate and up apart.)

Compares `F.linear` on plain weights with oneDNN on weights reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise`), the format inductor's freezing and
`--prepack-weights` use; in float32 also with oneDNN on the plain weights (`onednn_plain_ms`, what the
engine's float32 linears run beyond the GEMV's rows: ONEDNN_FLOAT32), and at 1-4 rows with the engine's C++
GEMV (`gemv_ms`). Prints one JSON line per row count: best of --repeats, in milliseconds; `ratio` is
F.linear's time over the packed weights'. Where oneDNN cannot pack the dtype on this CPU (bfloat16 without
AVX-512 BW/VL/DQ or AVX-NE-CONVERT), `onednn_packed_ms` and `ratio` are null.

    python -m pagoda.bench.linear_stream --rows 1,4,16,64
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagoda.bench.common import machine_info
from pagoda.layers.linear import GEMV_DTYPES, GEMV_MAX_ROWS, _gemv_for, _gemv_library, packable_rows

HIDDEN, INTERMEDIATE, VOCAB = 576, 1536, 49152
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down


def _best_ms(f: Callable[[], object], repeats: int) -> float:
    f()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128", help="comma-separated row counts (M)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g) * 0.02).to(dtype) for _ in range(args.layers) for n, k in LAYER_SHAPES]
    weights.append((torch.randn(VOCAB, HIDDEN, generator=g) * 0.02).to(dtype))  # lm_head
    packable = packable_rows(dtype) is not None
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights] if packable else []
    linear_pointwise = torch.ops.mkldnn._linear_pointwise
    # 1-GEMV_MAX_ROWS rows: also the C++ GEMV that the engine uses there (gemv.cpp)
    gemv = _gemv_for(_gemv_library()) if dtype in GEMV_DTYPES else None
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            inputs = {k: torch.randn(m, k, generator=g).to(dtype) for k in (HIDDEN, INTERMEDIATE)}
            if packable:  # same results
                for w, pw in zip(weights[:4] + weights[-1:], packed[:4] + packed[-1:], strict=True):
                    torch.testing.assert_close(linear_pointwise(inputs[w.shape[1]], pw, None, "none", [], ""),
                                               F.linear(inputs[w.shape[1]], w), rtol=tol, atol=tol)
            if dtype == torch.float32:  # oneDNN on the plain weight too
                for w in weights[:4] + weights[-1:]:
                    torch.testing.assert_close(linear_pointwise(inputs[w.shape[1]], w, None, "none", [], ""),
                                               F.linear(inputs[w.shape[1]], w), rtol=tol, atol=tol)
            xs = [inputs[w.shape[1]] for w in weights]

            def plain_step(xs: list[torch.Tensor] = xs) -> object:
                return [F.linear(x, w) for x, w in zip(xs, weights, strict=True)]

            def onednn_step(xs: list[torch.Tensor] = xs) -> object:
                return [linear_pointwise(x, pw, None, "none", [], "") for x, pw in zip(xs, packed, strict=True)]

            def onednn_plain_step(xs: list[torch.Tensor] = xs) -> object:
                return [linear_pointwise(x, w, None, "none", [], "") for x, w in zip(xs, weights, strict=True)]

            plain = _best_ms(plain_step, args.repeats)
            onednn = _best_ms(onednn_step, args.repeats) if packable else None
            row: dict[str, object] = {"rows": m, "dtype": args.dtype, "layers": args.layers,
                                      "linear_ms": round(plain, 2),
                                      "onednn_packed_ms": None if onednn is None else round(onednn, 2),
                                      "ratio": None if onednn is None else round(plain / onednn, 3)}
            if dtype == torch.float32:
                row["onednn_plain_ms"] = round(_best_ms(onednn_plain_step, args.repeats), 2)
            if gemv is not None and m <= GEMV_MAX_ROWS:
                for w in weights[:4] + weights[-1:]:
                    torch.testing.assert_close(gemv(inputs[w.shape[1]], w, None), F.linear(inputs[w.shape[1]], w),
                                               rtol=tol, atol=tol)

                def gemv_step(xs: list[torch.Tensor] = xs) -> object:
                    return [gemv(x, w, None) for x, w in zip(xs, weights, strict=True)]

                row["gemv_ms"] = round(_best_ms(gemv_step, args.repeats), 2)
            print(json.dumps(row | {"machine": machine_info()}))


if __name__ == "__main__":
    main()
