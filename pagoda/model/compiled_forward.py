"""The model's forward pass compiled whole with torch.compile (inductor), attention left opaque.

Eager PyTorch pays a dispatch per op: a SmolLM2 layer runs ~40 small ops (norms, rotary, residual
adds, SiLU) around its 7 matmuls: 10-14 ms of a 37 ms single-stream step on this project's CPU
(step time less matmul time under the torch profiler, BENCHMARKS.md). Compiled,
inductor fuses each run of elementwise ops into one C++ loop and calls the matmuls directly.

Attention stays outside the graph: its work depends on the step's metadata (decode groups, prompt
chunks, block tables: Python lists that change every step), so tracing it would recompile every step.
It is the custom op `pagoda::paged_attention(q, k, v, layer, scale)`, which the graph calls like a
matmul; at run time the op finds the step's KV caches and metadata in `step_context`, which the model
sets around each compiled call (as vLLM's forward context does). Its output is a fresh tensor; the K/V
it writes to the cache are not graph values, so the graph cannot reorder anything around them.

The number of tokens in a step is a dynamic dimension: torch.compile makes one graph for a single
token (a size of 1 is specialised) and one for any other count, both at start-up (`warmup`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pagoda.layers.attention import AttentionBackend, AttentionMetadata, PagedKVCache


@dataclass
class _StepContext:
    backend: AttentionBackend
    kv_caches: list[PagedKVCache]
    meta: AttentionMetadata


_current: list[_StepContext] = []


@contextlib.contextmanager
def step_context(backend: AttentionBackend, kv_caches: list[PagedKVCache], meta: AttentionMetadata) -> Iterator[None]:
    _current.append(_StepContext(backend, kv_caches, meta))
    try:
        yield
    finally:
        _current.pop()


@torch.library.custom_op("pagoda::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """q (T, Hq, D), k and v (T, Hkv, D) -> (T, Hq, D), through the backend of the current step.

    Outside any step (the start-up warm-up runs the graph once without a cache) it returns zeros.
    """
    if not _current:
        return torch.zeros_like(q)
    ctx = _current[-1]
    return ctx.backend.forward(q, k, v, ctx.kv_caches[layer], ctx.meta, scale)


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


def compile_forward(forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    hidden_size: int) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], float]:
    """Compiles forward(input_ids, positions) -> hidden (T, hidden) and runs it for 1 and 2 tokens, so
    that both graphs exist before the first request; returns it and the seconds that took."""
    # Guards stay on: checking the modules' parameters costs ~0.7 ms per step, but without them
    # (torch.compiler.skip_guard_on_all_nn_modules_unsafe) a second model in the same process, whose
    # forward is the same code, ran the first model's graph (a test caught it).
    compiled = torch.compile(forward, dynamic=True, fullgraph=True)
    start = time.perf_counter()
    with torch.inference_mode():
        for t in (1, 2):
            ids = torch.zeros(t, dtype=torch.long)
            out = compiled(ids, torch.arange(t))
            if out.shape != (t, hidden_size):
                raise RuntimeError(f"compiled forward returned {tuple(out.shape)} for {t} tokens")
    return compiled, time.perf_counter() - start
