"""Time one decode step of many running requests (the default model), with switches for the two
attention changes measured in BENCHMARKS.md: how the paged cache is gathered and whether decodes
are grouped by context length; and the attention backend and dtype.

    python -m pagoda.bench.decode_step --num-seqs 64 --input-len 128:512 --gather index_select

The machine this project measures on changes speed from minute to minute, so two settings are best
compared in one process: `--alternate-prepack` alternates blocks of steps with plain and packed linear
weights, and `--bandwidth-floor` alternates steps with reading the weights' bytes (one decode step's
floor), each for `--rounds` rounds, and reports medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

import pagoda.layers.attention.backend as attention_backend
import pagoda.layers.attention.paged_kv as paged_kv
from pagoda import LLM, SamplingParams
from pagoda.bench.common import parse_range
from pagoda.config import ATTENTION_BACKENDS, DTYPES
from pagoda.engine.llm_engine import LLMEngine
from pagoda.layers.linear import prepack_linears


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
    p.add_argument("--prepack-weights", action="store_true", help="oneDNN-packed linear weights")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 512MiB (default: the engine's)")
    p.add_argument("--torch-profile", action="store_true",
                   help="also print torch.profiler's table of the timed steps' ops (self CPU time)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time ROUNDS blocks of --steps steps and report their median; with the two options "
                        "below, alternate blocks in one process, so both sides see the same machine")
    ab = p.add_mutually_exclusive_group()
    ab.add_argument("--bandwidth-floor", action="store_true",
                    help="alternate with reading a buffer as large as the linear weights (the bandwidth floor "
                         "of one decode step); reports the step's ratio to it")
    ab.add_argument("--alternate-prepack", action="store_true",
                    help="alternate plain and oneDNN-packed linear weights (--prepack-weights); reports both")
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
        params = SamplingParams(seed=i, max_tokens=2 * args.rounds * args.steps + 8, ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()  # prefill everything first
    sides = _alternatives(engine, args)
    times: dict[str, list[float]] = {name: [] for name in sides}
    with torch.profiler.profile() if args.torch_profile else contextlib.nullcontext() as prof:
        for _ in range(args.rounds):
            for name, side in sides.items():
                start = time.perf_counter()
                side()
                times[name].append((time.perf_counter() - start) / args.steps * 1000)
    if prof is not None:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    ms = statistics.median(times["step"])
    extra: dict[str, object] = {}
    if "packed_step" in times:
        packed_ms = statistics.median(times["packed_step"])
        extra = {"packed_step_ms": round(packed_ms, 1), "plain_over_packed": round(ms / packed_ms, 3)}
    if "weights_read" in times:
        floor_ms = statistics.median(times["weights_read"])
        extra = {"weights_read_ms": round(floor_ms, 1), "step_over_floor": round(ms / floor_ms, 3)}
    print(json.dumps({"num_seqs": args.num_seqs, "input_len": args.input_len, "gather": args.gather,
                      "grouping": not args.no_grouping, "attention_backend": args.attention_backend,
                      "dtype": args.dtype, "compile_model": args.compile_model,
                      "prepack_weights": args.prepack_weights,
                      "startup_compile_s": round(engine.compile_seconds, 1),
                      "kv_cache_blocks": engine.limits.kv.num_blocks, "rounds": args.rounds,
                      "decode_step_ms": round(ms, 1), **extra}))


def _alternatives(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """What each round times, in order: `step` (--steps engine steps) and, when asked, its counterpart."""
    linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]

    def steps() -> None:
        for _ in range(args.steps):
            engine.step()

    sides: dict[str, Callable[[], None]] = {"step": steps}
    if args.bandwidth_floor:
        # One buffer of the weights' bytes, summed: the read a decode step cannot avoid, measured as a rate.
        weights = torch.empty(sum(m.weight.numel() * m.weight.element_size() for m in linears) // 4)
        weights.normal_()

        def read() -> None:
            for _ in range(args.steps):
                weights.sum()

        sides["weights_read"] = read
    if args.alternate_prepack:
        if args.prepack_weights:
            raise SystemExit("--alternate-prepack packs the weights itself: leave out --prepack-weights")
        prepack_linears(engine.model)
        packed = {m: vars(m)["forward"] for m in linears if "forward" in vars(m)}

        def use(on: bool) -> None:
            for m, forward in packed.items():
                if on:
                    m.forward = forward  # type: ignore[method-assign]
                else:
                    vars(m).pop("forward", None)

        def plain_steps() -> None:
            use(False)
            steps()

        def packed_steps() -> None:
            use(True)
            steps()

        sides = {"step": plain_steps, "packed_step": packed_steps}
    return sides


if __name__ == "__main__":
    main()
