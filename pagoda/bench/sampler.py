"""Time the sampler on one decode step's logits: random rows (normal logits times --scale) over the default
model's vocabulary at --temperature, with --top-k, --top-p and --min-p if given, with the torch code
(`sampler_ms`) and with the C++ pass the engine enables (`fused_sampler_ms`); and the torch code's inverse-CDF
search alone, two-level (what it does) against one float64 cumulative sum over the whole vocabulary (what it did
before).

    python -m pagoda.bench.sampler --rows 128 [--keep-freed-memory] [--temperature 0.7 --top-p 0.9 --scale 3]
        [--repetition-penalty 1.1 [--prompt-len 64 --output-len 16] [--convert-ids]]

Normal logits times 3 at temperature 1 put 0.9 of the mass on ~2,000 of 49,152 tokens; times 12, on a few.
--from-model takes the default model's logits instead (Q4_1): those of its 20th step sampling all of --rows prompts of
64 random token ids (the throughput benchmark's kind of prompt) at --temperature (default 1.0); at 0.7 their nuclei
of 0.9 held 2 to ~1,800 tokens.

--keep-freed-memory applies the engine's glibc setting (pagoda/worker/host_memory.py) first; without
it glibc keeps its defaults, as in a process that is not an engine. Prints one JSON line: median
milliseconds per call of --iters.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from pagoda.bench.common import machine_info
from pagoda.layers.sampler import Sampler, SamplingRow, UniformStream, _inverse_cdf
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.worker.host_memory import keep_freed_memory


def _median_ms(f: Callable[[], object], iters: int) -> float:
    f()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _full_cumsum_search(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    ids = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True)
    return torch.minimum(ids, torch.searchsorted(cdf, total)).squeeze(1)


def _model_logits(rows: int, params: SamplingParams) -> torch.Tensor:
    """The logits of the default model's 20th step that samples all of `rows` prompts of 64 random token ids."""
    from pagoda import LLM

    steps: list[torch.Tensor] = []
    call = Sampler.__call__

    def keep(self: Sampler, logits: torch.Tensor, sampling_rows: list[SamplingRow]) -> Any:
        if logits.shape[0] == rows:
            steps.append(logits.clone())
        return call(self, logits, sampling_rows)

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(64)] for _ in range(rows)]
    Sampler.__call__ = keep  # type: ignore[method-assign,assignment]
    try:
        LLM(quantization="q4_1", max_num_seqs=rows).generate(
            prompts, replace(params, max_tokens=40, ignore_eos=True), use_tqdm=False)
    finally:
        Sampler.__call__ = call  # type: ignore[method-assign]
    return steps[19]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--keep-freed-memory", action="store_true")
    p.add_argument("--scale", type=float, default=3.0, help="the logits' standard deviation")
    p.add_argument("--from-model", action="store_true", help="the default model's logits (above)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="over each row's prompt and output tokens (random ids)")
    p.add_argument("--prompt-len", type=int, default=64, help="each row's prompt tokens (random ids)")
    p.add_argument("--output-len", type=int, default=16, help="each row's output tokens so far (random ids)")
    p.add_argument("--convert-ids", action="store_true",
                   help="rows without their request's kept token array (SamplingRow.token_array): the C++ pass's "
                        "penalties convert each row's prompt and outputs each step, as before it was kept")
    args = p.parse_args(argv)
    kept = keep_freed_memory() if args.keep_freed_memory else False
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty)
    logits = _model_logits(args.rows, params) if args.from_model else torch.randn(args.rows, args.vocab, generator=g)
    if not args.from_model:
        logits *= args.scale
    vocab = logits.shape[1]
    seen = torch.randint(vocab, (args.rows, args.prompt_len + args.output_len), generator=g).tolist()
    reqs = [Request(str(i), seen[i][:args.prompt_len], params, frozenset(), len(seen[i]) + 1)
            for i in range(args.rows)]
    for r, ids in zip(reqs, seen, strict=True):
        r.output_token_ids = ids[args.prompt_len:]
    rows = [SamplingRow(params, UniformStream(torch.Generator().manual_seed(i)), r.prompt_token_ids,
                        r.output_token_ids, frozenset(), None if args.convert_ids else r.token_array)
            for i, r in enumerate(reqs)]
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()
    u = torch.rand(args.rows, dtype=torch.float64, generator=g)
    if not torch.equal(_inverse_cdf(weights, u), _full_cumsum_search(weights, u)):  # rounding: should not happen
        print("note: the two searches picked different ids for some rows (rounding at a boundary)")
    sampler, fused = Sampler(), Sampler()
    fused.enable_fused()
    print(json.dumps({
        "rows": args.rows, "vocab": vocab, "keeps_freed_memory": kept,
        "logits": "default model" if args.from_model else f"normal x {args.scale}",
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "kept_token_array": not args.convert_ids,
        "sampler_ms": round(_median_ms(lambda: sampler(logits, rows), args.iters), 2),
        "fused_sampler_ms": round(_median_ms(lambda: fused(logits, rows), args.iters), 2) if fused.lib else None,
        "two_level_search_ms": round(_median_ms(lambda: _inverse_cdf(weights, u), args.iters), 2),
        "full_float64_cumsum_search_ms": round(_median_ms(lambda: _full_cumsum_search(weights, u), args.iters), 2),
        "machine": machine_info()}))


if __name__ == "__main__":
    main()
