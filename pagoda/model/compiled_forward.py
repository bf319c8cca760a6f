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

One stream decoding is the case where the opaque op costs most relative to the work: its Python and
small ops cost ~180 us a layer more than the same 16-150-token attention inside the graph. So a step
whose only work is one sequence's decode runs a third graph (`compile_one_stream_decode`) with
attention inside it: the caches are the attention modules' buffers, the new K/V go in through
`pagoda::write_kv` (in place, opaque to inductor), and attention is `paged_decode_attention` over the
block table, which inductor fuses into a loop. Its inputs are the slot, the block table and the
context length (`one_stream_decode_inputs`); the table's width is dynamic (at least 2: a masked
padding block keeps torch from specialising on 1). Measured in BENCHMARKS.md: 1.15x on one stream's
step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pagoda.layers.attention import AttentionBackend, AttentionMetadata, PagedKVCache
from pagoda.layers.kv_quant import write_slots


@dataclass
class OneStreamDecode:
    """Inputs of the one-stream decode graph's attention: where the new token's K/V go and what to read."""

    slot: torch.Tensor  # (1,) int64
    block_table: torch.Tensor  # (1, n >= 2) int64
    seq_len: torch.Tensor  # (1,) int64


def one_stream_decode_inputs(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(slot, block table, context length) when the step is one sequence's decode, else None."""
    groups = meta.decode_groups
    if len(groups) != 1 or not groups[0].whole_step or groups[0].rows.shape[0] != 1:
        return None
    table = groups[0].block_tables
    if table.shape[1] == 1:
        table = torch.cat([table, torch.zeros_like(table)], dim=1)  # masked: past seq_len
    torch._dynamo.maybe_mark_dynamic(table, 1)
    return meta.slot_mapping, table, groups[0].seq_lens


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


def _write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
    write_slots(k_cache, slot, k.to(k_cache.dtype))
    write_slots(v_cache, slot, v.to(v_cache.dtype))


# pagoda::write_kv(k_cache, v_cache, slot, k, v): writes k, v (T, Hkv, D) to the caches (num_blocks,
# block_size, Hkv, D) at slot (T,), in place. An opaque op so that inductor writes the caches where they
# are: as an `index_copy_` in the graph, inductor copied a whole layer's cache (70 MB) each step when it
# fused the write with a read. Defined with torch.library.Library rather than custom_op: the call costs
# about half as much (~5 us against ~11 us per call on this project's CPU), and it is made 30 times a step.
_lib = torch.library.Library("pagoda", "FRAGMENT")
_lib.define("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot, Tensor k, Tensor v) -> ()")
_lib.impl("write_kv", _write_kv, "CompositeExplicitAutograd")
torch.library.register_fake("pagoda::write_kv", lambda k_cache, v_cache, slot, k, v: None, lib=_lib)
write_kv = torch.ops.pagoda.write_kv.default


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


def compile_one_stream_decode(forward: Callable[..., torch.Tensor],
                              hidden_size: int) -> tuple[Callable[..., torch.Tensor], float]:
    """Compiles forward(input_ids, positions, slot, block_table, seq_len) -> hidden (1, hidden) for one
    sequence's decode step and runs it once (on slot 0, which a later write overwrites); returns it and
    the seconds that took."""
    # dynamic=None: static shapes except the block table's width, marked dynamic (False would ignore the mark)
    compiled = torch.compile(forward, dynamic=None, fullgraph=True)
    start = time.perf_counter()
    with torch.inference_mode():
        table = torch.zeros((1, 2), dtype=torch.long)
        torch._dynamo.maybe_mark_dynamic(table, 1)
        out = compiled(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                       torch.zeros(1, dtype=torch.long), table, torch.ones(1, dtype=torch.long))
        if out.shape != (1, hidden_size):
            raise RuntimeError(f"compiled one-stream decode returned {tuple(out.shape)}")
    return compiled, time.perf_counter() - start
