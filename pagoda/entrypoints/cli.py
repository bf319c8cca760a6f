"""The `pagoda` command: generate, chat, kv-calc."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pagoda.config import ATTENTION_BACKENDS, DEFAULT_MODEL, DTYPES, KV_CACHE_DTYPES, parse_size
from pagoda.sampling_params import SamplingParams

ENGINE_FLAGS = ("model", "dtype", "block_size", "kv_cache_memory", "max_num_batched_tokens", "max_num_seqs",
                "max_model_len", "enable_prefix_caching", "kv_cache_dtype", "kv_offload_memory", "attention_backend")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help="alias, HF folder or .gguf file (default: %(default)s)")
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="auto = float32 on CPU")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV cache budget, bytes or a size like 512MiB (default: 20%% of free RAM, at most 4GiB)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto = the model dtype; int8 or fp8 (e4m3) with a float16 scale "
                        "per (token, kv head)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--attention-backend", default="sdpa", choices=ATTENTION_BACKENDS,
                   help="sdpa: torch's fused attention; torch: the plain reference implementation")
    g.add_argument("--kv-offload-memory", default=None,
                   help="second KV tier: host memory for cached blocks evicted from the cache, e.g. 2GiB")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn automatic prefix caching off (on by default)")


def add_sampling_flags(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--n", type=int, default=1, help="samples per prompt")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ENGINE_FLAGS}


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n, max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, ignore_eos=args.ignore_eos)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                if line.lstrip().startswith("{"):
                    obj = json.loads(line)
                    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                        raise ValueError(f"{args.prompts_file}:{lineno}: a JSON line needs a string 'prompt' field")
                    prompts.append(obj["prompt"])
                else:
                    prompts.append(line)
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompts-file")
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from pagoda.entrypoints.llm import LLM

    prompts = read_prompts(args)
    params = sampling_params(args)
    llm = LLM(**engine_options(args))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=not args.json)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=not args.json)
    for prompt, out in zip(prompts, outputs, strict=True):
        if args.json:
            for c in out.outputs:
                print(json.dumps({"prompt": prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                                  "finish_reason": c.finish_reason, "num_prompt_tokens": len(out.prompt_token_ids),
                                  "num_cached_tokens": out.num_cached_tokens}, ensure_ascii=False))
        else:
            print(f"### prompt: {prompt}")
            for c in out.outputs:
                print(c.text)
                print(f"### [{c.finish_reason}, {len(c.token_ids)} tokens]")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagoda.entrypoints.llm import LLM

    llm = LLM(**engine_options(args))
    engine, tok = llm.engine, llm.get_tokenizer()
    params = sampling_params(args)
    history: list[dict[str, str]] = []
    print("pagoda chat: type a message; /reset clears the history; Ctrl-D quits.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return 0
        if line.strip() == "/reset":
            history = []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        ids = tok.encode(tok.apply_chat_template(history), add_special_tokens=False)
        rid, shown, text = f"chat-{turn}", 0, ""
        turn += 1
        engine.add_request(rid, ids, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text
                print(text[shown:], end="", flush=True)
                shown = len(text)
        print()
        history.append({"role": "assistant", "content": text})


def cmd_kv_calc(args: argparse.Namespace) -> int:
    from pagoda.config import ModelConfig
    from pagoda.layers.kv_quant import SCALE_BYTES
    from pagoda.model.loader import load_arch
    from pagoda.worker.kv_cache import default_kv_cache_memory, plan_kv_cache

    arch = load_arch(args.model)
    dtype = ModelConfig(dtype=args.dtype).torch_dtype
    budget = parse_size(args.kv_cache_memory) if args.kv_cache_memory else default_kv_cache_memory()
    plan = plan_kv_cache(arch, dtype, args.block_size, budget, args.kv_cache_dtype)
    contexts = args.context_len or [arch.max_position_embeddings]
    scale_bytes_per_token = plan.scale_bytes_per_block / plan.block_size
    result = {
        "model": args.model, "dtype": str(dtype).removeprefix("torch."), "kv_cache_dtype": args.kv_cache_dtype,
        "kv_cache_storage": plan.spec.name,
        "num_layers": arch.num_layers, "num_kv_heads": arch.num_kv_heads, "num_heads": arch.num_heads,
        "head_dim": arch.head_dim, "bytes_per_element": plan.spec.element_bytes,
        "scale_bytes_per_token": int(scale_bytes_per_token) if scale_bytes_per_token.is_integer()
        else scale_bytes_per_token,
        "bytes_per_token": plan.bytes_per_token, "block_size": plan.block_size,
        "bytes_per_block": plan.bytes_per_block, "budget_bytes": plan.budget_bytes,
        "num_blocks": plan.num_blocks, "num_tokens": plan.num_tokens,
        "max_concurrency": {str(c): int(plan.max_concurrency(c)) for c in contexts},
    }
    if args.json:
        print(json.dumps(result))
        return 0
    per_head = f"{arch.head_dim} head_dim x {plan.spec.element_bytes} bytes"
    if plan.spec.quantized:  # a float16 scale per (token, kv head)
        per_head = f"({per_head} + {SCALE_BYTES} scale bytes)"
    print(f"{args.model}: {arch.num_layers} layers x 2 (K,V) x {arch.num_kv_heads} kv heads x {per_head} "
          f"= {plan.bytes_per_token} bytes/token (KV cache {plan.spec.name})")
    print(f"block of {plan.block_size} tokens: {plan.bytes_per_block} bytes")
    print(f"budget {plan.budget_bytes / 2**20:.1f} MiB: {plan.num_blocks} blocks, {plan.num_tokens} tokens")
    for c in contexts:
        print(f"max concurrent sequences at {c} tokens: {int(plan.max_concurrency(c))}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "serve":  # a client: no engine here, so no engine flags
        from pagoda.bench import serve

        serve.report(serve.run_bench_serve(args), args.json)
    elif args.bench == "latency":
        from pagoda.bench import latency

        latency.report(latency.run_latency(args, engine_options(args)), args.json)
    else:
        from pagoda.bench import throughput

        throughput.report(throughput.run(args, engine_options(args)), args.json)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from pagoda.config import EngineConfig
    from pagoda.engine.async_engine import AsyncEngine
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.entrypoints.openai.api_server import run_server

    # A key on the command line shows in `ps`: PAGODA_API_KEY is the safer way to pass one.
    keys = args.api_key or ([os.environ["PAGODA_API_KEY"]] if os.environ.get("PAGODA_API_KEY") else [])
    names = args.served_model_name or [args.model]
    engine = AsyncEngine(LLMEngine(EngineConfig.from_options(**engine_options(args))), names[0],
                         max_queued_requests=args.max_queued_requests)
    run_server(engine, host=args.host, port=args.port, served_model_names=names, api_keys=keys,
               shutdown_timeout=args.shutdown_timeout)
    return 0


def add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", action="append", help="model name clients use (repeatable; "
                       "default: --model)")
    serve.add_argument("--api-key", action="append", help="require this bearer key on every route but /health "
                       "(repeatable: each key is a tenant for fair sharing; default: $PAGODA_API_KEY)")
    serve.add_argument("--max-queued-requests", type=int, default=1024,
                       help="admitted requests not yet started; more are refused with 429")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests may run after SIGTERM before they are aborted")
    add_engine_flags(serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", help="one prompt per line, or JSONL with a 'prompt' field")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt (per sample) per line")
    add_engine_flags(gen)
    add_sampling_flags(gen, max_tokens=128)
    chat = sub.add_parser("chat", help="interactive chat with streaming output")
    add_engine_flags(chat)
    add_sampling_flags(chat, max_tokens=512)
    kv = sub.add_parser("kv-calc", help="KV cache capacity for a model and a memory budget")
    kv.add_argument("--model", default=DEFAULT_MODEL)
    kv.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    kv.add_argument("--block-size", type=int, default=16)
    kv.add_argument("--kv-cache-memory", default=None, help="budget, e.g. 512MiB (default: as the engine)")
    kv.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="auto = the model dtype; int8 or fp8 with float16 scales")
    kv.add_argument("--context-len", type=int, action="append", help="context length (repeatable)")
    kv.add_argument("--json", action="store_true")
    add_serve_parser(sub)
    from pagoda.bench import latency, serve, throughput

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    throughput.add_parser(bench, add_engine_flags)
    latency.add_parser(bench, add_engine_flags)
    serve.add_parser(bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    commands = {"generate": cmd_generate, "chat": cmd_chat, "kv-calc": cmd_kv_calc, "bench": cmd_bench,
                "serve": cmd_serve}
    try:
        return commands[args.command](args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
