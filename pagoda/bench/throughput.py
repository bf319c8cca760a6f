"""`pagoda bench throughput`: offline whole-engine throughput on a synthetic workload.

Workload `random`: --num-prompts prompts of uniformly random length in --input-len MIN:MAX, made of
random token ids (ids of special tokens excluded), each generating exactly --output-len tokens
(ignore_eos). Reports requests/s, output tokens/s and total (prompt + output) tokens/s.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

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


def random_prompts(num: int, input_len: tuple[int, int], vocab_size: int, special: frozenset[int],
                   seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ordinary = [t for t in range(vocab_size) if t not in special]
    return [[rng.choice(ordinary) for _ in range(rng.randint(*input_len))] for _ in range(num)]


def run_throughput(args: argparse.Namespace, engine_options: dict[str, Any]) -> dict[str, Any]:
    from pagoda.entrypoints.llm import LLM

    llm = LLM(**engine_options)
    tok = llm.get_tokenizer()
    prompts = random_prompts(args.num_prompts, args.input_len, llm.engine.arch.vocab_size,
                             tok.all_special_ids, args.seed)
    params = SamplingParams(temperature=1.0, seed=args.seed, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.json)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "backend": "pagoda",
        "model": engine_options["model"],
        "num_requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "requests_per_second": len(prompts) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "total_tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "num_preemptions": llm.get_metrics()["num_preemptions"],
    }


def add_parser(sub: Any, add_engine_flags: Any) -> None:
    p = sub.add_parser("throughput", help="offline throughput of the whole engine")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=parse_range, default=(128, 512), help="N or MIN:MAX (uniform)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (ignore_eos)")
    p.add_argument("--seed", type=int, default=0)
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
