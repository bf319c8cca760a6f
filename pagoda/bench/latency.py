"""`pagoda bench latency`: how long one fixed batch takes from submission to its last token.

Each iteration submits --batch-size prompts of exactly --input-len random token ids and runs them
to completion (--output-len tokens each, ignore_eos) through the engine. Every iteration gets
fresh prompts: repeating the same ones would turn the prefill into a prefix-cache hit and measure
the cache instead of the model. Warm-up iterations run first and are not counted.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from pagoda.bench.common import percentiles
from pagoda.sampling_params import SamplingParams


def _check(args: argparse.Namespace) -> None:
    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")


def run_latency(args: argparse.Namespace, engine_options: dict[str, Any]) -> dict[str, Any]:
    from pagoda.entrypoints.llm import LLM

    _check(args)
    llm = LLM(**engine_options)
    special = llm.get_tokenizer().all_special_ids
    ids = [t for t in range(llm.engine.arch.vocab_size) if t not in special]
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    latencies: list[float] = []
    for it in range(args.num_iters_warmup + args.num_iters):
        prompts = [[rng.choice(ids) for _ in range(args.input_len)] for _ in range(args.batch_size)]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if it >= args.num_iters_warmup:
            latencies.append(time.perf_counter() - start)
    stats = percentiles(latencies)
    tokens = args.batch_size * (args.input_len + args.output_len)
    return {
        "backend": "pagoda", "model": engine_options["model"], "batch_size": args.batch_size,
        "input_len": args.input_len, "output_len": args.output_len, "num_iters": args.num_iters,
        "num_iters_warmup": args.num_iters_warmup,
        "avg_latency_s": stats["mean"], "latency_s": stats, "latencies_s": latencies,
        "total_tokens_per_second": tokens / stats["mean"],
        "output_tokens_per_second": args.batch_size * args.output_len / stats["mean"],
        "engine_options": engine_options,
    }


def add_parser(sub: Any, add_engine_flags: Any) -> None:
    p = sub.add_parser("latency", help="latency of one fixed batch, run to completion, over several iterations")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (random ids)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (ignore_eos)")
    p.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    p.add_argument("--num-iters-warmup", type=int, default=2, help="untimed iterations first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_flags(p)


def report(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    s = result["latency_s"]
    print(f"batch {result['batch_size']} x ({result['input_len']} prompt + {result['output_len']} output tokens), "
          f"{result['num_iters']} iterations after {result['num_iters_warmup']} warm-up")
    print(f"  latency mean {s['mean']:.3f} s, p50 {s['median']:.3f} s, p90 {s['p90']:.3f} s, p99 {s['p99']:.3f} s")
    print(f"  {result['output_tokens_per_second']:.1f} output tokens/s, "
          f"{result['total_tokens_per_second']:.1f} total tokens/s")
