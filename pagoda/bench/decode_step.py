"""Time one decode step of many running requests (the default model), with switches for the two
attention changes measured in BENCHMARKS.md: how the paged cache is gathered and whether decodes
are grouped by context length; and the attention backend and dtype.

    python -m pagoda.bench.decode_step --num-seqs 64 --input-len 128:512 --gather index_select

The machine this project measures on changes speed from minute to minute, so two settings are best
compared in one process: `--versus X --rounds N` alternates blocks of --steps steps with X (another
setting, or reading the weights' bytes: the step's bandwidth floor) for N rounds and reports medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import pagoda.layers.attention.backend as attention_backend
import pagoda.layers.attention.paged_kv as paged_kv
from pagoda import LLM, SamplingParams
from pagoda.bench.common import parse_range
from pagoda.config import ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS
from pagoda.engine.llm_engine import LLMEngine
from pagoda.layers.attention import AttentionBackend, cpp, get_attention_backend
from pagoda.layers.attention.cpp import CppAttentionBackend
from pagoda.layers.linear import is_packed, prepack_linears
from pagoda.layers.q4_linear import weight_bytes
from pagoda.worker.host_memory import huge_page_zeros


def _advanced_indexing(data: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    return data[block_tables]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--input-len", type=parse_range, default=(128, 512))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--gather", choices=["index_select", "advanced"], default="index_select")
    p.add_argument("--no-grouping", action="store_true", help="one padded decode batch per step")
    p.add_argument("--attention-backend", default="sdpa", choices=ATTENTION_BACKENDS,
                   help="default sdpa, as this benchmark's first figures (BENCHMARKS.md) were taken; the engine's "
                        "default, auto, is the cpp kernel: pass cpp to time the engine as it runs")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--compile-model", action="store_true", help="torch.compile the forward pass")
    p.add_argument("--prepack-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="oneDNN-packed linear weights (default: the engine's choice, on for float32 and bfloat16)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    p.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 512MiB (default: the engine's)")
    p.add_argument("--kv-cache-prefault", action="store_true",
                   help="the engine's flag: the cache backed at start-up, on huge pages where the system allows")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="the engine's flag: decode steps run in one call; --steps must be a multiple of it, and "
                        "times are still per decode step")
    p.add_argument("--torch-profile", action="store_true",
                   help="also print torch.profiler's table of the timed steps' ops (self CPU time)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time ROUNDS blocks of --steps steps and report their median; with --versus, alternate "
                        "blocks in one process, so that both sides see the same machine")
    p.add_argument("--versus", choices=sorted(VERSUS), default=None,
                   help="; ".join(f"{k}: {v}" for k, v in VERSUS.items()))
    args = p.parse_args()
    if args.steps % args.num_scheduler_steps:
        raise SystemExit("--steps must be a multiple of --num-scheduler-steps")
    if args.num_scheduler_steps > 1 and (args.versus in EAGER_ONLY or args.versus == "eager-one-stream"):
        raise SystemExit(f"--versus {args.versus} runs the eager forward, which takes decode steps one at a time")
    if args.gather == "advanced":
        paged_kv._take = _advanced_indexing
    if args.no_grouping:
        attention_backend.DECODE_GROUP_PADDING = float("inf")
    engine = LLM(attention_backend=args.attention_backend, dtype=args.dtype, compile_model=args.compile_model,
                 kv_cache_memory=args.kv_cache_memory, kv_cache_prefault=args.kv_cache_prefault,
                 prepack_weights=False if args.versus == "packed-weights" else args.prepack_weights,
                 kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                 num_scheduler_steps=args.num_scheduler_steps).engine
    packed = any(is_packed(m) for m in engine.model.modules() if isinstance(m, torch.nn.Linear))
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
    if args.versus:
        other = statistics.median(times[args.versus])
        extra = {"versus": args.versus, "versus_ms": round(other, 2), "step_over_versus": round(ms / other, 3)}
    print(json.dumps({"num_seqs": args.num_seqs, "input_len": args.input_len, "gather": args.gather,
                      "grouping": not args.no_grouping, "attention_backend": args.attention_backend,
                      "dtype": args.dtype, "compile_model": args.compile_model,
                      "prepack_weights": packed, "kv_cache_dtype": args.kv_cache_dtype,
                      "quantization": args.quantization, "num_scheduler_steps": args.num_scheduler_steps,
                      "startup_compile_s": round(engine.compile_seconds, 1),
                      "kv_cache_blocks": engine.limits.kv.num_blocks, "rounds": args.rounds,
                      "decode_step_ms": round(ms, 2), **extra}))


VERSUS = {
    "weights-read": "reading a buffer as large as the linear weights, the bandwidth floor of a decode step",
    "packed-weights": "the same steps on packed linear weights (--prepack-weights: the tiles, or oneDNN's packing "
                      "where they cannot be built) against plain ones; leave that flag out",
    "opaque-attention": "with --compile-model, the same steps without the one-stream graph (attention as the "
                        "opaque op)",
    "eager-one-stream": "decode steps in one C++ call (pagoda/model/one_stream.py: one stream's; up to 4 "
                        "sequences' of a bfloat16 or float32 model, any number under --quantization) against the "
                        "eager forward",
    "no-prefetch": "with the cpp backend, its kernel prefetching the next blocks' K and V (as the engine does) "
                   "against not prefetching",
    "torch-elementwise": "the elementwise steps as torch ops, not the fused C++ ones (--no-fused-ops)",
    "torch-sampler": "the sampler's torch code for every row, not its C++ pass (--no-fused-ops)",
    "length-groups": "with the cpp backend, decodes in groups of similar length (as for sdpa), not one group",
    **{f"{name}-attention": f"the same steps with attention backend {name}" for name in ("sdpa", "compiled", "cpp")},
}


# --versus settings that swap a piece of the eager forward (its elementwise ops, the decode kernel's prefetching, the
# decode grouping, the attention backend). The one-call forward (pagoda/model/one_stream.py) calls the cpp kernels
# it was built with and takes the steps it applies to on either side, so with these both sides run the eager forward.
EAGER_ONLY = ("torch-elementwise", "no-prefetch", "length-groups", *(k for k in VERSUS if k.endswith("-attention")))


def _alternatives(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """What each round times, in order: `step` (--steps engine steps) and, with --versus, its counterpart."""
    linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    if args.versus in EAGER_ONLY:
        engine.model.one_stream_forward = None

    def steps() -> None:  # --steps decode steps: as many engine steps, or fewer that run several each
        for _ in range(args.steps // args.num_scheduler_steps):
            engine.step()

    def after(setup: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            setup()
            steps()

        return run

    if args.versus == "weights-read":
        # One buffer of the weights' bytes, summed: the read a decode step cannot avoid, measured as a rate.
        # Quantized layers count their packed bytes (4-bit weights and their scales). On huge pages where the
        # engine's weights are (host_memory): the floor is the best plain read this machine offers.
        weights = huge_page_zeros(sum(weight_bytes(m) for m in linears) // 4 * 4).view(torch.float32)
        weights.normal_()

        def read() -> None:
            for _ in range(args.steps):
                weights.sum()

        return {"step": steps, "weights-read": read}
    if args.versus == "packed-weights":
        if args.prepack_weights is not None:
            raise SystemExit("--versus packed-weights packs the weights itself: leave out --[no-]prepack-weights")
        prepack_linears(engine.model, keep_plain=True)  # the unpacked side runs on the plain weights
        # oneDNN's packed weight (bfloat16) or the tiles (float32), whichever prepack_linears gave the layer
        packed = {m: (m._pagoda_packed, m._pagoda_tiles) for m in linears if is_packed(m)}

        def pack() -> None:
            for m, (weight, tiles) in packed.items():
                m._pagoda_packed, m._pagoda_tiles = weight, tiles

        def unpack() -> None:
            for m in packed:
                m._pagoda_packed = m._pagoda_tiles = None  # type: ignore[assignment]

        return {"step": after(unpack), "packed-weights": after(pack)}
    if args.versus == "opaque-attention":
        model = engine.model
        graph = model.compiled_one_stream
        if graph is None:
            raise SystemExit("--versus opaque-attention needs --compile-model (and a cache in the model dtype)")

        def use_graph() -> None:
            model.compiled_one_stream = graph

        def drop_graph() -> None:
            model.compiled_one_stream = None

        return {"step": after(use_graph), "opaque-attention": after(drop_graph)}
    if args.versus == "eager-one-stream":
        model = engine.model
        one_call = model.one_stream_forward
        if one_call is None:
            raise SystemExit("--versus eager-one-stream needs the one-call decode forward: a bfloat16 or "
                             "float32 model, the cpp attention backend, the fused ops, a cache of the model's dtype "
                             "(the start-up log says why it is off)")

        def use_one_call() -> None:
            model.one_stream_forward = one_call

        def use_eager() -> None:
            model.one_stream_forward = None

        return {"step": after(use_one_call), "eager-one-stream": after(use_eager)}
    if args.versus == "no-prefetch":
        ahead = cpp.PREFETCH_AHEAD
        cpp.PREFETCH_MAX_ELEMENT_BYTES = 8  # this side prefetches whatever the cache's element size
        for n in (ahead, 0):  # both libraries built before the timing starts
            cpp.PREFETCH_AHEAD = n
            cpp._library_for(engine.runner.kv_caches[0], engine.arch.num_heads)

        def prefetch(n: int) -> Callable[[], None]:
            def run() -> None:
                cpp.PREFETCH_AHEAD = n
                steps()

            return run

        return {"step": prefetch(ahead), "no-prefetch": prefetch(0)}
    if args.versus in ("torch-elementwise", "torch-sampler"):
        # both keep their C++ library in .lib (None: torch code); this side runs without it
        holder: Any = engine.model.ops if args.versus == "torch-elementwise" else engine.runner.sampler
        lib = holder.lib
        if lib is None:
            raise SystemExit(f"--versus {args.versus} needs the engine's fused ops (not with float64; the "
                             "elementwise ones not with --compile-model)")

        def with_lib(fused: bool) -> Callable[[], None]:
            def run() -> None:
                holder.lib = lib if fused else None
                steps()

            return run

        return {"step": with_lib(True), args.versus: with_lib(False)}
    if args.versus == "length-groups":
        backend = engine.model.backend
        if not isinstance(backend, CppAttentionBackend):
            raise SystemExit("--versus length-groups compares the cpp backend's one decode group with length groups")

        def groups(one: bool) -> Callable[[], None]:
            def run() -> None:
                backend.one_group = one
                steps()

            return run

        return {"step": groups(True), "length-groups": groups(False)}
    if args.versus and args.versus.endswith("-attention"):
        arch, caches = engine.arch, engine.runner.kv_caches
        dtype = engine.config.model.torch_dtype
        other = get_attention_backend(args.versus.removesuffix("-attention"), dtype)
        other.warmup(caches[0], arch.num_heads, dtype, arch.head_dim**-0.5)
        users: list[Any] = [m for m in engine.model.modules() if hasattr(m, "backend")]  # the model, its layers
        mine: AttentionBackend = users[0].backend

        def use(backend: AttentionBackend) -> Callable[[], None]:
            def run() -> None:
                for m in users:
                    m.backend = backend
                steps()

            return run

        return {"step": use(mine), args.versus: use(other)}
    return {"step": steps}


if __name__ == "__main__":
    main()
