"""`pagoda bench throughput`: offline whole-engine throughput on a benchmark workload.

All requests arrive at once; each generates exactly --output-len tokens (ignore_eos). Reports
requests/s, output tokens/s, total (prompt + output) tokens/s, and time to first token
(from arrival, so it includes queueing) with percentiles.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from pagoda.bench.datasets import DATASETS, WorkloadSpec, make_workload
from pagoda.sampling_params import SamplingParams


def parse_range(value: str) -> tuple[int, int]:
    """'128:512' -> (128, 512); '256' -> (256, 256)."""
    try:
        parts = [int(x) for x in value.split(":")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {value!r}") from None
    lo, hi = (parts[0], parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    if len(parts) > 2 or not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX with 1 <= MIN <= MAX, got {value!r}")
    return lo, hi


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p90": qs[89], "p99": qs[98]}


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(dataset=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
                        output_len=args.output_len, prefix_len=args.prefix_len, path=args.dataset_path,
                        seed=args.seed)


def run_throughput(args: argparse.Namespace, engine_options: dict[str, Any]) -> dict[str, Any]:
    from pagoda.entrypoints.llm import LLM

    llm = LLM(**engine_options)
    tok = llm.get_tokenizer()
    work = make_workload(workload_spec(args), llm.engine.arch.vocab_size, tok.all_special_ids)
    prompts = [w.prompt for w in work]
    params = [SamplingParams(temperature=1.0, seed=args.seed + i, max_tokens=w.output_len, ignore_eos=True)
              for i, w in enumerate(work)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.json)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs
            if o.metrics and o.metrics.first_token_time is not None]
    metrics = llm.get_metrics()
    return {
        "backend": "pagoda", "model": engine_options["model"], "dataset": args.dataset,
        "num_requests": len(prompts), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "requests_per_second": len(prompts) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "total_tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "ttft_s": percentiles(ttft),
        "prompt_tokens_computed": metrics["num_prompt_tokens_computed"],
        "prefix_cache_hit_tokens": metrics["prefix_cache_hits"],
        "num_preemptions": metrics["num_preemptions"],
    }


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", default=None, help="JSONL of prompts (file) or ShareGPT JSON (sharegpt)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=parse_range, default=(128, 512),
                   help="N or MIN:MAX (uniform); for `prefix`, the length after the shared prefix")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared prefix length (dataset prefix)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (ignore_eos)")
    p.add_argument("--seed", type=int, default=0)


def add_parser(sub: Any, add_engine_flags: Any) -> None:
    p = sub.add_parser("throughput", help="offline throughput of the whole engine")
    add_workload_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_flags(p)


def report(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    print(f"{result['num_requests']} requests ({result['prompt_tokens']} prompt + {result['output_tokens']} "
          f"output tokens) in {result['elapsed_s']:.2f} s")
    print(f"  {result['requests_per_second']:.2f} requests/s, {result['output_tokens_per_second']:.1f} output "
          f"tokens/s, {result['total_tokens_per_second']:.1f} total tokens/s")
    t = result["ttft_s"]
    if t:
        print(f"  TTFT mean {t['mean']:.2f} s, median {t['median']:.2f} s, p99 {t['p99']:.2f} s")
    print(f"  prompt tokens computed {result['prompt_tokens_computed']}, prefix-cache hits "
          f"{result['prefix_cache_hit_tokens']} tokens, preemptions {result['num_preemptions']}")
