"""Time one decode step of many running requests (the default model), with switches for the two
attention changes measured in BENCHMARKS.md: how the paged cache is gathered and whether decodes
are grouped by context length; and the attention backend and dtype.

    python -m pagoda.bench.decode_step --num-seqs 64 --input-len 128:512 --gather index_select
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time

import torch

import pagoda.layers.attention.backend as attention_backend
import pagoda.layers.attention.paged_kv as paged_kv
from pagoda import LLM, SamplingParams
from pagoda.bench.common import parse_range
from pagoda.config import ATTENTION_BACKENDS, DTYPES


def _advanced_indexing(data: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    return data[block_tables]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--input-len", type=parse_range, default=(128, 512))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--gather", choices=["index_select", "advanced"], default="index_select")
    p.add_argument("--no-grouping", action="store_true", help="one padded decode batch per step")
    p.add_argument("--attention-backend", default="sdpa", choices=ATTENTION_BACKENDS)
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--compile-model", action="store_true", help="torch.compile the forward pass")
    p.add_argument("--prepack-weights", action="store_true", help="oneDNN-packed float32 linear weights")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 512MiB (default: the engine's)")
    p.add_argument("--torch-profile", action="store_true",
                   help="also print torch.profiler's table of the timed steps' ops (self CPU time)")
    args = p.parse_args()
    if args.gather == "advanced":
        paged_kv._take = _advanced_indexing
    if args.no_grouping:
        attention_backend.DECODE_GROUP_PADDING = float("inf")
    engine = LLM(attention_backend=args.attention_backend, dtype=args.dtype, compile_model=args.compile_model,
                 kv_cache_memory=args.kv_cache_memory, prepack_weights=args.prepack_weights).engine
    rng = random.Random(0)
    for i in range(args.num_seqs):
        prompt = [rng.randrange(100, 49000) for _ in range(rng.randint(*args.input_len))]
        engine.add_request(f"r{i}", prompt, SamplingParams(seed=i, max_tokens=args.steps + 8, ignore_eos=True))
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()  # prefill everything first
    with torch.profiler.profile() if args.torch_profile else contextlib.nullcontext() as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        ms = (time.perf_counter() - start) / args.steps * 1000
    if prof is not None:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    print(json.dumps({"num_seqs": args.num_seqs, "input_len": args.input_len, "gather": args.gather,
                      "grouping": not args.no_grouping, "attention_backend": args.attention_backend,
                      "dtype": args.dtype, "compile_model": args.compile_model,
                      "prepack_weights": args.prepack_weights,
                      "startup_compile_s": round(engine.compile_seconds, 1),
                      "kv_cache_blocks": engine.limits.kv.num_blocks, "decode_step_ms": round(ms, 1)}))


if __name__ == "__main__":
    main()
