"""`pagoda bench throughput --backend llamacpp`: llama.cpp as the peer, through llama-cpp-python.

Optional: llama-cpp-python compiles llama.cpp when installed (minutes), so nothing else imports it.
It runs the same workload (the same token ids: the GGUF's tokenizer is the one Pagoda reads) the
way llama-server serves parallel requests: --llamacpp-parallel sequence slots in one context,
continuous batching (a finished slot takes the next request at once), and every llama_decode call
carries one decode token per generating slot plus prompt chunks, up to --llamacpp-batch tokens.
Sampling is plain temperature-1 sampling, as in the pagoda backend; ignore_eos: end-of-generation
tokens are kept and generation goes on to exactly output_len tokens.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pagoda.bench.hf_backend import token_id_workload

LLAMA_CPP_VERSION = "0.3.36"  # the llama-cpp-python release this was written against


def import_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise ValueError(
            "--backend llamacpp needs llama-cpp-python, which builds llama.cpp from source when installed "
            f"(several minutes): .venv/bin/pip install llama-cpp-python=={LLAMA_CPP_VERSION}  "
            "(for a native CPU build: CMAKE_ARGS=\"-DGGML_NATIVE=ON\")") from None
    return llama_cpp


@dataclass
class _Slot:
    """One llama.cpp sequence id and the request it is running (req < 0: free)."""

    seq: int
    req: int = -1
    prompt: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens already decoded into the KV cache
    generated: int = 0
    target: int = 0
    last_token: int = 0
    row: int = -1  # the row of the current batch whose logits this slot samples from, -1 if none


class _Batch:
    """A llama_batch filled token by token (one sequence id per token)."""

    def __init__(self, lib: Any, capacity: int) -> None:
        self.lib, self.capacity = lib, capacity
        self.raw = lib.llama_batch_init(capacity, 0, 1)
        self.raw.n_tokens = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        i = self.raw.n_tokens
        self.raw.token[i], self.raw.pos[i], self.raw.n_seq_id[i] = token, pos, 1
        self.raw.seq_id[i][0] = seq
        self.raw.logits[i] = 1 if logits else 0
        self.raw.n_tokens = i + 1
        return i

    @property
    def size(self) -> int:
        return int(self.raw.n_tokens)

    def free(self) -> None:
        self.lib.llama_batch_free(self.raw)


def _open(lib: Any, path: str, n_parallel: int, seq_len: int, n_batch: int, threads: int) -> tuple[Any, Any]:
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(path.encode(), lib.llama_model_default_params())
    if not model:
        raise ValueError(f"llama.cpp could not load {path}")
    params = lib.llama_context_default_params()
    params.n_seq_max = n_parallel
    params.n_ctx = n_parallel * seq_len  # split evenly between the sequences (kv_unified off)
    params.kv_unified = False  # faster when sequences share no prefix, as llama.cpp's header advises
    params.n_batch = params.n_ubatch = n_batch
    params.n_threads = params.n_threads_batch = threads
    ctx = lib.llama_init_from_model(model, params)
    if not ctx:
        lib.llama_model_free(model)
        raise ValueError("llama.cpp could not create a context; lower --llamacpp-parallel")
    return model, ctx


def _fill(batch: _Batch, slots: list[_Slot]) -> None:
    """Decode tokens first (one per generating slot), then prompt chunks in the room left."""
    for s in slots:
        s.row = -1
        if s.req >= 0 and s.generated:
            s.row = batch.add(s.last_token, len(s.prompt) + s.generated - 1, s.seq, True)
    for s in slots:
        room = batch.capacity - batch.size
        if s.req < 0 or s.prefilled == len(s.prompt) or room == 0:
            continue
        end = min(len(s.prompt), s.prefilled + room)
        for pos in range(s.prefilled, end):
            batch.add(s.prompt[pos], pos, s.seq, pos == len(s.prompt) - 1)
        s.prefilled = end
        if end == len(s.prompt):  # the prompt's last token: its logits give the first output token
            s.row = batch.size - 1


def _run(lib: Any, ctx: Any, prompts: list[list[int]], output_lens: list[int], n_parallel: int, n_batch: int,
         seed: int) -> tuple[float, list[float], int]:
    """Continuous batching over the slots; returns elapsed seconds, TTFTs and output tokens."""
    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed))
    memory = lib.llama_get_memory(ctx)
    batch = _Batch(lib, n_batch)
    slots = [_Slot(seq=i) for i in range(n_parallel)]
    pending = deque(range(len(prompts)))
    ttft: list[float] = []
    output_tokens = 0
    try:
        start = time.perf_counter()
        while pending or any(s.req >= 0 for s in slots):
            for s in slots:
                if s.req < 0 and pending:
                    lib.llama_memory_seq_rm(memory, s.seq, -1, -1)  # the previous request's KV
                    req = pending.popleft()
                    s.req, s.prompt, s.prefilled, s.generated, s.target = req, prompts[req], 0, 0, output_lens[req]
            batch.raw.n_tokens = 0
            _fill(batch, slots)
            rc = lib.llama_decode(ctx, batch.raw)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with {rc}")
            # One sampler for all rows: llama.cpp wants them sampled in output (row) order.
            for s in sorted((s for s in slots if s.row >= 0), key=lambda s: s.row):
                s.last_token = lib.llama_sampler_sample(chain, ctx, s.row)
                s.generated += 1
                if s.generated == 1:
                    ttft.append(time.perf_counter() - start)
                if s.generated == s.target:
                    output_tokens += s.target
                    s.req = -1
        elapsed = time.perf_counter() - start
    finally:
        batch.free()
        lib.llama_sampler_free(chain)
    return elapsed, ttft, output_tokens


def run_llamacpp_throughput(args: argparse.Namespace, model: str) -> dict[str, Any]:
    from pagoda.bench.throughput import summarize
    from pagoda.model.loader import resolve_model_path

    lib = import_llama_cpp()
    path = resolve_model_path(model)
    if path.suffix != ".gguf":
        raise ValueError(f"--backend llamacpp needs a GGUF model (alias or .gguf file), got {model!r}")
    n_parallel, n_batch = args.llamacpp_parallel, args.llamacpp_batch
    if not 1 <= n_parallel <= lib.llama_max_parallel_sequences():
        raise ValueError(f"--llamacpp-parallel must be in [1, {lib.llama_max_parallel_sequences()}], got {n_parallel}")
    if n_batch < n_parallel:  # every generating slot puts one token in each batch
        raise ValueError(f"--llamacpp-batch ({n_batch}) must be >= --llamacpp-parallel ({n_parallel})")
    prompts, output_lens, _ = token_id_workload(args, model)
    seq_len = max(len(p) + n for p, n in zip(prompts, output_lens, strict=True))
    threads = args.threads or os.cpu_count() or 1
    llama_model, ctx = _open(lib, str(path), n_parallel, seq_len, n_batch, threads)
    try:
        elapsed, ttft, output_tokens = _run(lib, ctx, prompts, output_lens, n_parallel, n_batch, args.seed)
    finally:
        lib.llama_free(ctx)
        lib.llama_model_free(llama_model)
    result = summarize("llamacpp", args, model, len(prompts), sum(len(p) for p in prompts), output_tokens,
                       elapsed, ttft)
    result.update({"llamacpp_parallel": n_parallel, "llamacpp_batch": n_batch, "threads": threads,
                   "llama_cpp_python": getattr(lib, "__version__", "?")})
    return result

