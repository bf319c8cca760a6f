"""`pagoda bench serve`: a load generator for any OpenAI-compatible server (Pagoda, llama.cpp's
llama-server, vLLM), measured the way serving engines are compared.

Requests arrive on a schedule: all at once (`--request-rate inf`) or with gamma-distributed gaps of
mean 1/rate (`--burstiness` 1 = Poisson; below 1 burstier, above 1 more regular), optionally capped
at `--max-concurrency` in flight. Each request streams; the client times the first content chunk
(TTFT), the gaps between chunks (ITL), time per output token after the first (TPOT) and the whole
request (E2E). A comma list of rates runs a sweep, one run per rate, each on fresh prompts (so a
later run is not served from the prefix cache the earlier one filled).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from pagoda.bench.common import add_workload_flags, load_tokenizer, percentiles, workload_spec
from pagoda.bench.datasets import make_workload
from pagoda.bench.serve_client import CHAT_ENDPOINT, RequestResult, RequestSpec, build_body, send_request

if TYPE_CHECKING:  # httpx is imported when a run starts: building the CLI parser must not need it
    import httpx

SLO_KEYS = ("ttft", "tpot", "e2e")


def parse_rates(value: str) -> list[float]:
    """'inf', '4' or a sweep '1,2,4,8' -> request rates (requests/s)."""
    try:
        rates = [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"request rate: expected inf, a number or a comma list, got {value!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be > 0 (or inf), got {value!r}")
    return rates


def parse_slo(value: str) -> dict[str, float]:
    """'ttft=500,tpot=50' -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for item in value.split(","):
        key, sep, ms = item.partition("=")
        key = key.strip()
        try:
            bound = float(ms)
        except ValueError:
            bound = -1.0
        if not sep or key not in SLO_KEYS or not bound > 0:
            raise argparse.ArgumentTypeError(
                f"expected KEY=MS pairs with KEY in {', '.join(SLO_KEYS)} and MS > 0, got {item!r}")
        slo[key] = bound
    return slo


def arrival_offsets(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send times (seconds after the start) of n requests: the first at 0, then gamma-distributed
    gaps with shape=burstiness and mean 1/rate (shape 1 is exponential: a Poisson process)."""
    if math.isinf(rate):
        return [0.0] * n
    scale = 1.0 / (rate * burstiness)
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, scale)
        offsets.append(t)
    return offsets


@dataclass
class Target:
    """Where and how to send requests."""

    client: httpx.AsyncClient
    url: str
    model: str
    endpoint: str
    headers: dict[str, str]
    temperature: float = 0.0


async def run_load(target: Target, specs: list[RequestSpec], offsets: list[float], max_concurrency: int | None,
                   show_progress: bool = False, clock: Callable[[], float] = time.perf_counter
                   ) -> tuple[list[RequestResult], float]:
    """Send every request at its offset (waiting for a free slot under --max-concurrency);
    returns the results in request order and the duration from the first send to the last reply."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(specs), disable=not show_progress, unit="req", desc="requests")

    async def one(spec: RequestSpec) -> RequestResult:
        async with limit if limit else contextlib.nullcontext():
            body = build_body(spec, target.endpoint, target.model, target.temperature)
            result = await send_request(target.client, target.url, body, target.headers, spec.prompt_tokens, clock)
        bar.update(1)
        return result

    start = clock()
    tasks = []
    for spec, offset in zip(specs, offsets, strict=True):
        delay = start + offset - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(spec)))
    results = list(await asyncio.gather(*tasks))
    duration = clock() - start
    bar.close()
    return results, duration


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    values_ms = {"ttft": r.ttft * 1e3, "tpot": (r.tpot or 0.0) * 1e3, "e2e": r.e2e * 1e3}
    return r.success and all(values_ms[k] <= bound for k, bound in slo.items())


def compute_metrics(results: list[RequestResult], duration: float, slo: dict[str, float] | None = None
                    ) -> dict[str, Any]:
    """The run's summary; latencies in milliseconds, throughputs per second of `duration`."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration if duration > 0 else 0.0
    errors = Counter(r.error for r in results if not r.success)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) * per_s, "output_throughput": output_tokens * per_s,
        "total_token_throughput": (input_tokens + output_tokens) * per_s,
        "ttft_ms": percentiles([r.ttft * 1e3 for r in ok]),
        "tpot_ms": percentiles([t * 1e3 for r in ok if (t := r.tpot) is not None]),
        "itl_ms": percentiles([gap * 1e3 for r in ok for gap in r.itl]),
        "e2e_ms": percentiles([r.e2e * 1e3 for r in ok]),
        "slo_ms": slo or {},
        "goodput": sum(meets_slo(r, slo) for r in ok) * per_s if slo else None,
        "errors": dict(errors.most_common(10)),
    }


def request_records(results: list[RequestResult]) -> list[dict[str, Any]]:
    """Per-request rows for --save-result (ITL lists left out: they dominate the size)."""
    return [{"success": r.success, "error": r.error or None, "prompt_tokens": r.prompt_tokens,
             "output_tokens": r.output_tokens, "ttft_ms": r.ttft * 1e3 if r.success else None,
             "tpot_ms": r.tpot * 1e3 if r.tpot is not None else None, "e2e_ms": r.e2e * 1e3} for r in results]


def build_specs(args: argparse.Namespace, total: int) -> list[RequestSpec]:
    """The workload: token ids for random/prefix (made with --tokenizer), text otherwise; the chat
    endpoint only takes text, so token ids are decoded for it."""
    tok, vocab_size = load_tokenizer(args.tokenizer)
    work = make_workload(dataclasses.replace(workload_spec(args), num_prompts=total), vocab_size,
                         tok.all_special_ids)
    specs = []
    for i, w in enumerate(work):
        prompt: list[int] | str = w.prompt
        if args.endpoint == CHAT_ENDPOINT and isinstance(prompt, list):
            prompt = tok.decode(prompt)
        n = len(prompt) if isinstance(prompt, list) else len(tok.encode(prompt))
        specs.append(RequestSpec(prompt, n, w.output_len, args.seed + i))
    return specs


async def first_model_id(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    import httpx

    try:
        response = await client.get(base_url + "/v1/models", headers=headers)
    except httpx.TransportError as e:
        raise ValueError(f"cannot reach {base_url}/v1/models ({e}); is the server running? (--base-url)") from None
    if response.status_code != 200:
        raise ValueError(f"GET {base_url}/v1/models answered {response.status_code}: {response.text[:200]}")
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; give --model")
    return str(models[0]["id"])


async def run_sweep(args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None = None,
                    clock: Callable[[], float] = time.perf_counter) -> list[dict[str, Any]]:
    """One run per request rate; returns each run's metrics (with `results`, the raw per-request
    timings, for plotting; `report`/`save` leave it out of the printed summary)."""
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per request
    rates: list[float] = args.request_rate
    specs = build_specs(args, args.num_prompts * len(rates))
    base_url = args.base_url.rstrip("/")
    key = args.api_key or os.environ.get("PAGODA_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = httpx.Timeout(args.timeout, connect=30.0, pool=None)
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    runs = []
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport, trust_env=False) as client:
        model = args.model or await first_model_id(client, base_url, headers)
        target = Target(client, base_url + args.endpoint, model, args.endpoint, headers, args.temperature)
        for i, rate in enumerate(rates):
            run_specs = specs[i * args.num_prompts:(i + 1) * args.num_prompts]
            offsets = arrival_offsets(len(run_specs), rate, args.burstiness, random.Random(args.seed + i))
            results, duration = await run_load(target, run_specs, offsets, args.max_concurrency,
                                               show_progress=not args.quiet, clock=clock)
            runs.append({"base_url": base_url, "endpoint": args.endpoint, "model": model, "dataset": args.dataset,
                         "num_prompts": len(run_specs), "request_rate": "inf" if math.isinf(rate) else rate,
                         "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                         **compute_metrics(results, duration, args.slo), "results": results})
    return runs


def _fmt_stats(name: str, stats: dict[str, float]) -> list[str]:
    if not stats:
        return [f"{name:<38}{'n/a':>12}"]
    return [f"{label + ' ' + name + ' (ms):':<38}{stats[k]:>12.2f}"
            for label, k in (("Mean", "mean"), ("Median", "median"), ("P90", "p90"), ("P99", "p99"))]


def format_run(run: dict[str, Any]) -> str:
    lines = [f"{' Serving Benchmark Result ':=^50}",
             f"{'Request rate (req/s):':<38}{run['request_rate']!s:>12}",
             f"{'Burstiness:':<38}{run['burstiness']:>12}",
             f"{'Max concurrency:':<38}{run['max_concurrency']!s:>12}",
             f"{'Completed requests:':<38}{run['completed']:>12}",
             f"{'Failed requests:':<38}{run['failed']:>12}",
             f"{'Duration (s):':<38}{run['duration_s']:>12.2f}",
             f"{'Total input tokens:':<38}{run['total_input_tokens']:>12}",
             f"{'Total output tokens:':<38}{run['total_output_tokens']:>12}",
             f"{'Request throughput (req/s):':<38}{run['request_throughput']:>12.2f}",
             f"{'Output token throughput (tok/s):':<38}{run['output_throughput']:>12.2f}",
             f"{'Total token throughput (tok/s):':<38}{run['total_token_throughput']:>12.2f}"]
    if run["goodput"] is not None:
        slo = ", ".join(f"{k}<={v:g}" for k, v in run["slo_ms"].items())
        lines += [f"{'SLO (ms):':<38}{slo:>12}", f"{'Goodput (req/s):':<38}{run['goodput']:>12.2f}"]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        lines += [f"{' ' + name + ' ':-^50}", *_fmt_stats(name, run[key])]
    for error, count in run["errors"].items():
        lines.append(f"error x{count}: {error}")
    lines.append("=" * 50)
    return "\n".join(lines)


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """A run without its raw results (what is printed as JSON and saved at the top level)."""
    return {k: v for k, v in run.items() if k != "results"}


def save_result(runs: list[dict[str, Any]], path: str) -> None:
    """One run: its summary plus per-request rows; a sweep: {"runs": [...]} of those."""
    docs = [{**summary(run), "requests": request_records(run["results"])} for run in runs]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(docs[0] if len(docs) == 1 else {"runs": docs}, f, indent=1)


def run_bench_serve(args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None = None,
                    clock: Callable[[], float] = time.perf_counter) -> list[dict[str, Any]]:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    runs = asyncio.run(run_sweep(args, transport, clock))
    if args.save_result:
        save_result(runs, args.save_result)
    if args.plot:
        from pagoda.bench.serve_plot import plot_runs

        plot_runs(runs, args.plot)
    return runs


def add_parser(sub: Any) -> None:
    from pagoda.config import DEFAULT_MODEL

    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server (pagoda serve, llama-server, vLLM)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", CHAT_ENDPOINT],
                   help="completions takes token-id prompts as they are; chat decodes them to text")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--tokenizer", default=DEFAULT_MODEL,
                   help="model alias/path whose tokenizer makes and counts prompts (default: %(default)s)")
    p.add_argument("--api-key", default=None, help="bearer key (default: $PAGODA_API_KEY)")
    add_workload_flags(p, num_prompts=100)
    p.add_argument("--request-rate", type=parse_rates, default=[math.inf],
                   help="requests/s: inf (all at once), a number, or a sweep like 1,2,4,8 (one run per rate)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times: 1 = Poisson, <1 burstier, >1 steadier")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; above 0, seeded per request")
    p.add_argument("--slo", type=parse_slo, default=None,
                   help="goodput SLOs in ms, e.g. ttft=500,tpot=50 (keys: ttft, tpot, e2e)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for any one read")
    p.add_argument("--save-result", default=None, metavar="FILE.json", help="write the metrics and per-request rows")
    p.add_argument("--plot", default=None, metavar="DIR", help="write latency CDFs (and sweep plots) as PNGs")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print each run's metrics as one JSON line")


def report(runs: list[dict[str, Any]], as_json: bool) -> None:
    for run in runs:
        print(json.dumps(summary(run)) if as_json else format_run(run))
