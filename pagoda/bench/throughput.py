"""`pagoda bench throughput`: offline throughput of a whole engine on a benchmark workload.

All requests arrive at once; each generates exactly --output-len tokens (ignore_eos). Reports
requests/s, output tokens/s, total (prompt + output) tokens/s, and time to first token
(from arrival, so it includes queueing) with percentiles.

Backends, all on the same workload (the same token ids):
- `pagoda`: this engine (continuous batching, paged KV cache);
- `hf`: HF transformers `generate` on static, left-padded batches (`--hf-batch-size`), the
  baseline the PagedAttention paper beat;
- `llamacpp`: llama.cpp through llama-cpp-python (optional install), see `pagoda/bench/llamacpp.py`.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pagoda.bench.common import add_workload_flags, machine_info, percentiles, process_memory, workload_spec
from pagoda.bench.datasets import make_workload
from pagoda.sampling_params import SamplingParams

BACKENDS = ("pagoda", "hf", "llamacpp")


def summarize(backend: str, args: argparse.Namespace, model: str, num_requests: int, prompt_tokens: int,
              output_tokens: int, elapsed: float, ttft: list[float]) -> dict[str, Any]:
    """The fields every backend reports, computed the same way for all of them."""
    result: dict[str, Any] = {
        "backend": backend, "model": model, "dataset": args.dataset,
        "num_requests": num_requests, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "requests_per_second": num_requests / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "total_tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "ttft_s": percentiles(ttft),
        "machine": machine_info(),
    }
    if num_requests == 1 and ttft:  # one stream: prompt processing, then decode
        result["prompt_tokens_per_second"] = prompt_tokens / ttft[0]
        if output_tokens > 1:
            result["decode_tokens_per_second"] = (output_tokens - 1) / (elapsed - ttft[0])
    return result


def run_throughput(args: argparse.Namespace, engine_options: dict[str, Any]) -> dict[str, Any]:
    from pagoda.entrypoints.llm import LLM

    llm = LLM(**engine_options)
    started = process_memory()  # weights, packed copies, the KV cache's pages touched so far
    tok = llm.get_tokenizer()
    # The id range every backend draws from (load_tokenizer's): ids past the tokenizer's vocabulary
    # (a padded embedding table) would mean nothing to llama.cpp.
    vocab_size = min(llm.engine.arch.vocab_size, tok.vocab_size)
    work = make_workload(workload_spec(args), vocab_size, tok.all_special_ids)
    prompts = [w.prompt for w in work]
    sampling: dict[str, Any] = {name: getattr(args, name, default) for name, default in SAMPLING_FLAGS.items()}
    params = [SamplingParams(**sampling, seed=args.seed + i, max_tokens=w.output_len, ignore_eos=True)
              for i, w in enumerate(work)]
    profiler = llm.engine.enable_profiling() if getattr(args, "profile", False) else None
    llm.engine.track_kv_usage = getattr(args, "kv_usage", False)
    peak_before = matmul_peak(llm.engine.model)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.json)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs
            if o.metrics and o.metrics.first_token_time is not None]
    metrics = llm.get_metrics()
    result = summarize("pagoda", args, engine_options["model"], len(prompts), prompt_tokens, output_tokens,
                       elapsed, ttft)
    result.update({
        "prompt_tokens_computed": metrics["num_prompt_tokens_computed"],
        "prefix_cache_hit_tokens": metrics["prefix_cache_hits"],
        "num_preemptions": metrics["num_preemptions"],
        "num_draft_tokens": metrics["num_draft_tokens"],
        "num_accepted_tokens": metrics["num_accepted_tokens"],
        "num_steps": metrics["num_steps"],
        "attention_backend": llm.engine.attention_backend,
        "kv_cache_storage": llm.engine.limits.kv.spec.name,  # what `auto` resolved to (float16 under quantization)
        "startup_compile_s": llm.engine.compile_seconds,
        "keeps_freed_memory": llm.engine.keeps_freed_memory,
        # resident MiB after start-up and at the end (the KV cache's pages written since), peak over the process
        "memory": {"rss_after_start_mib": started.get("rss_mib"), **process_memory()},
        "engine_options": engine_options,  # the engine flags as given: which dtype, quantization, cache... ran
    })
    result.update(compute_floor(llm.engine.model, prompt_tokens, output_tokens, elapsed,
                                [peak_before, matmul_peak(llm.engine.model)]))
    stats = llm.engine.stats
    if llm.engine.track_kv_usage and stats.kv_slots_held:
        # over all steps: of the KV slots in blocks held by requests, the share holding a token
        result["kv_token_utilization"] = stats.kv_slots_filled / stats.kv_slots_held
    if profiler is not None:
        result["profile"] = profiler.report()
    return result


def matmul_peak(model: Any) -> dict[str, float]:
    """The matmul rate this machine reaches now in the model's dtype, FLOP/s by matmul: the best of 40 timed
    (1024 x hidden) @ (hidden x intermediate) matmuls, the largest linear layer of the model, by F.linear and
    (float32) by oneDNN's matmul on the plain weight and on its packed one, and by the engine's tile kernel
    (layers/f32_tiles.cpp, which its float32 linears use, and its bfloat16 ones where the build has AVX-512),
    alternated call by call. Its dtype is the lm_head's (the
    model's): with --quantization the layers multiply int8 instead, and the rate says what float32 matmuls allow."""
    import torch

    w = torch.randn(model.config.intermediate_size, model.config.hidden_size, dtype=model.lm_head.weight.dtype)
    x = torch.randn(1024, w.shape[1], dtype=w.dtype)
    matmuls = {"f_linear": lambda: torch.nn.functional.linear(x, w)}
    if w.dtype == torch.float32 and torch.backends.mkldnn.is_available():
        matmuls["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        # and on the weight packed as prepack_linears packed it before the tiles: 1.03-1.04x the plain weight's
        # rate on the Zen 4 machine (BENCHMARKS.md)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        matmuls["onednn_packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if w.dtype in (torch.float32, torch.bfloat16):
        from pagoda.layers.linear import _tiles_call, pack_tiles, tiles_library, tiles_take

        try:
            lib = tiles_library()
        except Exception:  # no C++ compiler: the engine's linears are not on it either (prepack_linears)
            lib = None
        if tiles_take(lib, w.dtype):
            tiles = pack_tiles(w, lib.pagoda_f32_tiles_panel())
            tiles_call = _tiles_call(lib, w.shape[0], w.shape[1], w.dtype)
            matmuls["tiles"] = lambda: tiles_call(x, tiles, None)
    best = dict.fromkeys(matmuls, float("inf"))
    for _ in range(40):  # best of many: the peak, not a mean the noisy neighbours drag down; alternated
        for name, matmul in matmuls.items():
            start = time.perf_counter()
            matmul()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: 2.0 * x.shape[0] * w.numel() / t for name, t in best.items()}


def compute_floor(model: Any, prompt_tokens: int, output_tokens: int, elapsed: float,
                  peaks: list[dict[str, float]]) -> dict[str, float]:
    """The run's matmul FLOPs against the best matmul rate (matmul_peak) measured around it: peaks holds one
    measurement from before the run and one from after, and the floor takes the best rate of any matmul at either
    moment, so that it is what this machine's best matmul allows, not the one the engine beat, nor a slow moment
    (on these shared machines one measurement after a run read half the others').

    FLOPs: 2 x (parameters of the decoder's linear layers) per token, prompt or output, plus 2 x hidden x vocab
    for each output token's logits (a prompt's last token gives the first output token). Attention's own FLOPs
    are left out, so the fraction understates the arithmetic done."""
    import torch

    linear = sum(m.in_features * m.out_features for m in model.model.modules() if isinstance(m, torch.nn.Linear))
    logits = model.lm_head.in_features * model.lm_head.out_features
    flops = 2.0 * linear * (prompt_tokens + output_tokens) + 2.0 * logits * output_tokens
    rates = {name: max(p[name] for p in peaks) for name in peaks[0]}
    rate = max(rates.values())
    achieved = flops / elapsed
    return {"matmul_gflop": flops / 1e9, "achieved_gflops": achieved / 1e9, "matmul_peak_gflops": rate / 1e9,
            **{f"matmul_peak_gflops_{name}": r / 1e9 for name, r in rates.items()},
            "matmul_peak_gflops_before_run": max(peaks[0].values()) / 1e9,
            "matmul_peak_gflops_after_run": max(peaks[-1].values()) / 1e9,
            "compute_floor_fraction": achieved / rate}


# The requests' sampling flags (bench throughput's --temperature, --top-p, --repetition-penalty) and the values the
# peers sample with, which they alone take.
SAMPLING_FLAGS = {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0}


def run(args: argparse.Namespace, engine_options: dict[str, Any]) -> dict[str, Any]:
    """Run the chosen backend; engine flags other than --model and --dtype only apply to pagoda."""
    backend = getattr(args, "backend", "pagoda")
    if backend != "pagoda" and any(getattr(args, name, default) != default for name, default in SAMPLING_FLAGS.items()):
        raise ValueError(f"--temperature, --top-p and --repetition-penalty apply to the pagoda backend only ({backend} "
                         "samples at temperature 1, without a filter or penalty)")
    if backend == "pagoda":
        return run_throughput(args, engine_options)
    if backend == "hf":
        from pagoda.bench.hf_backend import run_hf_throughput

        return run_hf_throughput(args, engine_options["model"], engine_options.get("dtype", "auto"))
    if backend == "llamacpp":
        from pagoda.bench.llamacpp import run_llamacpp_throughput

        return run_llamacpp_throughput(args, engine_options["model"])
    raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}; got {backend!r}")


def add_parser(sub: Any, add_engine_flags: Any) -> None:
    p = sub.add_parser("throughput", help="offline throughput of the whole engine (or a peer)")
    add_workload_flags(p)
    p.add_argument("--backend", choices=BACKENDS, default="pagoda",
                   help="pagoda; hf = transformers generate, static batches; llamacpp = llama-cpp-python")
    p.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the hf backend")
    p.add_argument("--llamacpp-parallel", type=int, default=16,
                   help="sequences decoded together by the llamacpp backend (its n_parallel)")
    p.add_argument("--llamacpp-batch", type=int, default=512,
                   help="llamacpp backend: tokens per llama_decode call (its n_batch)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the llamacpp backend (default: all cores)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="pagoda backend: the requests' temperature (default 1, as the peers sample; 0: greedy, "
                        "as speculative decoding's figures in BENCHMARKS.md were taken)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="pagoda backend: the requests' top_p (default 1: no filter)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="pagoda backend: the requests' repetition_penalty (default 1: none)")
    p.add_argument("--profile", action="store_true",
                   help="pagoda backend: break each step's time down by phase and module kind")
    p.add_argument("--kv-usage", action="store_true",
                   help="pagoda backend: after every step, count the KV slots held by requests that hold a "
                        "token (kv_token_utilization); walks every block table each step")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_flags(p)


def report(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    print(f"[{result['backend']}] {result['num_requests']} requests ({result['prompt_tokens']} prompt + "
          f"{result['output_tokens']} output tokens) in {result['elapsed_s']:.2f} s")
    print(f"  {result['requests_per_second']:.2f} requests/s, {result['output_tokens_per_second']:.1f} output "
          f"tokens/s, {result['total_tokens_per_second']:.1f} total tokens/s")
    t = result["ttft_s"]
    if t:
        print(f"  TTFT mean {t['mean']:.2f} s, median {t['median']:.2f} s, p99 {t['p99']:.2f} s")
    if "prompt_tokens_computed" in result:
        print(f"  prompt tokens computed {result['prompt_tokens_computed']}, prefix-cache hits "
              f"{result['prefix_cache_hit_tokens']} tokens, preemptions {result['num_preemptions']}")
    if result.get("num_draft_tokens"):
        print(f"  draft tokens {result['num_draft_tokens']}, accepted {result['num_accepted_tokens']} "
              f"({100 * result['num_accepted_tokens'] / result['num_draft_tokens']:.0f}%)")
    if "compute_floor_fraction" in result:
        print(f"  matmul work {result['achieved_gflops']:.1f} GFLOP/s = {100 * result['compute_floor_fraction']:.0f}% "
              f"of the {result['matmul_peak_gflops']:.1f} GFLOP/s a plain matmul reaches here")
    memory = result.get("memory") or {}
    if memory.get("rss_after_start_mib") is not None:
        print(f"  resident memory {memory['rss_after_start_mib']:.0f} MiB after start-up, {memory['rss_mib']:.0f} MiB "
              f"at the end, peak {memory['peak_rss_mib']:.0f} MiB")
    for name, v in result.get("profile", {}).items():
        print(f"  {name:<34} {v['ms_per_step']:9.2f} ms/step {100 * v['share']:6.1f}%")
