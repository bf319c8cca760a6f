"""Time the sampler on one decode step's logits: random rows at temperature 1 over the default
model's vocabulary, with the torch code (`sampler_ms`) and with the C++ pass for plain rows that the
engine enables (`fused_sampler_ms`); and the torch code's inverse-CDF search alone, two-level (what it
does) against one float64 cumulative sum over the whole vocabulary (what it did before).

    python -m pagoda.bench.sampler --rows 128 [--keep-freed-memory]

--keep-freed-memory applies the engine's glibc setting (pagoda/worker/host_memory.py) first; without
it glibc keeps its defaults, as in a process that is not an engine. Prints one JSON line: median
milliseconds per call of --iters.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from pagoda.bench.common import machine_info
from pagoda.layers.sampler import Sampler, SamplingRow, UniformStream, _inverse_cdf
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--keep-freed-memory", action="store_true")
    args = p.parse_args(argv)
    kept = keep_freed_memory() if args.keep_freed_memory else False
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=g) * 3
    rows = [SamplingRow(SamplingParams(temperature=1.0), UniformStream(torch.Generator().manual_seed(i)), [1], [],
                        frozenset())
            for i in range(args.rows)]
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()
    u = torch.rand(args.rows, dtype=torch.float64, generator=g)
    if not torch.equal(_inverse_cdf(weights, u), _full_cumsum_search(weights, u)):  # rounding: should not happen
        print("note: the two searches picked different ids for some rows (rounding at a boundary)")
    sampler, fused = Sampler(), Sampler()
    fused.enable_fused()
    print(json.dumps({
        "rows": args.rows, "vocab": args.vocab, "keeps_freed_memory": kept,
        "sampler_ms": round(_median_ms(lambda: sampler(logits, rows), args.iters), 2),
        "fused_sampler_ms": round(_median_ms(lambda: fused(logits, rows), args.iters), 2) if fused.lib else None,
        "two_level_search_ms": round(_median_ms(lambda: _inverse_cdf(weights, u), args.iters), 2),
        "full_float64_cumsum_search_ms": round(_median_ms(lambda: _full_cumsum_search(weights, u), args.iters), 2),
        "machine": machine_info()}))


if __name__ == "__main__":
    main()
