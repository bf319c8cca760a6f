"""The fused SDPA, C++ and compiled paged backends against the plain torch reference: same outputs on
mixed steps (fresh prompts, prompt chunks continuing earlier ones, decodes, one-block and one-sequence
decode groups), for caches in the model's dtype, in bfloat16 / float16 and quantized."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagoda.layers.attention.backend import AttentionMetadata, PagedAttentionBackend, build_attention_metadata
from pagoda.layers.attention.compiled import CompiledAttentionBackend, paged_decode_attention
from pagoda.layers.attention.cpp import CppAttentionBackend, paged_decode, prepared_decode, supports
from pagoda.layers.attention.paged_kv import PagedKVCache
from pagoda.layers.attention.sdpa import KernelBackend, SDPAAttentionBackend
from pagoda.layers.kv_quant import KVCacheSpec
from tests.layers.test_kv_quant import run_steps


def _bf16_kernel_takes(storage: torch.dtype) -> bool:
    """Whether the bfloat16 prompt kernel runs here over a cache of storage (cpp.bf16_prefill_available, for head_dim
    a multiple of 32): 16-bit caches where the CPU has AVX-512 BF16 (on AMX tiles or in vector instructions), int8
    ones (a scale per token) on AMX tiles only."""
    flags = Path("/proc/cpuinfo").read_text()
    if storage == torch.int8:
        return "amx_bf16" in flags
    return storage in (torch.bfloat16, torch.float16) and "avx512_bf16" in flags


@pytest.mark.parametrize("backend", [SDPAAttentionBackend, CompiledAttentionBackend])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("storage", ["model", "int8 token", "int8 block", "bfloat16"])
def test_backend_matches_reference(backend: type[PagedAttentionBackend], dtype: torch.dtype, tol: float,
                                   storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16: a cache that rounds what a float32 or float64 model writes (the prompts read it back too)."""
    monkeypatch.setattr("pagoda.layers.attention.compiled.MIN_COMPILED_TOKENS", 0)  # these groups are small
    storage_dtype = {"model": dtype, "int8": torch.int8, "bfloat16": torch.bfloat16}[storage.split()[0]]
    spec = KVCacheSpec(storage_dtype, *storage.split()[1:])
    ref = run_steps(spec, dtype)
    got = run_steps(spec, dtype, backend=backend())
    for r, o in zip(ref, got, strict=True):
        assert o.shape == r.shape and o.dtype == r.dtype
        torch.testing.assert_close(o, r, atol=tol, rtol=tol)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("storage", ["model", "int8 token", "int8 block", "fp8 token", "fp8 block", "bfloat16",
                                     "float16"])
def test_cpp_backend_matches_reference(dtype: torch.dtype, tol: float, storage: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 16 (the kernel's multiple): decodes of 1-32 tokens of context, one or two blocks, each
    block a span of its own (few sequences), so the spans' merge is exercised too."""
    import pagoda.layers.attention.cpp as cpp

    calls = []
    monkeypatch.setattr(cpp, "paged_decode", lambda *a, **k: calls.append(1) or paged_decode(*a, **k))
    # prompts in the loop kernel: the bfloat16 one has tests of its own
    monkeypatch.setattr(cpp, "BF16_PREFILL", False)
    storage_dtype = {"model": dtype, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "bfloat16": torch.bfloat16,
                     "float16": torch.float16}[storage.split()[0]]
    spec = KVCacheSpec(storage_dtype, *storage.split()[1:])
    if storage_dtype == torch.int8 and _int8_dot(spec):
        tol = max(tol, 1e-3)  # queries and weights in fixed point (test_int8_dot_rounds_far_less_than_int8)
    backend = CppAttentionBackend()
    ref = run_steps(spec, dtype, bs=16)
    got = run_steps(spec, dtype, backend=backend, bs=16)
    assert not backend.fallback and len(calls) == 4  # every step with decodes went through the kernel
    for r, o in zip(ref, got, strict=True):
        assert o.shape == r.shape and o.dtype == r.dtype
        torch.testing.assert_close(o, r, atol=tol, rtol=tol)


def _fill_cache(cache: PagedKVCache, g: torch.Generator) -> None:
    """Random contents for a test cache: codes in [-127, 127] for an int8 one, normal values otherwise (rounded to
    the cache's dtype), and scales up to 1/64 where it has them (int8, fp8)."""
    if cache.k.dtype == torch.int8:
        cache.k.copy_(torch.randint(-127, 128, cache.k.shape, generator=g))
        cache.v.copy_(torch.randint(-127, 128, cache.v.shape, generator=g))
    else:
        cache.k.copy_(torch.randn(cache.k.shape, generator=g))
        cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    if cache.k_scale is not None and cache.v_scale is not None:
        cache.k_scale.copy_(torch.rand(cache.k_scale.shape, generator=g) / 64)
        cache.v_scale.copy_(torch.rand(cache.v_scale.shape, generator=g) / 64)


def _int8_dot(spec: KVCacheSpec) -> bool:
    """Whether the kernel for run_steps' head shapes takes int8 attention by integer dot products; it must exactly
    where the CPU has AVX-512 VNNI and VBMI (the Zen 4 and Xeon machines; not the AVX2 ones)."""
    from pagoda.layers.attention.cpp import int8_dot
    from tests.layers.test_kv_quant import make_cache

    flags = Path("/proc/cpuinfo").read_text().split()
    taken = int8_dot(make_cache(spec, num_blocks=2, block_size=16, hkv=2, d=64), 8)
    assert taken == ("avx512_vnni" in flags and "avx512vbmi" in flags)
    return taken


@pytest.mark.parametrize("granularity", ["token", "block"])
def test_int8_dot_rounds_far_less_than_int8(granularity: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Integer dot products over an int8 cache round the queries to 16-bit fixed point and the weights of V's rows
    to 15-bit (each against its largest magnitude). What that adds to the kernel's outputs (against the float64
    reference over the same int8 cache) stays under 1/100 of what storing K and V in int8 costs (that reference
    against a float64 cache): measured 3.1-4.6e-5 against 0.8-1.4e-2 of the outputs' norm. (Prompts in the loop
    kernel: on AMX they take bfloat16 tiles, test_bf16_kernel_prompts_over_int8_add_little_to_int8.)"""
    import pagoda.layers.attention.cpp as cpp

    monkeypatch.setattr(cpp, "BF16_PREFILL", False)
    spec = KVCacheSpec(torch.int8, granularity)
    if not _int8_dot(spec):
        pytest.skip("this CPU has no AVX-512 VNNI and VBMI: int8 scores in float32 (the other tests cover them)")
    exact = run_steps(KVCacheSpec(torch.float64), torch.float64, bs=16)
    stored = run_steps(spec, torch.float64, bs=16)  # the torch reference over the int8 cache
    got = run_steps(spec, torch.float32, backend=CppAttentionBackend(), bs=16)
    for e, r, o in zip(exact, stored, got, strict=True):
        kernel = float((o.double() - r).norm() / r.norm())
        int8 = float((r - e).norm() / e.norm())
        assert 0 < kernel < int8 / 100, (kernel, int8)


def test_bf16_kernel_prompts_over_int8_add_little_to_int8() -> None:
    """Where the CPU has AMX, a float32 model's prompts over an int8 cache (a scale per token) take the bfloat16
    tiles: the queries and the softmax weights (times V's scales) rounded to bfloat16, the int8 values exact. What
    that adds to the outputs stays under a third of what storing K and V in int8 costs (measured 2.3e-3 against
    8.2e-3 of the outputs' norm on the Xeon: in quadrature 4% more error than the int8 cache's own; with the
    scales applied before the rounding, 2.9e-3); the decode steps are the integer dot products' (the test above)."""
    from pagoda.layers.attention.cpp import bf16_prefill_available
    from tests.layers.test_kv_quant import make_cache

    spec = KVCacheSpec(torch.int8, "token")
    if not bf16_prefill_available(make_cache(spec, num_blocks=2, block_size=16, hkv=2, d=64), 8):
        pytest.skip("no AMX tiles here: int8 prompts in the loop kernel (the tests above)")
    exact = run_steps(KVCacheSpec(torch.float64), torch.float64, bs=16)
    stored = run_steps(spec, torch.float64, bs=16)
    got = run_steps(spec, torch.float32, backend=CppAttentionBackend(), bs=16)
    for e, r, o in zip(exact, stored, got, strict=True):
        kernel = float((o.double() - r).norm() / r.norm())
        int8 = float((r - e).norm() / e.norm())
        assert 0 < kernel < int8 / 3, (kernel, int8)


def test_bf16_kernel_prompts_over_float16_only_when_asked() -> None:
    """A float16 cache's prompts take the bfloat16 kernel (AMX tiles or AVX-512 BF16 dot products) only under
    bf16_prompts (the engine's --quantization): K, V, the queries and the softmax weights rounded to bfloat16. What
    that adds stays within 1.5x what storing K and V in bfloat16 costs (measured 3.0-3.3e-3 against 2.4-2.8e-3 of the
    outputs' norm on the Xeon; float16 storage's own 3e-4). Without the flag the float32 loop kernel keeps float16's
    precision (2e-7)."""
    from pagoda.layers.attention.cpp import bf16_prefill_available
    from tests.layers.test_kv_quant import make_cache

    spec = KVCacheSpec(torch.float16)
    exact = run_steps(KVCacheSpec(torch.float64), torch.float64, bs=16)
    stored = run_steps(spec, torch.float64, bs=16)
    bf16 = run_steps(KVCacheSpec(torch.bfloat16), torch.float64, bs=16)
    kernel_here = bf16_prefill_available(make_cache(spec, num_blocks=2, block_size=16, hkv=2, d=64), 8)
    for flag in (False, True):
        got = run_steps(spec, torch.float32, backend=CppAttentionBackend(bf16_prompts=flag), bs=16)
        errors = [(float((o.double() - r).norm() / r.norm()), float((b - e).norm() / e.norm()))
                  for e, r, b, o in zip(exact, stored, bf16, got, strict=True)]
        if flag and kernel_here:
            assert max(kernel for kernel, _ in errors) > 1e-4, errors  # the bfloat16 kernel ran
            assert all(kernel < 1.5 * bf16_storage for kernel, bf16_storage in errors), errors
        else:
            assert all(kernel < 1e-6 for kernel, _ in errors), errors


@pytest.mark.parametrize("num_seqs", [1, 3, 40])
@pytest.mark.parametrize("storage", ["float32", "int8"])
def test_cpp_kernel_on_long_scattered_contexts(num_seqs: int, storage: str) -> None:
    """Contexts of 1-700 tokens in blocks scattered through the cache, a table padded past each sequence's
    blocks with garbage block ids that must not be read, against the float64 reference; q contiguous or a view
    into wider rows. int8: quantized as the engine writes it (per token), spans of several steps through the
    integer dot products and their step-ahead prefetch."""
    from tests.layers.test_kv_quant import make_cache

    g = torch.Generator().manual_seed(num_seqs)
    int8 = storage == "int8"
    spec = KVCacheSpec(torch.int8, "token") if int8 else KVCacheSpec(torch.float32)
    cache = make_cache(spec, num_blocks=2000, block_size=16, hkv=3, d=64)
    slots = torch.arange(2000 * 16)
    cache.write(slots, torch.randn(slots.numel(), 3, 64, generator=g), torch.randn(slots.numel(), 3, 64, generator=g))
    lens = torch.randint(1, 700, (num_seqs,), generator=g)
    lens[0] = 700
    tables = torch.randperm(2000, generator=g)[: num_seqs * 44].view(num_seqs, 44)
    q = torch.randn(num_seqs, 9, 64, generator=g)
    got = paged_decode(q, cache, tables, lens, 0.125)
    want = paged_decode_attention(q.double(), cache.k, cache.v, cache.k_scale, cache.v_scale, tables, lens, 0.125)
    tol = 1e-3 if int8 and _int8_dot(spec) else 1e-5
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    wide = torch.randn(num_seqs, 9 * 64 + 100, generator=g)  # q as a view into wider rows, read in place
    wide[:, :9 * 64] = q.view(num_seqs, -1)
    assert torch.equal(paged_decode(wide[:, :9 * 64].view(num_seqs, 9, 64), cache, tables, lens, 0.125), got)
    call, out = prepared_decode(q, cache, tables, lens, 0.125)  # the bound call, as the kernel-only bench reruns it
    for _ in range(2):
        out.zero_()
        call()
        assert torch.equal(out, got)
    # blocks given ahead (several decode steps a call): a wider table, cut into spans as the 44 blocks the contexts
    # take are (DecodeGroup.span_width), gives the same bits; the kernel's spans past them do nothing
    ahead = torch.cat([tables, torch.randint(0, 2000, (num_seqs, 29), generator=g)], dim=1)
    assert torch.equal(paged_decode(q, cache, ahead, lens, 0.125, span_width=44), got)


@pytest.mark.parametrize(("hkv", "group", "block_size", "d"), [(2, 1, 16, 64), (2, 2, 32, 32), (1, 8, 16, 16),
                                                                 (4, 4, 16, 48), (3, 3, 64, 64)])
def test_cpp_kernel_head_shapes(hkv: int, group: int, block_size: int, d: int) -> None:
    """Head shapes that give the kernel's score loop each of its splits of head_dim into partial sums (DS =
    4, 2 and 1 in cpp_kernel.cpp), and block sizes that give 4, 2 and 1 blocks per softmax update (CB), in
    float32 and bfloat16 caches, against the float64 reference."""
    from tests.layers.test_kv_quant import make_cache

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        g = torch.Generator().manual_seed(hkv * group)
        cache = make_cache(KVCacheSpec(dtype), num_blocks=64, block_size=block_size, hkv=hkv, d=d)
        cache.k.copy_(torch.randn(cache.k.shape, generator=g))
        cache.v.copy_(torch.randn(cache.v.shape, generator=g))
        lens = torch.tensor([1, block_size + 3, 5 * block_size])
        tables = torch.randperm(64, generator=g)[:15].view(3, 5)
        q = torch.randn(3, hkv * group, d, generator=g)
        got = paged_decode(q, cache, tables, lens, d**-0.5)
        want = paged_decode_attention(q.double(), cache.k.double(), cache.v.double(), None, None, tables, lens,
                                      d**-0.5)  # from the same (rounded) cache, so float32 arithmetic only
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("width", [8, 4])
def test_cpp_kernel_at_narrower_vector_widths(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel as AVX2 CPUs (8 lanes) and older ones (4) build it, on this CPU too, against the build for this
    one: nine query heads are more than one vector's lanes there, so the online softmax takes them in groups
    (cpp_kernel.cpp, fold_each); decodes and a prompt chunk, float32 and float16 caches."""
    import pagoda.layers.attention.cpp as cpp
    from pagoda.layers.attention.cpp import paged_prefill
    from tests.layers.test_cpp_vector import NARROWER
    from tests.layers.test_kv_quant import make_cache

    g = torch.Generator().manual_seed(width)
    lens = torch.tensor([1, 17, 150, 299, 64])
    tables = torch.randperm(120, generator=g)[:95].view(5, 19)
    q, qp = torch.randn(5, 9, 64, generator=g), torch.randn(70, 9, 64, generator=g)
    for dtype in (torch.float32, torch.float16):
        cache = make_cache(KVCacheSpec(dtype), num_blocks=120, block_size=16, hkv=3, d=64)
        cache.k.copy_(torch.randn(cache.k.shape, generator=g))
        cache.v.copy_(torch.randn(cache.v.shape, generator=g))
        native = paged_decode(q, cache, tables, lens, 0.125), paged_prefill(qp, cache, tables[3], 299, 0.125)
        with monkeypatch.context() as patch:
            patch.setattr(cpp, "load_library", lambda src, defines, flags=(), rev=None, load=cpp.load_library:
                          load(src, defines, tuple(flags) + NARROWER[width] + ("-U__AMX_TILE__",), rev))
            lib = cpp._library.__wrapped__(*cpp._library_args(cache, 9))
            patch.setattr(cpp, "_library_for", lambda *args, lib=lib, **kwargs: lib)
            narrow = paged_decode(q, cache, tables, lens, 0.125), paged_prefill(qp, cache, tables[3], 299, 0.125)
        for a, b in zip(narrow, native, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bf16_kernel_in_vector_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bfloat16 prompt kernel as a CPU with AVX-512 BF16 but no AMX runs it (vdpbf16ps in vector registers; built
    with PAGODA_NO_AMX, so that an AMX machine tests it too) over a float16 cache of scattered blocks, fresh and
    continued chunks with partial tiles and steps, against causal attention in float64: within bfloat16's rounding,
    as the tiles."""
    import torch.nn.functional as F

    import pagoda.layers.attention.cpp as cpp
    from tests.layers.test_kv_quant import make_cache

    if "avx512_bf16" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no AVX-512 BF16 here")
    g = torch.Generator().manual_seed(11)
    cache = make_cache(KVCacheSpec(torch.float16), num_blocks=60, block_size=16, hkv=3, d=64)
    _fill_cache(cache, g)
    table = torch.randperm(60, generator=g)[:20]
    monkeypatch.setattr(cpp, "load_library", lambda src, defines, flags=(), rev=None, load=cpp.load_library:
                        load(src, defines, (*flags, "-DPAGODA_NO_AMX=1"), rev))
    lib = cpp._library.__wrapped__(*cpp._library_args(cache, 9))
    assert not hasattr(lib, "pagoda_amx_init")  # the vector build
    monkeypatch.setattr(cpp, "_library_for", lambda *args, lib=lib, **kwargs: lib)
    keys, values = cache.gather(table, torch.float64)
    for seq_len, n in ((300, 300), (300, 7), (70, 33)):
        q = torch.randn(n, 9, 64, generator=g)
        got = cpp.paged_prefill_bf16(q, cache, table, seq_len, 0.125)
        k, v = keys.flatten(0, 1)[:seq_len], values.flatten(0, 1)[:seq_len]
        mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - n, seq_len)[:, None]
        want = F.scaled_dot_product_attention(q.double().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              attn_mask=mask, scale=0.125, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
        assert (got.double() - want).abs().max() > 1e-5  # bfloat16 arithmetic, not the float32 loop


def test_bf16_kernel_on_amx_tiles_compiles_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The AMX variant of the bfloat16 prompt kernel, built for AMX on any x86-64 CPU (`-mamx-*`; only run where the
    CPU has the tiles, the tests above): it compiles, over float16, bfloat16 and int8 caches, and exports the entry
    points and `pagoda_amx_init`, which grants the tiles only where the CPU has them. So a machine without AMX still
    catches an AMX-only build error."""
    import ctypes
    import platform

    import pagoda.layers.attention.cpp as cpp
    from tests.layers.test_kv_quant import make_cache

    flags = Path("/proc/cpuinfo").read_text()
    if platform.machine() != "x86_64" or "avx512_bf16" not in flags:
        pytest.skip("the kernel is built for x86-64 CPUs with AVX-512 BF16")
    cpu_has_amx = "amx_bf16" in flags
    monkeypatch.setattr(cpp, "load_library", lambda src, defines, flags=(), rev=None, load=cpp.load_library:
                        load(src, defines, (*flags, "-mamx-tile", "-mamx-bf16", "-mamx-int8"), rev))
    for spec in (KVCacheSpec(torch.float16), KVCacheSpec(torch.bfloat16), KVCacheSpec(torch.int8, "token")):
        cache = make_cache(spec, num_blocks=2, block_size=16, hkv=3, d=64)
        lib = cpp._library.__wrapped__(*cpp._library_args(cache, 9))
        assert hasattr(lib, "pagoda_paged_prefill_bf16") and hasattr(lib, "pagoda_paged_prefill_bf16_chunks")
        lib.pagoda_amx_init.restype = ctypes.c_int
        assert (lib.pagoda_amx_init() == 0) == cpu_has_amx, spec


def test_cpp_backend_falls_back_to_sdpa_where_the_kernel_does_not_apply() -> None:
    from tests.layers.test_kv_quant import make_cache

    assert not supports(make_cache(KVCacheSpec(torch.float32), block_size=4, d=64), torch.float32)  # blocks of 4
    assert not supports(make_cache(KVCacheSpec(torch.float32), block_size=16, d=8), torch.float32)  # head_dim 8
    assert not supports(make_cache(KVCacheSpec(torch.float64), block_size=16, d=64), torch.float64)
    plain = make_cache(KVCacheSpec(torch.float32), block_size=16, d=64)
    assert supports(plain, torch.float32)
    contiguous_k = type(plain)(plain.k.contiguous(), plain.v, plain.spec)  # not the engine's K layout
    assert not supports(contiguous_k, torch.float32)
    ref = run_steps(KVCacheSpec(torch.float32), torch.float32)  # blocks of 4: SDPA's path
    got = run_steps(KVCacheSpec(torch.float32), torch.float32, backend=CppAttentionBackend())
    for r, o in zip(ref, got, strict=True):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)


def test_decode_groups_cover_every_decode_once_with_bounded_padding() -> None:
    from pagoda.layers.attention.backend import DECODE_GROUP_PADDING, build_attention_metadata

    lens = [3, 40, 41, 7, 300, 5, 290, 64, 2, 100]  # context lengths after this step
    seqs = [(list(range(100 + 20 * i, 100 + 20 * i + -(-n // 16))), n - 1, 1) for i, n in enumerate(lens)]
    seqs.insert(3, ([1, 2], 0, 20))  # a prompt chunk in the middle of the batch
    meta = build_attention_metadata(seqs, 16)
    rows = sorted(int(r) for g in meta.decode_groups for r in g.rows)
    assert rows == [meta.query_start_loc[i] for i, s in enumerate(seqs) if s[2] == 1]
    assert meta.prefill_idx == [3]
    for g in meta.decode_groups:
        real = sum(-(-int(n) // 16) for n in g.seq_lens)
        assert g.block_tables.numel() <= max(DECODE_GROUP_PADDING * real, g.block_tables.shape[1])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_attention_metadata_against_a_token_by_token_reference(block_size: int) -> None:
    """Random batches of decodes and prompt chunks (chunks crossing blocks, starting mid-block): each token's
    slot, the rows, lengths and block tables of the decode groups (padded with block 0), whole_step and row_range;
    with no limit on padding, all decodes in one group in batch order."""
    import random

    from pagoda.layers.attention.backend import build_attention_metadata

    rng = random.Random(block_size)
    for _ in range(200):
        seqs = []
        for _ in range(rng.randint(1, 10)):
            n = rng.choice([1, 1, rng.randint(1, 70)])
            start = rng.randint(0, 200)
            seqs.append((rng.sample(range(1000), -(-(start + n) // block_size)), start, n))
        padding = rng.choice([1.0, 1.25, float("inf")])
        meta = build_attention_metadata(seqs, block_size, padding)
        want = [t[p // block_size] * block_size + p % block_size for t, start, n in seqs
                for p in range(start, start + n)]
        assert meta.slot_mapping.tolist() == want
        starts = [0] + [sum(n for _, _, n in seqs[: i + 1]) for i in range(len(seqs))]
        assert meta.query_start_loc == starts
        assert meta.seq_lens == [start + n for _, start, n in seqs]
        assert meta.prefill_idx == [i for i, s in enumerate(seqs) if s[2] > 1]
        assert {i: t.tolist() for i, t in meta.block_tables.items()} == {i: seqs[i][0] for i in meta.prefill_idx}
        seen = []
        for g in meta.decode_groups:
            for row, table, length in zip(g.rows.tolist(), g.block_tables.tolist(), g.seq_lens.tolist(), strict=True):
                i = starts.index(row)
                seen.append(i)
                t = seqs[i][0]
                assert table == t + [0] * (len(table) - len(t)) and length == seqs[i][1] + 1
        decodes = [i for i, s in enumerate(seqs) if s[2] == 1]
        assert sorted(seen) == decodes
        if padding == float("inf"):
            assert seen == decodes and len(meta.decode_groups) == (1 if decodes else 0)
        whole = len(meta.decode_groups) == 1 and meta.decode_groups[0].rows.tolist() == list(range(len(seqs)))
        assert all(g.whole_step == whole for g in meta.decode_groups)
        for g in meta.decode_groups:
            rows = g.rows.tolist()
            consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
            assert g.row_range == ((rows[0], rows[-1] + 1) if consecutive else None)


@pytest.mark.parametrize("padding", [1.25, float("inf")])
def test_decode_rows_sliced_or_whole_step_as_gathered(padding: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step loop's shortcuts (a whole_step group's output as it is, a row_range group's rows sliced) give what
    gathering and scattering each group's rows gives, on the reference backend's mixed steps; both shortcuts
    are taken."""
    import dataclasses

    from pagoda.layers.attention import backend as backend_module
    from pagoda.layers.attention.torch_ref import TorchAttentionBackend
    from tests.layers.test_kv_quant import run_steps

    monkeypatch.setattr(backend_module, "DECODE_GROUP_PADDING", padding)
    taken = {"whole_step": 0, "row_range": 0}

    class Checked(TorchAttentionBackend):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: PagedKVCache,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
            out = super().forward(q, k, v, kv_cache, meta, scale)
            for g in meta.decode_groups:
                taken["whole_step"] += g.whole_step
                taken["row_range"] += g.row_range is not None and not g.whole_step
            plain = [dataclasses.replace(g, whole_step=False, row_range=None) for g in meta.decode_groups]
            gathered = super().forward(q, k, v, kv_cache, dataclasses.replace(meta, decode_groups=plain), scale)
            assert torch.equal(out, gathered)
            return out

    run_steps(KVCacheSpec(torch.float32), torch.float32, backend=Checked(), bs=16)
    assert taken["whole_step"] > 0 and taken["row_range"] > 0


@pytest.mark.parametrize(("num_seqs", "num_blocks"), [(1, 1), (1, 3), (3, 1), (2, 2)])
def test_compiled_decode_on_size_one_groups(num_seqs: int, num_blocks: int) -> None:
    """Groups of one sequence or one block are padded inside the kernel call; results must not change."""
    from pagoda.layers.attention.backend import DecodeGroup
    from pagoda.layers.attention.torch_ref import TorchAttentionBackend
    from tests.layers.test_kv_quant import make_cache

    g = torch.Generator().manual_seed(num_seqs * 10 + num_blocks)
    cache = make_cache(KVCacheSpec(torch.float64), num_blocks=12, block_size=4, hkv=2, d=64)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g, dtype=torch.float64))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g, dtype=torch.float64))
    tables = torch.randperm(12, generator=g)[: num_seqs * num_blocks].view(num_seqs, num_blocks)
    lens = torch.randint(4 * num_blocks - 3, 4 * num_blocks + 1, (num_seqs,), generator=g)
    group = DecodeGroup(rows=torch.arange(num_seqs), block_tables=tables, seq_lens=lens)
    q = torch.randn(num_seqs, 8, 64, generator=g, dtype=torch.float64)
    got = CompiledAttentionBackend().kernel_decode(q, cache, group, 0.125)
    torch.testing.assert_close(got, TorchAttentionBackend().decode(q, cache, group, 0.125), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("compile_model", [False, True])
def test_compiled_backend_compiles_once_at_start_up(tmp_path: object, monkeypatch: pytest.MonkeyPatch,
                                                     compile_model: bool) -> None:
    """After the engine's warm-up, serving batches of any size and context length compiles nothing more
    (a guard failure, e.g. on grad mode or a size-1 dimension, would recompile in the middle of serving)."""
    from pathlib import Path

    from torch._dynamo.utils import counters

    from pagoda import LLM, SamplingParams
    from tests.conftest import make_tiny_model

    monkeypatch.setattr("pagoda.layers.attention.compiled.MIN_COMPILED_TOKENS", 0)  # every group uses the kernel
    folder = make_tiny_model(Path(str(tmp_path)), "llama")
    llm = LLM(str(folder), attention_backend="compiled", max_num_batched_tokens=64, compile_model=compile_model)
    assert llm.engine.compile_seconds > 0
    before = counters["stats"]["unique_graphs"]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)  # one sequence, one block
    llm.generate([[i % 200 + 1 for i in range(n)] for n in (2, 40, 90, 150)], params, use_tqdm=False)
    assert counters["stats"]["unique_graphs"] == before


def test_auto_backend_is_chosen_by_dtype() -> None:
    from pagoda.layers.attention.backend import get_attention_backend, resolve_attention_backend

    assert resolve_attention_backend("auto", torch.float32) == "cpp"
    assert resolve_attention_backend("auto", torch.bfloat16) == "cpp"
    assert resolve_attention_backend("auto", torch.float64) == "compiled"
    assert resolve_attention_backend("torch", torch.float32) == "torch"
    auto = get_attention_backend("auto", torch.float32)
    assert isinstance(auto, CppAttentionBackend) and not auto.strict  # falls back to sdpa if it cannot compile
    auto64 = get_attention_backend("auto", torch.float64)
    assert isinstance(auto64, CompiledAttentionBackend) and not auto64.strict
    assert get_attention_backend("compiled").strict  # asked for by name: failing to compile is an error
    assert get_attention_backend("cpp").strict
    with pytest.raises(ValueError, match="attention backend must be one of"):
        get_attention_backend("flash")


@pytest.mark.parametrize(("backend", "module", "builder"), [(CompiledAttentionBackend, "compiled", "_compiled"),
                                                         (CppAttentionBackend, "cpp", "_library")])
def test_kernel_backends_fall_back_to_sdpa_when_compilation_fails(
        backend: type[KernelBackend], module: str, builder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chosen by auto (not strict): the failure is logged, the backend reports itself as sdpa, and its
    steps go through SDPA's path (the broken builder would raise if called again). Asked for by name
    (strict): an error."""
    from tests.layers.test_kv_quant import make_cache

    def broken(*args: object) -> None:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(f"pagoda.layers.attention.{module}.{builder}", broken)
    monkeypatch.setattr("pagoda.layers.attention.compiled.MIN_COMPILED_TOKENS", 0)
    cache = make_cache(KVCacheSpec(torch.float32), num_blocks=4, block_size=16, hkv=2, d=64)
    auto = backend(strict=False)
    auto.warmup(cache, 8, torch.float32, 0.5)
    assert auto.fallback and auto.name == "sdpa"
    ref = run_steps(KVCacheSpec(torch.float32), torch.float32, bs=16)
    got = run_steps(KVCacheSpec(torch.float32), torch.float32, backend=auto, bs=16)
    for r, o in zip(ref, got, strict=True):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="could not compile"):
        backend(strict=True).warmup(cache, 8, torch.float32, 0.5)


def test_small_decode_groups_go_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below MIN_COMPILED_TOKENS the compiled backend answers with SDPA's path; above, with its kernel."""
    import pagoda.layers.attention.compiled as compiled
    from pagoda.layers.attention.backend import DecodeGroup
    from tests.layers.test_kv_quant import make_cache

    calls: list[str] = []
    monkeypatch.setattr(compiled, "_compiled", lambda q, *a: calls.append("kernel") or torch.zeros_like(q))
    monkeypatch.setattr(SDPAAttentionBackend, "decode", lambda self, q, *a: calls.append("sdpa") or torch.zeros_like(q))
    cache = make_cache(KVCacheSpec(torch.float32), num_blocks=200, block_size=16, hkv=2, d=8)
    backend = CompiledAttentionBackend()
    for seqs, blocks in ((1, 2), (4, 31), (4, 32), (16, 24)):
        group = DecodeGroup(rows=torch.arange(seqs), block_tables=torch.zeros((seqs, blocks), dtype=torch.long),
                            seq_lens=torch.full((seqs,), 16 * blocks))
        backend.decode(torch.zeros(seqs, 4, 8), cache, group, 1.0)
    assert calls == ["sdpa", "sdpa", "kernel", "kernel"]


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("storage", [torch.int8, torch.float8_e4m3fn])
def test_cpp_kernel_decodes_every_8_bit_code(storage: torch.dtype, portable: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Each sequence has one token, so its output is that token's V row times its scale: all 256 int8 codes
    and every finite e4m3 code (subnormals and both signs included) come back as torch decodes them.
    portable: the build without AVX-512 intrinsics (what CPUs without AVX-512 run), on this CPU too."""
    import pagoda.layers.attention.cpp as cpp
    from tests.layers.test_kv_quant import make_cache

    library_for = cpp._library_for
    monkeypatch.setattr(cpp, "_library_for", lambda cache, hq, rev=None: library_for(cache, hq, portable, rev))
    cache = make_cache(KVCacheSpec(storage, "block"), num_blocks=2, block_size=16, hkv=3, d=64)
    codes = torch.arange(384, dtype=torch.int32).remainder(256).to(torch.uint8)
    if storage == torch.float8_e4m3fn:
        codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN codes
    cache.v[:, 0].view(torch.uint8).copy_(codes.view(2, 3, 64))
    assert cache.v_scale is not None
    cache.v_scale.fill_(1.0)
    got = paged_decode(torch.randn(2, 9, 64), cache, torch.tensor([[0], [1]]), torch.tensor([1, 1]), 0.125)
    want = cache.v[:, 0].float().repeat_interleave(3, dim=1)  # (2, 9, 64): each KV head's G query heads
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("source", ["fused rows", "contiguous", "model dtype"])
def test_cpp_write_matches_torch_write(dtype: torch.dtype, source: str) -> None:
    """The C++ writer puts every element where PagedKVCache.write (torch indexing) puts it, rounded as torch's `.to`
    rounds: float32 K and V as views into a fused q/k/v output (the kernel reads them in place and rounds them),
    contiguous float32 ones, and views into q/k/v rows already in the cache's dtype."""
    from pagoda.layers.attention.cpp import write_kv
    from tests.layers.test_kv_quant import make_cache

    g = torch.Generator().manual_seed(0)
    ours, theirs = (make_cache(KVCacheSpec(dtype), num_blocks=10, block_size=16, hkv=3, d=64) for _ in range(2))
    slots = torch.randperm(160, generator=g)[:100]  # 100 tokens scattered over 10 blocks
    qkv = torch.randn(100, 9 * 64 + 2 * 3 * 64, generator=g) * 3
    qkv[:5, 9 * 64:] = 70000.0  # past float16's range: inf, as torch rounds it
    qkv[5:10, 9 * 64:] = torch.tensor(1.0 + 2.0**-11)  # a float16 tie (and a bfloat16 round-down)
    if source == "model dtype":  # a model of the cache's dtype: its own q/k/v rows
        qkv = qkv.to(dtype)
    k, v = qkv[:, 9 * 64:12 * 64].view(100, 3, 64), qkv[:, 12 * 64:].view(100, 3, 64)
    if source == "contiguous":
        k, v = k.contiguous(), v.contiguous()
    write_kv(ours, 9, slots, k, v)
    theirs.write(slots, k, v)
    assert torch.equal(ours.k, theirs.k) and torch.equal(ours.v, theirs.v)


@pytest.mark.parametrize("source", ["fused rows", "contiguous", "bfloat16"])
def test_cpp_int8_write_matches_torch_write(source: str) -> None:
    """An int8 cache with a scale per token: the C++ writer quantizes each (token, KV head) row to the bits
    kv_quant.write_token_scaled gives, scales included, in their layouts (K's with the tokens innermost): float32
    rows in place or contiguous, a bfloat16 model's rows. Rows whose scale is exactly 1 or 8 put values on ties
    (x / scale = 2.5, -3.5: to even), a row of zeros gets the smallest scale, one past float16's range the largest."""
    from pagoda.layers.attention.cpp import write_kv, writes_in_kernel
    from tests.layers.test_kv_quant import make_cache

    g = torch.Generator().manual_seed(1)
    ours, theirs = (make_cache(KVCacheSpec(torch.int8, "token"), num_blocks=10, block_size=16, hkv=3, d=64)
                    for _ in range(2))
    assert writes_in_kernel(ours) and supports(ours, torch.float32)
    slots = torch.randperm(160, generator=g)[:100]
    qkv = torch.randn(100, 9 * 64 + 2 * 3 * 64, generator=g) * 3
    kv = qkv[:, 9 * 64:].view(100, 6, 64)  # K's three heads, then V's
    kv[0, :, 0], kv[0, :, 1], kv[0, :, 2:] = 127.0, 2.5, -3.5  # scale 1: ties
    kv[1, :, 0], kv[1, :, 1], kv[1, :, 2:] = -1016.0, 20.0, 4.0  # scale 8: 2.5 and 0.5, ties
    kv[2] = 0.0
    kv[3, :, 0] = 1e7
    if source == "bfloat16":
        qkv = qkv.to(torch.bfloat16)
    k, v = qkv[:, 9 * 64:12 * 64].view(100, 3, 64), qkv[:, 12 * 64:].view(100, 3, 64)
    if source == "contiguous":
        k, v = k.contiguous(), v.contiguous()
    write_kv(ours, 9, slots, k, v)
    theirs.write(slots, k, v)  # kv_quant.write_token_scaled
    pairs = ((ours.k, theirs.k), (ours.v, theirs.v), (ours.k_scale, theirs.k_scale), (ours.v_scale, theirs.v_scale))
    for a, b in pairs:
        assert a is not None and b is not None and torch.equal(a, b)
    assert ours.k_scale is not None and ours.k_scale.reshape(-1, 3)[slots[0]].tolist() == [1.0] * 3
    assert ours.k.reshape(-1, 3, 64)[slots[1], :, :2].tolist() == [[-127, 2]] * 3


@pytest.mark.parametrize(("hkv", "group", "block_size", "d"), [(3, 3, 16, 64), (2, 1, 16, 64), (2, 2, 32, 32),
                                                                 (1, 8, 16, 16), (4, 4, 16, 48), (1, 2, 16, 96)])
@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16, torch.int8, "bfloat16 tiles", "int8 tiles",
                                     "float16 tiles"])
def test_cpp_prefill_kernel_against_reference(hkv: int, group: int, block_size: int, d: int,
                                              storage: torch.dtype | str) -> None:
    """Prompts from their start and chunks continuing a context, of lengths that leave the kernels' last tile
    of rows partial (PREFILL_ROWS is 2 to 6 for these head shapes; the bfloat16 kernel's tiles are 16 rows, its
    steps 64 keys), over a cache of scattered blocks, against causal attention in float64 over the same
    (rounded) cache. The bfloat16 kernel ("tiles": queries and weights rounded to bfloat16; bfloat16 queries over a
    bfloat16 cache, float32 ones over an int8 cache, whose values it takes exactly and its scales in float32, and
    over a float16 one, whose values it rounds to bfloat16) where this CPU has it (_bf16_kernel_takes) and head_dim
    is a multiple of 32."""
    import torch.nn.functional as F

    from pagoda.layers.attention.cpp import bf16_prefill_available, paged_prefill, paged_prefill_bf16
    from tests.layers.test_kv_quant import make_cache

    tiles = storage in ("bfloat16 tiles", "int8 tiles", "float16 tiles")
    storage = {"bfloat16 tiles": torch.bfloat16, "int8 tiles": torch.int8,  # type: ignore[arg-type]
               "float16 tiles": torch.float16}.get(storage, storage)
    assert isinstance(storage, torch.dtype)

    spec = KVCacheSpec(storage, "token") if storage == torch.int8 else KVCacheSpec(storage)
    g = torch.Generator().manual_seed(hkv * group + d)
    cache = make_cache(spec, num_blocks=96, block_size=block_size, hkv=hkv, d=d)
    _fill_cache(cache, g)
    table = torch.randperm(96, generator=g)[: -(-300 // block_size)]
    int8_dot = storage == torch.int8 and _int8_dot(spec)
    if tiles:  # built for head_dim in 32s
        assert bf16_prefill_available(cache, hkv * group) == (d % 32 == 0 and _bf16_kernel_takes(storage))
        if d % 32 or not _bf16_kernel_takes(storage):
            return
    for seq_len, n in ((300, 300), (37, 37), (300, 7), (150, 2), (17 + block_size, 17), (128, 64), (129, 129)):
        q = torch.randn(n, hkv * group, d, generator=g)
        if tiles and storage == torch.bfloat16:
            q = q.to(torch.bfloat16)
        got = (paged_prefill_bf16 if tiles else paged_prefill)(q, cache, table, seq_len, d**-0.5)
        keys, values = cache.gather(table, torch.float64)
        keys, values = keys.flatten(0, 1)[:seq_len], values.flatten(0, 1)[:seq_len]
        mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - n, seq_len)[:, None]
        want = F.scaled_dot_product_attention(q.double().transpose(0, 1), keys.transpose(0, 1),
                                              values.transpose(0, 1), attn_mask=mask, scale=d**-0.5,
                                              enable_gqa=True).transpose(0, 1)
        tol = 2e-2 if tiles else 1e-3 if int8_dot else 1e-5  # int8 scores from 16-bit queries (_int8_dot)
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def _mixed_step(shape: list[tuple[int, int]], num_blocks: int, bs: int, hkv: int, group: int, d: int,
                g: torch.Generator) -> tuple[AttentionMetadata, torch.Tensor]:
    """A step of sequences given as (start position, new tokens), each on its own random blocks out of num_blocks:
    its metadata, and random queries (T, hkv * group, d) as the engine hands them over, a view into wider q/k/v
    rows."""
    blocks = torch.randperm(num_blocks, generator=g).tolist()
    seqs = []
    for start, n in shape:
        need = -(-(start + n) // bs)
        seqs.append((blocks[:need], start, n))
        blocks = blocks[need:]
    meta = build_attention_metadata(seqs, bs)
    t = meta.query_start_loc[-1]
    qkv = torch.randn(t, (group + 2) * hkv * d, generator=g)
    return meta, qkv[:, :group * hkv * d].view(t, hkv * group, d)


def _one_call_gives_each_chunks_bits(cache: PagedKVCache, batched: Callable[..., None],
                                     single: Callable[..., torch.Tensor],
                                     seed: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """A step's prompt chunks (fresh and continued, of one query to several tiles and key steps, with decode rows
    between and after them; the queries a view into wider q/k/v rows, as the engine passes them) through batched(q,
    cache, chunks, scale, out) in one call: bit for bit single(q_rows, cache, table, seq_len, scale) per chunk, in
    their rows of out and nothing else; a bfloat16 out refused. Returns the step's metadata and queries."""
    hkv, d, bs = cache.k.shape[2], cache.k.shape[3], cache.k.shape[1]
    g = torch.Generator().manual_seed(seed)
    _fill_cache(cache, g)
    # (start position, new tokens): decodes (1 token) between the chunks
    shape = [(0, 300), (40, 1), (0, 37), (250, 2), (128, 129), (70, 1), (16, 17), (0, 64), (3, 1)]
    meta, q = _mixed_step(shape, cache.k.shape[0], bs, hkv, 3, d, g)
    out = torch.full(q.shape, 7.0)
    batched(q, cache, meta.prompt_chunks(), d**-0.5, out)
    assert meta.prefill_idx == [0, 2, 3, 4, 6, 7]
    for i in range(len(shape)):
        lo, hi = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        if i in meta.prefill_idx:
            want = single(q[lo:hi], cache, meta.block_tables[i], meta.seq_lens[i], d**-0.5)
            assert torch.equal(out[lo:hi], want), i
        else:
            assert bool((out[lo:hi] == 7.0).all()), i  # a decode's row: not written
    with pytest.raises(ValueError, match="contiguous float32"):
        batched(q, cache, meta.prompt_chunks(), d**-0.5, out.bfloat16())
    return meta, q


@pytest.mark.parametrize("storage", [torch.float16, torch.bfloat16, torch.int8])
def test_bf16_kernel_prompt_chunks_in_one_call_give_each_chunks_bits(storage: torch.dtype) -> None:
    """paged_prefill_bf16_chunks: a step's prompt chunks in one kernel call, bit for bit each chunk's own
    paged_prefill_bf16 call (_one_call_gives_each_chunks_bits); float32 queries read in place."""
    from pagoda.layers.attention.cpp import bf16_prefill_available, paged_prefill_bf16, paged_prefill_bf16_chunks
    from tests.layers.test_kv_quant import make_cache

    spec = KVCacheSpec(storage, "token") if storage == torch.int8 else KVCacheSpec(storage)
    cache = make_cache(spec, num_blocks=160, block_size=16, hkv=3, d=64)
    if not bf16_prefill_available(cache, 9):
        pytest.skip("no bfloat16 kernel here for this cache (CPU, compiler target or OS)")
    _one_call_gives_each_chunks_bits(cache, paged_prefill_bf16_chunks, paged_prefill_bf16, seed=5)


@pytest.mark.parametrize("storage", [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_loop_prompt_chunks_in_one_call_give_each_chunks_bits(storage: torch.dtype) -> None:
    """paged_prefill_chunks: a step's prompt chunks in one call of the loop kernel, bit for bit each chunk's own
    paged_prefill call (_one_call_gives_each_chunks_bits); queries other than float32 refused."""
    from pagoda.layers.attention.cpp import paged_prefill, paged_prefill_chunks
    from tests.layers.test_kv_quant import make_cache

    spec = KVCacheSpec(storage, "token") if storage in (torch.int8, torch.float8_e4m3fn) else KVCacheSpec(storage)
    cache = make_cache(spec, num_blocks=160, block_size=16, hkv=3, d=64)
    meta, q = _one_call_gives_each_chunks_bits(cache, paged_prefill_chunks, paged_prefill, seed=6)
    with pytest.raises(ValueError, match="q must be float32"):
        paged_prefill_chunks(q.bfloat16(), cache, meta.prompt_chunks(), 0.125, torch.empty(q.shape))


@pytest.mark.parametrize(("n", "seq_len", "kernel"), [
    (512, 512, True), (1024, 1024, True), (128, 1024, True), (1025, 1025, False), (2048, 2048, False),
    (2048, 4096, False), (17, 2048, False), (16, 2048, True), (1, 5000, True)])
def test_float32_prompts_past_1024_tokens_go_to_sdpa(n: int, seq_len: int, kernel: bool) -> None:
    """Over a float32 cache, float32 chunks ending within F32_KERNEL_MAX_CONTEXT tokens, and chunks of at most 16
    queries after any context, to the loop kernel; longer ones to SDPA, which the loop trails there (it streams
    the context from L3 for every few query rows). Over a float16 or int8 cache all to the loop (SDPA's path would
    first gather the context into float32)."""
    from pagoda.layers.attention.cpp import prefill_in_kernel

    assert prefill_in_kernel(torch.float32, n, seq_len, torch.float32) == kernel
    assert prefill_in_kernel(torch.float32, n, seq_len, torch.float16)
    assert prefill_in_kernel(torch.float32, n, seq_len, torch.int8)


@pytest.mark.parametrize("storage", [torch.float32, torch.float16])
def test_cpp_backend_sends_a_long_float32_prompt_to_sdpa_only_over_a_float32_cache(
        storage: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh float32 prompt of 1,100 tokens through CppAttentionBackend.prefill: over a float32 cache to SDPA (the
    loop trails it past 1,024 tokens), over a float16 one to the loop (SDPA's path would gather the cache into
    float32 first); either way the same outputs as the loop kernel's, to float32 rounding."""
    import pagoda.layers.attention.cpp as cpp
    from tests.layers.test_kv_quant import make_cache

    n, hkv, group, d, bs = 1100, 2, 2, 64, 16
    g = torch.Generator().manual_seed(7)
    cache = make_cache(KVCacheSpec(storage), num_blocks=80, block_size=bs, hkv=hkv, d=d)
    table = torch.randperm(80, generator=g)[: -(-n // bs)]
    k, v = (torch.randn(n, hkv, d, generator=g).to(storage).float() for _ in range(2))
    slots = (table[:, None] * bs + torch.arange(bs)).flatten()[:n]
    cache.write(slots, k, v)
    q = torch.randn(n, hkv * group, d, generator=g)
    calls: list[str] = []
    for name in ("paged_prefill", "paged_prefill_bf16"):
        kernel = getattr(cpp, name)
        monkeypatch.setattr(cpp, name,
                            lambda *a, name=name, kernel=kernel, **kw: calls.append(name) or kernel(*a, **kw))
    got = CppAttentionBackend().prefill(q, k, v, cache, table, n, d**-0.5)
    assert calls == ([] if storage == torch.float32 else ["paged_prefill"])
    want = cpp.paged_prefill(q, cache, table, n, d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("dtype", "storage", "bf16_prompts"), [
    (torch.float32, torch.float32, False), (torch.float32, torch.float16, True), (torch.float32, torch.float16, False),
    (torch.bfloat16, torch.bfloat16, False)])
def test_cpp_backend_writes_prompt_chunks_into_the_steps_rows(
        dtype: torch.dtype, storage: torch.dtype, bf16_prompts: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """prefill_into: float32 chunks go straight into the rows given (the AMX tiles' kernel and the loop's), other
    dtypes through a copy; either way exactly prefill's result, as from queries that are a view of wider rows. A
    kernel's out of another shape or dtype is refused."""
    import pagoda.layers.attention.cpp as cpp
    from tests.layers.test_kv_quant import make_cache

    n, hkv, group, d, bs = 40, 3, 3, 64, 16
    g = torch.Generator().manual_seed(8)
    cache = make_cache(KVCacheSpec(storage), num_blocks=12, block_size=bs, hkv=hkv, d=d)
    table = torch.randperm(12, generator=g)[:4]
    seq_len = 60  # the chunk's 40 queries after 20 tokens
    slots = (table[:, None] * bs + torch.arange(bs)).flatten()[:seq_len]
    cache.write(slots, *(torch.randn(seq_len, hkv, d, generator=g) for _ in range(2)))
    q = torch.randn(n, hkv * group, d, generator=g).to(dtype)
    backend = CppAttentionBackend(bf16_prompts=bf16_prompts)
    want = backend.prefill(q, q[:, :hkv], q[:, :hkv], cache, table, seq_len, d**-0.5)
    step = torch.full((n + 8, hkv * group, d), float("nan"), dtype=dtype)
    handed: list[int | None] = []  # the out each kernel call was given (its address)
    for name in ("paged_prefill", "paged_prefill_bf16"):
        kernel = getattr(cpp, name)
        monkeypatch.setattr(cpp, name, lambda *a, kernel=kernel, **kw: handed.append(
            None if kw.get("out") is None else kw["out"].data_ptr()) or kernel(*a, **kw))
    backend.prefill_into(step[4:n + 4], q, q[:, :hkv], q[:, :hkv], cache, table, seq_len, d**-0.5)
    assert handed == [step[4].data_ptr() if dtype == torch.float32 else None]  # float32: no tensor of its own
    assert torch.equal(step[4:n + 4], want)
    assert step[:4].isnan().all() and step[n + 4:].isnan().all()
    # the queries as the engine hands them over: a view of wider q/k/v rows, read in place by the kernels
    rows = torch.cat([q.flatten(1), torch.randn(n, 2 * hkv * d, generator=g).to(dtype)], dim=1)
    view = rows[:, :hkv * group * d].view(n, hkv * group, d)
    assert not view.is_contiguous()
    assert torch.equal(backend.prefill(view, q[:, :hkv], q[:, :hkv], cache, table, seq_len, d**-0.5), want)
    with pytest.raises(ValueError, match="out must be a contiguous float32 tensor"):
        cpp.paged_prefill(q.float(), cache, table, seq_len, d**-0.5, out=torch.empty(n, hkv * group, d - 1))


@pytest.mark.parametrize("sdpa_on_amx", [False, True])
@pytest.mark.parametrize(("dtype", "storage", "bf16_prompts"), [
    (torch.float32, "model", False), (torch.bfloat16, "model", False), (torch.bfloat16, "int8", False),
    (torch.float32, "int8", False), (torch.float32, "float16", False), (torch.float32, "float16", True),
    (torch.float32, "bfloat16", False), (torch.float32, "bfloat16", True), (torch.bfloat16, "float16", False)])
def test_cpp_backend_routes_prompt_chunks(dtype: torch.dtype, storage: str, bf16_prompts: bool, sdpa_on_amx: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """run_steps' prompt chunks (fresh ones of 21, 16 and 5 tokens; continued ones of 13 and 9): bfloat16 over a
    16-bit cache, any dtype over an int8 cache and, under bf16_prompts, over a 16-bit one all to the bfloat16
    kernel (where it runs over that cache, _bf16_kernel_takes; float32 ones a step's chunks in one call); float32
    otherwise all to the loop; the rest all to the loop where SDPA has no AMX, and where it has, the continued ones to
    the loop and the fresh ones to SDPA. Float32 chunks for the loop go a step's in one call
    (paged_prefill_chunks)."""
    import pagoda.layers.attention.cpp as cpp

    monkeypatch.setattr(cpp, "SDPA_ON_AMX", sdpa_on_amx)
    calls: list[tuple[str, int, int]] = []
    for name in ("paged_prefill", "paged_prefill_bf16"):
        kernel = getattr(cpp, name)
        monkeypatch.setattr(cpp, name, lambda q, cache, table, seq_len, scale, name=name, kernel=kernel, **kw: (
            calls.append((name, q.shape[0], seq_len)) or kernel(q, cache, table, seq_len, scale, **kw)))
    for name in ("paged_prefill_bf16_chunks", "paged_prefill_chunks"):
        batched = getattr(cpp, name)
        monkeypatch.setattr(cpp, name, lambda q, cache, chunks, scale, out, name=name, batched=batched: (
            calls.extend((name, int(n), s) for n, s in zip(chunks.counts, chunks.seq_lens_list, strict=True))
            or batched(q, cache, chunks, scale, out)))
    sdpa_prefill = SDPAAttentionBackend.prefill
    monkeypatch.setattr(SDPAAttentionBackend, "prefill", lambda self, q, k, v, cache, table, seq_len, scale: (
        calls.append(("sdpa", q.shape[0], seq_len)) or sdpa_prefill(self, q, k, v, cache, table, seq_len, scale)))
    spec = {"model": KVCacheSpec(dtype), "int8": KVCacheSpec(torch.int8, "token"),
            "float16": KVCacheSpec(torch.float16), "bfloat16": KVCacheSpec(torch.bfloat16)}[storage]
    run_steps(spec, dtype, backend=CppAttentionBackend(bf16_prompts=bf16_prompts), bs=16)
    chunks = [(21, 21), (16, 16), (13, 29), (5, 5), (9, 15)]
    if _bf16_kernel_takes(spec.storage_dtype) and (storage == "int8" or dtype == torch.bfloat16 or bf16_prompts):
        # a step's chunks in one call where the step's output is float32 (paged_prefill_bf16_chunks)
        want = [("paged_prefill_bf16_chunks" if dtype == torch.float32 else "paged_prefill_bf16", *c) for c in chunks]
    elif dtype == torch.float32:  # a step's chunks in one call of the loop kernel
        want = [("paged_prefill_chunks", *c) for c in chunks]
    elif not sdpa_on_amx:
        want = [("paged_prefill", *c) for c in chunks]
    else:
        want = [("paged_prefill" if n < s else "sdpa", n, s) for n, s in chunks]
    assert calls == want
