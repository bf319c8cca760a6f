"""Microbenchmark of weight formats for the default model's linear shapes on this CPU: float32,
bfloat16, float16 and torch's weight-only int8 kernel (`aten._weight_int8pack_mm`).

    python -m pagoda.bench.matmul_formats
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = [(576, 1536), (1536, 576), (576, 49152)]  # (in, out): MLP up/gate, MLP down, lm_head
ROWS = (1, 64, 512)  # tokens in the step: single-stream decode, a decode batch, a prefill chunk


def _time_us(f: Callable[[], object], iters: int = 30) -> float:
    f()
    start = time.perf_counter()
    for _ in range(iters):
        f()
    return (time.perf_counter() - start) / iters * 1e6


def _linear(x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: F.linear(x, w)


def measure(k: int, n: int, m: int) -> dict[str, float]:
    w, x = torch.randn(n, k), torch.randn(m, k)
    scales = w.abs().amax(1) / 127
    wq = torch.round(w / scales[:, None]).to(torch.int8)
    out: dict[str, float] = {"in": k, "out": n, "rows": m}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        out[f"{name}_us"] = _time_us(_linear(x.to(dtype), w.to(dtype)))
    iters = 3 if m * n > 10**6 else 10  # the int8 kernel is slow here: keep the run short
    out["int8_weight_only_us"] = _time_us(lambda: torch.ops.aten._weight_int8pack_mm(x, wq, scales), iters)
    return out


def main() -> None:
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads()}))
    for k, n in SHAPES:
        for m in ROWS:
            print(json.dumps({key: round(v, 1) for key, v in measure(k, n, m).items()}))


if __name__ == "__main__":
    main()
