"""Attention in a C++ kernel of our own (`cpp_kernel.cpp`), compiled at start-up: every decode, and prompt chunks:
bfloat16 ones, and under --quantization those over a 16-bit cache, in bfloat16 arithmetic where the CPU has it (AMX
tiles, or AVX-512 BF16 dot products; on AMX also those over an int8 cache: `paged_prefill_bf16`), others as
`prefill_in_kernel` picks (the rest go to SDPA's flash kernel).

The kernel reads each sequence's blocks in place through its block table, once per query tile, at close to
memory bandwidth for decodes (the kernel's header says how). It is compiled at start-up
(pagoda/layers/cpp_build.py), one library per cache layout: storage dtype, scale granularity, head shapes and
block size are constants in the source (fully unrolled inner loops).

Covered: caches of float32, bfloat16 or float16, and int8 / fp8 (e4m3) with float16 scales per token or
per block, under float32 / bfloat16 / float16 models, with block_size and head_dim multiples of 16; the
arithmetic is float32. Anything else (float64 models, the token-exact tests' dtype; blocks of 1-8
tokens) is left to the inherited SDPA path (`supports`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagoda.layers.attention.backend import AttentionMetadata, DecodeGroup, PromptChunks
from pagoda.layers.attention.paged_kv import PagedKVCache, is_k_cache_layout, is_scale_layout
from pagoda.layers.attention.sdpa import KernelBackend
from pagoda.layers.cpp_build import load_library

_SOURCE = Path(__file__).with_name("cpp_kernel.cpp")
_ELEM = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.float8_e4m3fn: 4}
_SCALES = {None: 0, "token": 1, "block": 2}
# Work items per thread the kernel is given at least: sequences are cut into spans of blocks until there
# are this many items per thread (few, long sequences), so that the dynamic schedule can balance them. Each
# span starts cold (its first K block is read before any prefetch reaches it): 2 against 4, one q4_1 stream's
# decode steps 1.013-1.026x faster, two streams' 1.024x, three 1.00x (`bench.alternate -- pagoda.bench.decode_step
# --num-seqs 1/2/3 --input-len 256:768 --attention-backend cpp --quantization q4_1`, BENCHMARKS.md); batches of
# 8 or more sequences have one span each either way.
_ITEMS_PER_THREAD = 2
# 1: the kernel prefetches K one block ahead of its reads and V a step (64 tokens) ahead (0: not; cpp_kernel.cpp),
# for caches of elements of at most PREFETCH_MAX_ELEMENT_BYTES. Issued in one burst at the start of a block,
# the prefetches made 128-request decode steps 1.075x faster in bfloat16 and 1.035x with an int8 cache,
# but float32 ones 1.02x slower; spread through the block's work, they make float32 steps 1.01-1.07x
# faster too, and bfloat16 ones 1.15-1.19x (`python -m pagoda.bench.decode_step --versus no-prefetch`,
# BENCHMARKS.md), so every cache is prefetched.
PREFETCH_AHEAD = 1
PREFETCH_MAX_ELEMENT_BYTES = 4
# 2: a step (4 blocks) ahead instead, for these caches' kernels. With integer dot products (AVX-512 VNNI) an int8
# cache's blocks take too little work for one block's lead to cover memory's latency: decode attention over 30
# layers' caches 1.145x faster at 128 sequences, 1.18x at 8, 1.03x at 1; float16 1.04x at 128 but 0.97x at 1,
# bfloat16 1.00x, float32 0.98x, so they keep a block (alternated in one process, BENCHMARKS.md).
PREFETCH_STEP_AHEAD = (torch.int8,)
# Inductor compiles its own kernels (explicitly vectorized) with the loop vectorizer off and without
# fused multiply-adds; this kernel relies on the compiler vectorizing its loops, and FMAs are fine.
_FLAGS = ("-ftree-loop-vectorize", "-ffp-contract=fast")


@functools.cache
def _library(elem: int, scales: int, hkv: int, group: int, head_dim: int, block_size: int,
             portable: bool = False, prefetch_ahead: int = 1, rev: str | None = None) -> Any:
    defines = dict(HKV=hkv, G=group, D=head_dim, BS=block_size, ELEM=elem, SCALES=scales,
                   PREFETCH_AHEAD=prefetch_ahead)
    defines |= {"PORTABLE": 1} if portable else {}
    lib = load_library(_SOURCE, defines, _FLAGS, rev)
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    signatures = {"pagoda_paged_decode_rows": [ptr, i64] + [ptr] * 9 + [i64] * 3 + [f32],
                  "pagoda_paged_prefill": [ptr] * 7 + [i64] * 2 + [ptr, f32],
                  "pagoda_write_kv_rows": [ptr] * 6 + [i64, ptr, i64]}
    if hasattr(lib, "pagoda_paged_prefill_chunks"):  # a revision before it (--versus-rev) lacks it
        signatures["pagoda_paged_prefill_chunks"] = [ptr, i64] + [ptr] * 10 + [i64, ptr, f32]
    if hasattr(lib, "pagoda_write_kv_f32"):  # bfloat16 and float16 caches, int8 ones with a scale per token
        signatures["pagoda_write_kv_f32"] = [ptr] * 6 + [i64, ptr, i64]
    if rev is not None and hasattr(lib, "pagoda_paged_decode"):  # revisions before pagoda_paged_decode_rows
        signatures["pagoda_paged_decode"] = [ptr] * 10 + [i64] * 3 + [f32]
    if hasattr(lib, "pagoda_paged_prefill_bf16"):  # where the compiler targets AVX-512 BF16: 16-bit, int8 per token
        signatures["pagoda_paged_prefill_bf16"] = [ptr, i64, i64] + [ptr] * 5 + [i64] * 2 + [ptr, ptr, f32]
    if hasattr(lib, "pagoda_amx_init"):  # and AMX: the same kernel on the tiles
        lib.pagoda_amx_init.restype = ctypes.c_int
    if hasattr(lib, "pagoda_paged_prefill_bf16_chunks"):
        signatures["pagoda_paged_prefill_bf16_chunks"] = [ptr, i64, i64] + [ptr] * 9 + [i64, ptr, ptr, f32]
    if hasattr(lib, "pagoda_int8_dot"):
        lib.pagoda_int8_dot.restype, lib.pagoda_int8_dot.argtypes = ctypes.c_int, []
    for name, argtypes in signatures.items():
        if rev is None or hasattr(lib, name):  # an older revision (decode --versus-rev) may lack the prefill
            getattr(lib, name).restype, getattr(lib, name).argtypes = None, argtypes
    return lib


def _library_args(kv_cache: PagedKVCache, num_q_heads: int, portable: bool = False) -> tuple[Any, ...]:
    """_library's arguments for this cache layout; the last is the prefetch distance (rev is left out)."""
    _, block_size, hkv, d = kv_cache.k.shape
    return (_ELEM[kv_cache.k.dtype], _SCALES[kv_cache.spec.scale_granularity], hkv, num_q_heads // hkv, d, block_size,
            portable, _prefetch_ahead(kv_cache.k.dtype))


def _prefetch_ahead(dtype: torch.dtype) -> int:
    """The kernel's PAGODA_PREFETCH_AHEAD for a cache of dtype (above)."""
    if dtype.itemsize > PREFETCH_MAX_ELEMENT_BYTES or PREFETCH_AHEAD == 0:
        return 0
    return 2 if dtype in PREFETCH_STEP_AHEAD else PREFETCH_AHEAD


def _library_for(kv_cache: PagedKVCache, num_q_heads: int, portable: bool = False, rev: str | None = None) -> Any:
    """The kernels for this cache layout; rev: as of that git revision (the benchmarks' --versus-rev)."""
    return _library(*_library_args(kv_cache, num_q_heads, portable), rev=rev)


def int8_dot(kv_cache: PagedKVCache, num_q_heads: int) -> bool:
    """Whether the kernel takes this (int8) cache's scores by integer dot products, the queries rounded to 16-bit
    fixed point (cpp_kernel.cpp, Int8Queries): where the compiler targets AVX-512 VNNI and VBMI."""
    return bool(_library_for(kv_cache, num_q_heads).pagoda_int8_dot())


def writes_in_kernel(kv_cache: PagedKVCache) -> bool:
    """Whether `write_kv` takes this cache: one without scales, or int8 with a scale per token (fp8 and per-block
    scales are written by torch code, `PagedKVCache.write`)."""
    spec = kv_cache.spec
    return not spec.quantized or (spec.storage_dtype == torch.int8 and spec.scale_granularity == "token")


def write_kv(kv_cache: PagedKVCache, num_q_heads: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """PagedKVCache.write in one pass, for a cache `writes_in_kernel` takes: k, v (T, Hkv, D) to slots (T,). Rows
    that are each one run of Hkv * D values, k's and v's the same stride apart (views into the fused q/k/v
    projection's output), are read in place, others made contiguous first; values in the cache's dtype are copied,
    float32 ones rounded to a 16-bit cache's dtype or quantized to an int8 one by the kernel (pagoda_write_kv_f32,
    to the bits `kv_quant.write_token_scaled` writes), others converted by torch first (to float32 for int8)."""
    assert writes_in_kernel(kv_cache), kv_cache.spec
    lib = _library_for(kv_cache, num_q_heads)
    same = k.dtype == v.dtype == kv_cache.k.dtype
    if kv_cache.spec.quantized:
        k, v = k.float(), v.float()  # exact from a 16-bit model's values
    elif not same and not (k.dtype == v.dtype == torch.float32 and hasattr(lib, "pagoda_write_kv_f32")):
        k, v, same = k.to(kv_cache.k.dtype), v.to(kv_cache.v.dtype), True
    if not (k.stride() == v.stride() and k.stride()[1:] == (k.shape[2], 1)):
        k, v = k.contiguous(), v.contiguous()
    slots = slots.contiguous()
    write = lib.pagoda_write_kv_rows if same else lib.pagoda_write_kv_f32
    ks, vs = (None if t is None else t.data_ptr() for t in (kv_cache.k_scale, kv_cache.v_scale))
    write(kv_cache.k.data_ptr(), kv_cache.v.data_ptr(), ks, vs, k.data_ptr(), v.data_ptr(), k.stride(0),
          slots.data_ptr(), slots.numel())


@functools.cache
def _fp8_table() -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def supports(kv_cache: PagedKVCache, q_dtype: torch.dtype) -> bool:
    """The kernel's cases: float32/bfloat16/float16 queries; a cache as `allocate_kv_cache` lays it out
    (K and per-token scales with the tokens innermost, V and per-block scales contiguous), of a storage dtype in _ELEM;
    block_size and head_dim multiples of 16 (one vector of float32 lanes)."""
    _, block_size, _, head_dim = kv_cache.k.shape
    granularity = kv_cache.spec.scale_granularity
    scales_laid_out = all(t is None or is_scale_layout(t, granularity) for t in (kv_cache.k_scale, kv_cache.v_scale))
    return (q_dtype in (torch.float32, torch.bfloat16, torch.float16) and kv_cache.k.dtype in _ELEM
            and block_size % 16 == 0 and head_dim % 16 == 0
            and is_k_cache_layout(kv_cache.k) and kv_cache.v.is_contiguous() and scales_laid_out)


def decode_spans(b: int, width: int) -> tuple[int, int]:
    """(blocks per span, spans per sequence) that the kernel cuts b sequences of block tables `width` wide
    into: at least _ITEMS_PER_THREAD work items per thread where the sequences allow."""
    items = _ITEMS_PER_THREAD * torch.get_num_threads()
    spans = min(width, -(-items // b))
    span_blocks = -(-width // spans)
    return span_blocks, -(-width // span_blocks)


def span_cut(b: int, table_width: int, span_width: int = 0) -> tuple[int, int]:
    """(blocks per span, the kernel's spans per sequence) for b sequences whose tables are table_width wide, cut
    as tables span_width wide would be (0: table_width): the kernel makes spans of the whole table's width, and
    those past a sequence's blocks do nothing."""
    span_blocks, _ = decode_spans(b, span_width or table_width)
    return span_blocks, -(-table_width // span_blocks)


def paged_decode(q: torch.Tensor, kv_cache: PagedKVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, rev: str | None = None, span_width: int = 0) -> torch.Tensor:
    """q (B, Hq, D); block_tables (B, W) int64; seq_lens (B,) int64, each >= 1 -> (B, Hq, D) in q's dtype.
    rev: the kernel as of that git revision (`bench.decode_attention --versus-rev`)."""
    call, out = prepared_decode(q, kv_cache, block_tables, seq_lens, scale, rev, span_width)
    call()
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def prepared_decode(q: torch.Tensor, kv_cache: PagedKVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, rev: str | None = None,
                    span_width: int = 0) -> tuple[Callable[[], None], torch.Tensor]:
    """paged_decode's kernel call with its arguments bound, and the float32 output it writes (B, Hq, D): each
    call of it runs the kernel alone, as the one-call forward does (`bench.decode_attention --kernel-only`).
    span_width: the width the spans are cut by (DecodeGroup.span_width; 0: the table's)."""
    b, hq, d = q.shape
    lib = _library_for(kv_cache, hq, rev=rev)
    width = block_tables.shape[1]
    span_blocks, spans = span_cut(b, width, span_width)
    # float32 rows of one run each (views into the q/k/v output) are read in place, others copied out first (and
    # all of them for a revision before pagoda_paged_decode_rows, whose kernel takes contiguous rows)
    rows = hasattr(lib, "pagoda_paged_decode_rows")
    in_place = rows and q.dtype == torch.float32 and q.stride()[1:] == (d, 1)
    qf = q if in_place else q.to(torch.float32).contiguous()
    bt, lens = block_tables.contiguous(), seq_lens.contiguous()
    assert bt.dtype == lens.dtype == torch.int64, (bt.dtype, lens.dtype)  # read as int64_t by the kernel
    out = torch.empty((b, hq, d), dtype=torch.float32)
    work = torch.empty((b, spans, hq, d + 2), dtype=torch.float32)
    ks, vs = kv_cache.k_scale, kv_cache.v_scale
    table = _fp8_table() if kv_cache.k.dtype == torch.float8_e4m3fn else None

    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    rest = (ptr(kv_cache.k), ptr(kv_cache.v), ptr(ks), ptr(vs), ptr(table), ptr(bt), ptr(lens), ptr(out), ptr(work),
            b, width, span_blocks, scale)
    fn = lib.pagoda_paged_decode_rows if rows else lib.pagoda_paged_decode
    args: tuple[Any, ...] = (ptr(qf), qf.stride(0), *rest) if rows else (ptr(qf), *rest)
    keep = (qf, bt, lens, out, work, table, kv_cache)  # what the addresses point into, alive with the call

    def call() -> None:
        fn(*args)

    call.keep = keep  # type: ignore[attr-defined]
    return call, out


# Prompt chunks of at most this many queries that continue an earlier context go to the loop kernel whatever
# the dtype: SDPA's path first gathers the whole context (bfloat16, 12 queries after 288 tokens: 2.2x faster
# in the loop; 100 after 1,400: 0.67x; `bench.prompt_attention --paged --context`, BENCHMARKS.md).
PREFILL_KERNEL_MAX_CHUNK = 32
# Whether torch's SDPA runs bfloat16/float16 matmuls on AMX tiles here (the Xeons). Elsewhere its flash kernel
# computes in float32 through sgemm, and the loop kernel is faster on every prompt: bfloat16 on the Zen 4 machine
# (AVX-512 BF16, no AMX), 1.33-2.21x at 64-2,048 fresh tokens and 1.64-1.91x on continued chunks
# (`bench.prompt_attention --paged [--context]`, BENCHMARKS.md, "bfloat16 on the Zen 4 machine").
SDPA_ON_AMX = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


# Float32 chunks over a float32 cache ending past this many tokens go to SDPA unless they have at most
# F32_LONG_CONTEXT_MAX_CHUNK queries. A work item of the loop kernel is a few query rows of one KV head over the
# whole context, which past ~1,000 tokens no longer stays in L2, so each item streams it from L3: on the AMX Xeon
# the loop ran 1.04-1.06x SDPA's speed at 896-1,024 fresh tokens but 0.78x at 1,536, 0.68x at 2,048 and 0.44x at
# 4,096; continued chunks 0.95x at 128 queries after 896 tokens, 0.75x after 1,920, 0.53-0.56x ending at
# 4,096-8,192; few queries still won (16 after 2,032 tokens 1.31x, 8 after 2,040 2.0x, 4 after 4,092 3.2x; 32
# after 4,064 0.86x). Over a float16 or int8 cache SDPA's path first gathers the context into float32, and the
# loop stays ahead or even (4,096 fresh tokens 1.6x and 2.2x SDPA's speed; 2,048 after 2,048 1.0x and 1.5x).
# `bench.prompt_attention --paged [--context]`, BENCHMARKS.md ("Float16 prompts on AMX tiles; long float32
# prompts to SDPA").
F32_KERNEL_MAX_CONTEXT = 1024
F32_LONG_CONTEXT_MAX_CHUNK = 16


def prefill_in_kernel(dtype: torch.dtype, n: int, seq_len: int, cache_dtype: torch.dtype) -> bool:
    """Whether a chunk of n queries ending at seq_len, over a cache of cache_dtype, is attended by the kernel (else
    SDPA's flash kernel).

    Float32 models: all chunks over a cache of another dtype; over a float32 cache those ending within
    F32_KERNEL_MAX_CONTEXT tokens (1.1-1.7x SDPA's speed on fresh prompts of 64-1,024 tokens on the Xeon, 1.6-2.0x
    at 512 on the AVX2 machine; 0.9-2.9x on continued chunks), and past it those of at most
    F32_LONG_CONTEXT_MAX_CHUNK queries. Other dtypes (where the AMX kernel does not apply):
    all chunks where SDPA's matmuls have no AMX (`SDPA_ON_AMX`); with AMX only short chunks after an earlier
    context: this kernel's arithmetic is float32 fused multiply-adds, 100-160 GFLOP/s on the Xeon, and there in
    bfloat16 it runs at 0.4-0.9x SDPA's speed on fresh prompts. `python -m pagoda.bench.prompt_attention --paged`,
    BENCHMARKS.md ("Prompt attention in C++")."""
    if dtype == torch.float32:
        return cache_dtype != torch.float32 or seq_len <= F32_KERNEL_MAX_CONTEXT or n <= F32_LONG_CONTEXT_MAX_CHUNK
    return not SDPA_ON_AMX or n < seq_len and n <= PREFILL_KERNEL_MAX_CHUNK


def paged_prefill(q: torch.Tensor, kv_cache: PagedKVCache, block_table: torch.Tensor, seq_len: int,
                  scale: float, rev: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q (n, Hq, D): a prompt chunk's queries, the last at position seq_len - 1, its K/V already in the cache;
    block_table (>= ceil(seq_len / block_size),) int64 -> (n, Hq, D) in q's dtype, causal.
    rev: the kernel as of that git revision (`bench.prompt_attention --versus-rev`). out: where to write the
    result, for float32 queries (_writes_into)."""
    n, hq, d = q.shape
    lib = _library_for(kv_cache, hq, rev=rev)
    qf = q.to(torch.float32).contiguous()
    bt = _prompt_table(block_table, kv_cache, seq_len, n)
    out = _output(q, out)
    table = _fp8_table() if kv_cache.k.dtype == torch.float8_e4m3fn else None
    lib.pagoda_paged_prefill(*(None if t is None else t.data_ptr() for t in (
        qf, kv_cache.k, kv_cache.v, kv_cache.k_scale, kv_cache.v_scale, table, bt)), n, seq_len, out.data_ptr(), scale)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def paged_prefill_chunks(q: torch.Tensor, kv_cache: PagedKVCache, chunks: PromptChunks, scale: float,
                         out: torch.Tensor) -> None:
    """paged_prefill for all of a step's prompt chunks in one kernel call (one parallel region, the tiles of all the
    chunks balanced between the threads, the longest first; the same bits as a call per chunk): q (T, Hq, D) float32
    the step's queries (rows of any stride, read in place: a view into the q/k/v projection's rows), out (T, Hq, D)
    float32 contiguous the step's output, whose chunks' rows it writes."""
    n, hq, d = q.shape
    if q.dtype != torch.float32 or q.stride()[1:] != (d, 1):
        raise ValueError(f"q must be float32 rows of contiguous heads, got {q.dtype} with strides {q.stride()}")
    if out.dtype != torch.float32 or not out.is_contiguous() or out.shape != q.shape:
        raise ValueError(f"out must be a contiguous float32 tensor of shape {tuple(q.shape)}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    lib = _library_for(kv_cache, hq)
    table = _fp8_table() if kv_cache.k.dtype == torch.float8_e4m3fn else None
    lib.pagoda_paged_prefill_chunks(q.data_ptr(), q.stride(0), *(None if t is None else t.data_ptr() for t in (
        kv_cache.k, kv_cache.v, kv_cache.k_scale, kv_cache.v_scale, table, chunks.tables, chunks.table_starts,
        chunks.starts, chunks.counts, chunks.seq_lens)), len(chunks.seq_lens_list), out.data_ptr(), scale)


def _output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The prompt kernels' float32 output (n, Hq, D): out where given (checked), else a new tensor."""
    if out is None:
        return torch.empty(q.shape, dtype=torch.float32)
    if not _writes_into(q, out):
        raise ValueError(f"out must be a contiguous float32 tensor of shape {tuple(q.shape)} for float32 queries, "
                         f"got {out.dtype} {tuple(out.shape)}")
    return out


def _writes_into(q: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the prompt kernels can write their result for q straight into out."""
    return q.dtype == out.dtype == torch.float32 and out.shape == q.shape and out.is_contiguous()


def _prompt_table(block_table: torch.Tensor, kv_cache: PagedKVCache, seq_len: int, n: int) -> torch.Tensor:
    """The chunk's block table as the prompt kernels read it (int64, contiguous), checked to cover seq_len."""
    bt = block_table.contiguous()
    assert bt.dtype == torch.int64 and bt.numel() * kv_cache.k.shape[1] >= seq_len >= n, (bt.dtype, bt.shape, seq_len)
    return bt


def bf16_prefill_available(kv_cache: PagedKVCache, num_q_heads: int) -> bool:
    """Whether prompts over this cache can take the bfloat16 prompt kernel (paged_prefill_bf16): a bfloat16 or float16
    cache without scales, and a compiler targeting AVX-512 BF16 (head_dim a multiple of 32); or an int8 cache with a
    scale per token where that kernel runs on AMX tiles (the OS granting the process AMX tile data). In AVX-512 BF16
    vector instructions an int8 cache stays with the loop kernel, whose scores are integer dot products (VNNI): the
    vector kernel ran at 0.86-0.97x its speed on chunks of 16-128 queries, 1.14-1.22x on 512-2,048 fresh tokens
    (Zen 4, `bench.prompt_attention --paged [--context]`, BENCHMARKS.md), and it rounds the queries to bfloat16."""
    half = kv_cache.k.dtype in (torch.bfloat16, torch.float16) and kv_cache.k_scale is None
    int8 = kv_cache.k.dtype == torch.int8 and kv_cache.spec.scale_granularity == "token"
    if not (half or int8) or not BF16_PREFILL:
        return False
    lib = _library_for(kv_cache, num_q_heads)
    if not hasattr(lib, "pagoda_paged_prefill_bf16"):
        return False
    return _amx_granted(lib) if hasattr(lib, "pagoda_amx_init") else half


@functools.cache
def _amx_granted(lib: Any) -> bool:
    return bool(lib.pagoda_amx_init() == 0)


def paged_prefill_bf16(q: torch.Tensor, kv_cache: PagedKVCache, block_table: torch.Tensor, seq_len: int,
                       scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """paged_prefill in bfloat16 arithmetic (bf16_prefill_available): q rounded to bfloat16 where it is not, over a
    bfloat16 cache, a float16 one (its values rounded to bfloat16) or an int8 one (its values exact in bfloat16, their
    scales applied in float32); the result in q's dtype (into out, as paged_prefill's)."""
    n, hq, d = q.shape
    lib = _library_for(kv_cache, hq)
    qk = _bf16_queries(q)
    bt = _prompt_table(block_table, kv_cache, seq_len, n)
    work = torch.empty(_bf16_work_elems(kv_cache, seq_len), dtype=torch.bfloat16)  # K and V repacked for the tiles
    out = _output(q, out)
    scales = tuple(None if t is None else t.data_ptr() for t in (kv_cache.k_scale, kv_cache.v_scale))
    lib.pagoda_paged_prefill_bf16(qk.data_ptr(), qk.stride(0), int(qk.dtype == torch.float32), kv_cache.k.data_ptr(),
                                  kv_cache.v.data_ptr(), *scales, bt.data_ptr(), n, seq_len, out.data_ptr(),
                                  work.data_ptr(), scale)
    return out.to(q.dtype)


_BF16_KEYS = 64  # keys per step of the bfloat16 kernel (tiles::KC)


def _bf16_work_elems(kv_cache: PagedKVCache, seq_len: int) -> int:
    """bfloat16 values of the bfloat16 kernel's work for a chunk of seq_len keys: its K and V packed
    (tiles::packed_elems)."""
    _, _, hkv, d = kv_cache.k.shape
    return 2 * hkv * (-(-seq_len // _BF16_KEYS) * _BF16_KEYS + 8) * d


def _bf16_queries(q: torch.Tensor) -> torch.Tensor:
    """q as the bfloat16 kernel reads it: float32 and bfloat16 rows in place (a view into the q/k/v projection's rows,
    float32 rounded by the kernel), others rounded to bfloat16 first."""
    d = q.shape[2]
    if q.dtype in (torch.float32, torch.bfloat16) and q.stride(2) == 1 and q.stride(1) == d:
        return q
    return q.to(torch.bfloat16).contiguous()


def paged_prefill_bf16_chunks(q: torch.Tensor, kv_cache: PagedKVCache, chunks: PromptChunks, scale: float,
                              out: torch.Tensor) -> None:
    """paged_prefill_bf16 for all of a step's prompt chunks in one kernel call (one parallel region: every chunk's
    context packed, then all their tiles of queries balanced between the threads, the longest first): q (T, Hq, D)
    the step's queries, out (T, Hq, D) float32 contiguous the step's output, whose chunks' rows it writes."""
    if out.dtype != torch.float32 or not out.is_contiguous() or out.shape != q.shape:
        raise ValueError(f"out must be a contiguous float32 tensor of shape {tuple(q.shape)}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    lib = _library_for(kv_cache, q.shape[1])
    qk = _bf16_queries(q)
    work = torch.empty(sum(_bf16_work_elems(kv_cache, n) for n in chunks.seq_lens_list), dtype=torch.bfloat16)
    scales = tuple(None if t is None else t.data_ptr() for t in (kv_cache.k_scale, kv_cache.v_scale))
    lib.pagoda_paged_prefill_bf16_chunks(
        qk.data_ptr(), qk.stride(0), int(qk.dtype == torch.float32), kv_cache.k.data_ptr(), kv_cache.v.data_ptr(),
        *scales, chunks.tables.data_ptr(), chunks.table_starts.data_ptr(), chunks.starts.data_ptr(),
        chunks.counts.data_ptr(), chunks.seq_lens.data_ptr(), len(chunks.seq_lens_list), out.data_ptr(),
        work.data_ptr(), scale)


# Prompts take the bfloat16 kernel where it is available and the prefill routing allows (CppAttentionBackend.prefill);
# False sends them all to the other paths (in-engine comparisons and tests set it so)
BF16_PREFILL = True


class CppAttentionBackend(KernelBackend):
    name = "cpp"
    kernel_ready = False  # warmup built the kernel for the engine's cache
    # The kernel stops at each sequence's length, so padding a group costs it nothing, while each group is a
    # kernel call and a scatter of its rows: all decodes go in one group (128-request decode steps 1.02x
    # faster in float32 and bfloat16: `bench.decode_step --versus length-groups`, BENCHMARKS.md).
    # SDPA's path (the fallback) pads, so it keeps the length groups.
    one_group = True

    def __init__(self, strict: bool = True, bf16_prompts: bool = False) -> None:
        """bf16_prompts: float32 prompts over a 16-bit cache may take the bfloat16 kernel too, the queries rounded to
        bfloat16 and a float16 cache's K and V as well, in the packing pass (the engine sets it under --quantization,
        whose linears round their inputs to 8 bits of mantissa already). Without it such prompts stay in float32
        arithmetic: on the default model the tiles took a float32 model's float16 cache from 0.0009 to 0.0084 mean
        |logprob change| and its bfloat16 cache from 0.0072 to 0.0084, q4_1's float16 cache from 0.0139 to 0.0170
        (BENCHMARKS.md)."""
        super().__init__(strict)
        self.bf16_prompts = bf16_prompts

    @property
    def decode_group_padding(self) -> float:
        if self.one_group and self.kernel_ready and not self.fallback:
            return float("inf")
        return super().decode_group_padding

    def write(self, kv_cache: PagedKVCache, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        # torch's index_put into K's strided layout: 6-10 ms of a 128-request decode step
        # (`python -m pagoda.bench.decode_step --torch-profile`), more in prompt steps
        if self.fallback or not writes_in_kernel(kv_cache) or not supports(kv_cache, q.dtype):
            return super().write(kv_cache, slots, q, k, v)
        write_kv(kv_cache, q.shape[1], slots, k, v)

    def decode(self, q: torch.Tensor, kv_cache: PagedKVCache, group: DecodeGroup, scale: float) -> torch.Tensor:
        if self.fallback or not supports(kv_cache, q.dtype):
            return super().decode(q, kv_cache, group, scale)
        return paged_decode(q, kv_cache, group.block_tables, group.seq_lens, scale, span_width=group.span_width)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: PagedKVCache,
                block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
        return self._prefill(q, k, v, kv_cache, block_table, seq_len, scale, None)

    def prefill_into(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     kv_cache: PagedKVCache, block_table: torch.Tensor, seq_len: int, scale: float) -> None:
        # float32 chunks straight into the step's output: no tensor of their own, no copy (2,304 bytes a token and
        # layer for the default model)
        res = self._prefill(q, k, v, kv_cache, block_table, seq_len, scale, out if _writes_into(q, out) else None)
        if res is not out:
            out.copy_(res)

    def prefill_chunks(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_cache: PagedKVCache, meta: AttentionMetadata, scale: float) -> None:
        # Chunks for the bfloat16 kernel with a float32 output: all of the step's in one call
        # (paged_prefill_bf16_chunks), where a call per chunk cost ~30-50 us of Python each (a 2,048-token prompt
        # step of the default model has ~7 chunks in each of its 30 layers) and left each call's last tiles to one
        # thread: 1.015x on 128 q4_1 prompts (BENCHMARKS.md, "Each thread its own rows")
        if (meta.prefill_idx and self._bf16_kernel_prompts(q, kv_cache) and out.dtype == torch.float32
                and out.is_contiguous()):
            paged_prefill_bf16_chunks(q, kv_cache, meta.prompt_chunks(), scale, out)
            return
        # Float32 chunks for the loop kernel likewise (paged_prefill_chunks), the queries read in place: a call per
        # chunk also copied its queries out of the q/k/v rows (~40 us each); 128 q4_1 prompts 0.99x and 1.02x in two
        # A/Bs (noise), their attention 3.79 -> 3.07 s under cProfile (Zen 4, BENCHMARKS.md, "Float32 prompt steps")
        if (meta.prefill_idx and q.dtype == out.dtype == torch.float32 and out.is_contiguous()
                and q.stride()[1:] == (q.shape[2], 1) and not self.fallback and supports(kv_cache, q.dtype)
                and not self._bf16_kernel_prompts(q, kv_cache)
                and all(prefill_in_kernel(q.dtype, meta.query_start_loc[i + 1] - meta.query_start_loc[i],
                                          meta.seq_lens[i], kv_cache.k.dtype) for i in meta.prefill_idx)):
            paged_prefill_chunks(q, kv_cache, meta.prompt_chunks(), scale, out)
            return
        super().prefill_chunks(out, q, k, v, kv_cache, meta, scale)

    def _bf16_kernel_prompts(self, q: torch.Tensor, kv_cache: PagedKVCache) -> bool:
        """Whether prompt chunks of q's dtype over this cache take the bfloat16 kernel: bfloat16 queries over a 16-bit
        cache, any queries over an int8 one (whose values are 8-bit already; on AMX tiles only) and, under
        bf16_prompts, over a 16-bit one, where the CPU has the instructions (bf16_prefill_available)."""
        return (not self.fallback and supports(kv_cache, q.dtype)
                and (q.dtype == torch.bfloat16 or kv_cache.k.dtype == torch.int8 or self.bf16_prompts)
                and bf16_prefill_available(kv_cache, q.shape[1]))

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: PagedKVCache,
                 block_table: torch.Tensor, seq_len: int, scale: float, out: torch.Tensor | None) -> torch.Tensor:
        if self.fallback or not supports(kv_cache, q.dtype):
            return super().prefill(q, k, v, kv_cache, block_table, seq_len, scale)
        if self._bf16_kernel_prompts(q, kv_cache):
            return paged_prefill_bf16(q, kv_cache, block_table, seq_len, scale, out=out)
        if prefill_in_kernel(q.dtype, q.shape[0], seq_len, kv_cache.k.dtype):
            return paged_prefill(q, kv_cache, block_table, seq_len, scale, out=out)
        return super().prefill(q, k, v, kv_cache, block_table, seq_len, scale)

    def warmup(self, kv_cache: PagedKVCache, num_q_heads: int, dtype: torch.dtype, scale: float) -> float:
        """Compile (or load from inductor's cache) the kernel for this cache layout before serving."""
        if not supports(kv_cache, dtype):
            return 0.0
        q = torch.zeros((1, num_q_heads, kv_cache.k.shape[-1]), dtype=dtype)
        table, length = torch.zeros((1, 1), dtype=torch.long), torch.ones(1, dtype=torch.long)
        seconds = self.build(lambda: paged_decode(q, kv_cache, table, length, scale))
        self.kernel_ready = not self.fallback
        return seconds
