"""Time the fused elementwise ops (pagoda/layers/elementwise.py) against torch's ops on one step's tensors
with the default model's shapes (hidden 576, 9 query and 3 KV heads of 64, intermediate 1,536):

    python -m pagoda.bench.elementwise --tokens 2048 --dtype bfloat16 [--versus-rev REV]

--versus-rev REV also times the C++ ops as they were at git revision REV. The sides alternate call by call
in one process (the machine's speed drifts between runs). Prints one JSON line per op: milliseconds per
call (median of --iters) of each side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from pagoda.bench.common import machine_info
from pagoda.config import DTYPES
from pagoda.layers import elementwise
from pagoda.layers.elementwise import ElementwiseOps
from pagoda.layers.rotary import RotaryEmbedding

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=[d for d in DTYPES if d != "float64"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--versus-rev", default=None, metavar="REV")
    args = p.parse_args()
    dtype, t = DTYPES[args.dtype], args.tokens
    sides = {"cpp": ElementwiseOps(), "torch": ElementwiseOps()}
    sides["cpp"].enable_cpp(dtype)
    if args.versus_rev is not None:
        sides["rev"] = ElementwiseOps()
        sides["rev"].lib = elementwise._library(elementwise._ELEM[dtype], rev=args.versus_rev)
        sides["rev"].dtype = dtype
    if sides["cpp"].lib is None:
        raise SystemExit("the fused ops could not be built (see the log)")
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    x, residual, weight = randn(t, HIDDEN), randn(t, HIDDEN), randn(HIDDEN)
    qkv = randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    cos, sin = RotaryEmbedding(HEAD_DIM, t, 10000.0, None, dtype).cos_sin(torch.arange(t))
    gate, up = randn(t, INTERMEDIATE), randn(t, INTERMEDIATE)

    def rotary(ops: ElementwiseOps) -> object:  # in place on views of one projection, as the model calls it
        q = qkv[:, : HEADS * HEAD_DIM].view(t, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM: (HEADS + KV_HEADS) * HEAD_DIM].view(t, KV_HEADS, HEAD_DIM)
        return ops.rotary(q, k, cos, sin)

    calls: dict[str, Callable[[ElementwiseOps], object]] = {
        "add_rms_norm": lambda ops: ops.add_rms_norm(x, residual.clone(), weight, 1e-5),
        "rotary": rotary,
        "silu_mul": lambda ops: ops.silu_mul(gate, up),
    }
    for name, call in calls.items():
        times: dict[str, list[float]] = {side: [] for side in sides}
        for i in range(args.iters + 3):
            for side, ops in sides.items():
                start = time.perf_counter()
                call(ops)
                if i >= 3:
                    times[side].append((time.perf_counter() - start) * 1e3)
        ms = {f"{side}_ms": round(statistics.median(v), 3) for side, v in times.items()}
        print(json.dumps({"op": name, "tokens": t, "dtype": args.dtype, **ms, "versus_rev": args.versus_rev,
                          "machine": machine_info()}))


if __name__ == "__main__":
    main()
