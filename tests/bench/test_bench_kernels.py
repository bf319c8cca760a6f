"""The attention microbenchmarks run and report what they measured (never how fast it was)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import pytest


def run_module(main: object, argv: list[str], capsys: pytest.CaptureFixture[str],
               monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    monkeypatch.setattr(sys, "argv", ["prog", *argv])
    main()  # type: ignore[operator]
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def spy_git_reads(monkeypatch: pytest.MonkeyPatch, library: object) -> list[tuple[str, str | None]]:
    """(file name, revision) of every kernel source the build reads from now on; library's cache of builds is
    cleared first, so that a build an earlier test made at the same revision is read again."""
    from pagoda.layers import cpp_build

    reads: list[tuple[str, str | None]] = []
    read = cpp_build._read
    monkeypatch.setattr(cpp_build, "_read", lambda path, rev: reads.append((path.name, rev)) or read(path, rev))
    library.cache_clear()  # type: ignore[attr-defined]
    return reads


def test_prompt_attention_names_the_kernel_each_layout_took(capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.bench.prompt_attention import main

    rows = run_module(main, ["--tokens", "32", "--iters", "1"], capsys, monkeypatch)
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"]
    for r in rows:
        assert r["ms_3d"] > 0 and r["ms_4d"] > 0 and r["speedup"] > 0
        assert r["kernel_4d"] == "aten::_scaled_dot_product_flash_attention_for_cpu"  # why pagoda batches its calls
    assert rows[0]["max_abs_diff"] < 1e-5


@pytest.mark.parametrize("context", [0, 40])
def test_prompt_attention_paged_times_the_cpp_kernels_against_sdpa(context: int, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    from pagoda.bench.prompt_attention import main

    rows = run_module(main, ["--tokens", "20", "--iters", "1", "--paged", "--context", str(context)], capsys,
                      monkeypatch)
    assert [(r["dtype"], r["kv_cache"], r["context"]) for r in rows] == [
        ("float32", "float32", context), ("float32", "float16", context), ("float32", "int8 per token", context),
        ("bfloat16", "bfloat16", context)]
    flags = Path("/proc/cpuinfo").read_text()  # the bfloat16 kernel takes 16-bit caches, and on AMX tiles int8 ones
    bf16, amx = "avx512_bf16" in flags, "amx_bf16" in flags
    assert [("ms_cpp_bf16" in r) for r in rows] == [False, bf16, amx, bf16]
    for r in rows:
        assert r["ms_sdpa"] > 0 and r["ms_cpp"] > 0 and r["sdpa_over_cpp"] > 0
        assert all(v < _tolerance(r, k) for k, v in r.items() if k.startswith("max_abs"))


def _tolerance(row: dict, key: str) -> float:
    """The prompt kernels' largest difference from SDPA over the same cache: bfloat16's rounding (the bfloat16
    kernel's over any cache too), int8's integer dot products (16-bit queries, 15-bit weights;
    tests/layers/test_attention_backends.py), float32 otherwise."""
    if key.endswith("bf16"):
        return 5e-2
    return {"bfloat16": 5e-2, "int8 per token": 1e-3}.get(row["kv_cache"], 1e-5)


def test_prompt_attention_paged_against_a_revision(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """--versus-rev: the loop kernel built from its source at HEAD (read through git), timed beside the checkout's
    and giving the same output; without --paged the flag is refused."""
    from pagoda.bench.prompt_attention import main
    from pagoda.layers.attention import cpp

    reads = spy_git_reads(monkeypatch, cpp._library)
    rows = run_module(main, ["--tokens", "20", "--iters", "1", "--paged", "--versus-rev", "HEAD"], capsys,
                      monkeypatch)
    assert ("cpp_kernel.cpp", "HEAD") in reads and ("cpp_vector.h", "HEAD") in reads
    for r in rows:
        assert r["ms_cpp_rev"] > 0
        assert r["cpp_rev_over_cpp"] > 0
        assert r["max_abs_diff_cpp_rev"] < _tolerance(r, "max_abs_diff_cpp_rev")
    with pytest.raises(SystemExit):
        run_module(main, ["--versus-rev", "HEAD"], capsys, monkeypatch)


def test_decode_attention_times_each_backend(capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.bench.decode_attention import main

    rows = run_module(main, ["--num-seqs", "3", "--context", "20:40", "--iters", "1"], capsys, monkeypatch)
    assert [r["backend"] for r in rows] == ["sdpa", "compiled", "cpp"]
    assert all(r["ms_per_call"] > 0 and r["read_gb_per_s"] > 0 for r in rows)
    assert rows[0]["compile_s"] == 0 and rows[1]["compile_s"] > 0


def test_decode_attention_block_orders(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Scattered tables are distinct ids in no order; consecutive ones give each sequence one run of ids; the run
    reports the order it timed."""
    import torch

    from pagoda.bench.decode_attention import block_tables, main

    g = torch.Generator().manual_seed(0)
    scattered = block_tables(6, 5, 60, "scattered", g)
    assert scattered.shape == (6, 5) and scattered.unique().numel() == 30
    assert not all((row.diff() == 1).all() for row in scattered)
    consecutive = block_tables(6, 5, 60, "consecutive", g)
    assert consecutive.tolist() == [list(range(5 * i, 5 * i + 5)) for i in range(6)]
    with pytest.raises(ValueError, match="block order"):
        block_tables(6, 5, 60, "sorted", g)
    with pytest.raises(ValueError, match="do not fit"):
        block_tables(6, 5, 20, "consecutive", g)
    rows = run_module(main, ["--num-seqs", "3", "--context", "20:40", "--iters", "1", "--backends", "cpp",
                             "--block-order", "consecutive"], capsys, monkeypatch)
    assert rows[0]["block_order"] == "consecutive" and rows[0]["ms_per_call"] > 0


def test_decode_attention_caches_are_allocated_as_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark's K and V sit in one huge-page region (2 MiB-aligned, V carved right after K) where the engine's
    would, plain or quantized."""
    import torch

    from pagoda.bench.decode_attention import _cache
    from pagoda.layers.kv_quant import kv_cache_spec
    from pagoda.worker.host_memory import HUGE_PAGE, huge_pages_enabled

    if not huge_pages_enabled():
        pytest.skip("this system gives no transparent huge pages (the engine's cache is on ordinary pages too)")
    for kv_dtype in ("auto", "int8"):
        cache = _cache(kv_cache_spec(kv_dtype, torch.float32, "token"), torch.float32, 8, 16, 3, 64,
                       torch.Generator().manual_seed(0))
        k_bytes = cache.k.numel() * cache.k.element_size()
        assert cache.k.data_ptr() % HUGE_PAGE == 0 and cache.v.data_ptr() == cache.k.data_ptr() + k_bytes


@pytest.mark.parametrize("kv_dtype", ["auto", "float16", "bfloat16", "int8"])
def test_decode_attention_caches_are_stored_in_the_cache_dtype(kv_dtype: str) -> None:
    """Under float32 queries a 16-bit cache is stored in 16 bits (the benchmark had built it in the queries' dtype
    while reporting the cache's)."""
    import torch

    from pagoda.bench.decode_attention import _cache
    from pagoda.layers.kv_quant import kv_cache_spec

    spec = kv_cache_spec(kv_dtype, torch.float32, "token")
    cache = _cache(spec, torch.float32, 8, 16, 3, 64, torch.Generator().manual_seed(0))
    assert cache.k.dtype == cache.v.dtype == spec.storage_dtype
    assert spec.storage_dtype == {"auto": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                                  "int8": torch.int8}[kv_dtype]


def test_decode_attention_versus_a_git_revision(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """--versus-rev builds the kernel from the sources at that revision (here HEAD, read through git) and
    times both sides over --layers caches; --versus-rev needs the cpp backend alone."""
    import subprocess

    from pagoda.bench.decode_attention import main
    from pagoda.layers.attention import cpp

    if subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not in a git checkout")
    reads = spy_git_reads(monkeypatch, cpp._library)
    argv = ["--num-seqs", "3", "--context", "20:40", "--iters", "1", "--backends", "cpp", "--layers", "2",
            "--versus-rev", "HEAD"]
    rows = run_module(main, argv, capsys, monkeypatch)
    assert len(rows) == 1 and rows[0]["layers"] == 2 and rows[0]["versus_rev"] == "HEAD"
    assert rows[0]["ms_per_call"] > 0 and rows[0]["versus_ms_per_call"] > 0
    assert ("cpp_kernel.cpp", "HEAD") in reads and ("cpp_vector.h", "HEAD") in reads
    rows = run_module(main, [*argv, "--kernel-only"], capsys, monkeypatch)  # the kernels alone, both sides
    assert rows[0]["ms_per_call"] > 0 and rows[0]["versus_ms_per_call"] > 0
    for flag in (["--versus-rev", "HEAD"], ["--kernel-only"]):
        with pytest.raises(SystemExit):
            run_module(main, ["--backends", "sdpa,cpp", *flag], capsys, monkeypatch)


def test_elementwise_bench_times_each_op_on_each_side(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    from pagoda.bench.elementwise import main

    rows = run_module(main, ["--tokens", "16", "--iters", "1", "--dtype", "float32"], capsys, monkeypatch)
    assert [r["op"] for r in rows] == ["add_rms_norm", "rotary", "silu_mul"]
    assert all(r["cpp_ms"] > 0 and r["torch_ms"] > 0 and "rev_ms" not in r for r in rows)
    if subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True).returncode == 0:
        rows = run_module(main, ["--tokens", "16", "--iters", "1", "--versus-rev", "HEAD"], capsys, monkeypatch)
        assert all(r["rev_ms"] > 0 and r["versus_rev"] == "HEAD" for r in rows)


def test_kernel_sources_at_a_git_revision() -> None:
    import subprocess
    from pathlib import Path

    from pagoda.layers import cpp_build

    header = Path(cpp_build.__file__).with_name("cpp_vector.h")
    shown = subprocess.run(["git", "show", "HEAD:pagoda/layers/cpp_vector.h"], capture_output=True, text=True)
    if shown.returncode != 0:
        pytest.skip("not in a git checkout")
    assert cpp_build._read(header, "HEAD") == shown.stdout
    assert cpp_build._read(header, None) == header.read_text()
    with pytest.raises(ValueError, match="no-such-revision"):
        cpp_build._read(header, "no-such-revision")


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_decode_attention_over_a_quantized_cache(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                                 kv: str) -> None:
    from pagoda.bench.decode_attention import main

    argv = ["--num-seqs", "3", "--context", "20:40", "--iters", "1", "--backends", "torch,cpp", "--kv-cache-dtype", kv]
    rows = run_module(main, argv, capsys, monkeypatch)
    assert [r["kv_cache"] for r in rows] == [f"{kv} per token"] * 2
    assert all(r["ms_per_call"] > 0 and r["read_gb_per_s"] > 0 for r in rows)


def test_linear_stream_compares_equal_results(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The script checks that oneDNN's packed weights give F.linear's results before timing them."""
    import torch

    from pagoda.bench.linear_stream import main
    from pagoda.layers.linear import packable_rows

    rows = run_module(main, ["--rows", "1,5", "--layers", "1", "--repeats", "1"], capsys, monkeypatch)
    assert [r["rows"] for r in rows] == [1, 5]
    assert all(r["linear_ms"] > 0 and r["onednn_packed_ms"] > 0 and r["layers"] == 1 for r in rows)
    assert rows[0]["gemv_ms"] > 0 and "gemv_ms" not in rows[1]  # float32 at 1-4 rows: also the C++ GEMV
    assert all(r["onednn_plain_ms"] > 0 for r in rows)  # float32: also oneDNN on the plain weight
    rows = run_module(main, ["--rows", "1,5", "--layers", "1", "--repeats", "1", "--dtype", "bfloat16"], capsys,
                      monkeypatch)
    assert rows[0]["gemv_ms"] > 0 and "gemv_ms" not in rows[1] and "onednn_plain_ms" not in rows[0]  # bfloat16
    bf16_packable = packable_rows(torch.bfloat16) is not None  # where oneDNN cannot, no packed side
    assert all((r["onednn_packed_ms"] is not None) == bf16_packable for r in rows)


def test_sampler_bench_times_both_searches(capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.bench.sampler import main

    rows = run_module(main, ["--rows", "4", "--vocab", "1000", "--iters", "1"], capsys, monkeypatch)
    assert len(rows) == 1 and rows[0]["rows"] == 4 and rows[0]["keeps_freed_memory"] is False
    assert all(rows[0][k] > 0 for k in ("sampler_ms", "fused_sampler_ms", "two_level_search_ms",
                                        "full_float64_cumsum_search_ms"))


@pytest.mark.parametrize("convert", [False, True])
def test_sampler_bench_with_penalties_over_given_lengths(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch, convert: bool) -> None:
    """--repetition-penalty over rows of --prompt-len and --output-len tokens, with the requests' kept token arrays
    (the engine's way) or, --convert-ids, each row's lists converted."""
    from pagoda.bench.sampler import main

    args = ["--rows", "3", "--vocab", "500", "--iters", "1", "--repetition-penalty", "1.2", "--prompt-len", "40",
            "--output-len", "7"] + (["--convert-ids"] if convert else [])
    rows = run_module(main, args, capsys, monkeypatch)
    assert len(rows) == 1 and rows[0]["kept_token_array"] is not convert
    assert (rows[0]["prompt_len"], rows[0]["output_len"], rows[0]["repetition_penalty"]) == (40, 7, 1.2)
    assert rows[0]["fused_sampler_ms"] > 0 and rows[0]["sampler_ms"] > 0


@pytest.mark.parametrize("versus", ["weights-read", "packed-weights"])
def test_decode_step_alternates_with_its_counterpart(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch, versus: str) -> None:
    """decode_step --versus: both sides timed in alternating rounds, on the default model."""
    from pagoda.bench.decode_step import main

    argv = ["--num-seqs", "4", "--input-len", "8:20", "--steps", "2", "--rounds", "2", "--versus", versus,
            "--kv-cache-memory", "64MiB"]
    (row,) = run_module(main, argv, capsys, monkeypatch)
    assert row["rounds"] == 2 and row["versus"] == versus
    assert row["decode_step_ms"] > 0 and row["versus_ms"] > 0
    assert row["step_over_versus"] == pytest.approx(row["decode_step_ms"] / row["versus_ms"], rel=0.05)


def test_decode_step_versus_another_attention_backend(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """--versus cpp-attention: the engine's sdpa steps alternate with steps whose decodes go through the C++
    kernel (swapped in on every attention layer, then back)."""
    import pagoda.layers.attention.cpp as cpp
    from pagoda.bench.decode_step import main

    calls: list[int] = []
    kernel = cpp.paged_decode
    monkeypatch.setattr(cpp, "paged_decode", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    argv = ["--num-seqs", "4", "--input-len", "8:20", "--steps", "2", "--rounds", "2", "--versus", "cpp-attention",
            "--kv-cache-memory", "64MiB"]
    (row,) = run_module(main, argv, capsys, monkeypatch)
    assert row["attention_backend"] == "sdpa" and row["versus"] == "cpp-attention"
    assert row["decode_step_ms"] > 0 and row["versus_ms"] > 0
    # the warm-up call, then at least one decode group per layer of each of the cpp side's 2 x 2 steps
    assert len(calls) >= 1 + 2 * 2 * 30 and (len(calls) - 1) % 30 == 0


@pytest.mark.parametrize("versus", ["torch-elementwise", "length-groups", "no-prefetch", "torch-sampler"])
def test_decode_step_versus_the_cpp_paths_alternatives(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch, versus: str) -> None:
    """--versus torch-elementwise: the fused C++ elementwise ops alternate with torch's (whose RMSNorm runs
    only on that side: 61 norms a step); --versus length-groups: the cpp backend's one decode group with
    length groups; --versus no-prefetch: its kernel with and without prefetching; --versus torch-sampler: the
    sampler's torch code (4 rows a step) on that side only."""
    import pagoda.layers.attention.cpp as cpp
    import pagoda.layers.elementwise as elementwise
    import pagoda.layers.sampler as sampler
    from pagoda.bench.decode_step import main

    torch_sampled: list[int] = []
    sample_torch = sampler._sample_torch
    monkeypatch.setattr(sampler, "_sample_torch",
                        lambda lo, rows: torch_sampled.append(len(rows)) or sample_torch(lo, rows))

    norms: list[int] = []
    torch_norm = elementwise.rms_norm
    monkeypatch.setattr(elementwise, "rms_norm", lambda *a: norms.append(1) or torch_norm(*a))
    prefetches: set[int] = set()  # the prefetch distances of the kernels decodes ran with
    library_for = cpp._library_for
    monkeypatch.setattr(cpp, "_library_for",
                        lambda *a, **kw: prefetches.add(cpp._library_args(*a)[-1]) or library_for(*a, **kw))
    for name in ("PREFETCH_AHEAD", "PREFETCH_MAX_ELEMENT_BYTES"):  # the bench changes them: restored after
        monkeypatch.setattr(cpp, name, getattr(cpp, name))
    argv = ["--num-seqs", "4", "--input-len", "8:20", "--steps", "2", "--rounds", "2", "--versus", versus,
            "--kv-cache-memory", "64MiB", "--attention-backend", "cpp"]
    (row,) = run_module(main, argv, capsys, monkeypatch)
    assert row["versus"] == versus and row["decode_step_ms"] > 0 and row["versus_ms"] > 0
    assert len(norms) == (2 * 2 * 61 if versus == "torch-elementwise" else 0)
    assert torch_sampled == ([4] * 2 * 2 if versus == "torch-sampler" else [])
    # the default model's float32 cache is prefetched one block ahead; not by the other side of no-prefetch
    assert prefetches == ({0, 1} if versus == "no-prefetch" else {1})


def test_decode_step_versus_eager_one_stream(capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """--versus eager-one-stream: one stream's steps through the one-call forward on one side only."""
    from pagoda.bench.decode_step import main
    from pagoda.model.one_stream import OneStreamForward

    calls: list[bool] = []
    one_call = OneStreamForward.__call__
    monkeypatch.setattr(OneStreamForward, "__call__",
                        lambda self, *a: calls.append(True) or one_call(self, *a))  # type: ignore[func-returns-value]
    argv = ["--num-seqs", "1", "--input-len", "8:20", "--steps", "2", "--rounds", "2", "--versus", "eager-one-stream",
            "--kv-cache-memory", "64MiB", "--attention-backend", "cpp", "--dtype", "bfloat16"]
    (row,) = run_module(main, argv, capsys, monkeypatch)
    assert row["versus"] == "eager-one-stream" and row["decode_step_ms"] > 0 and row["versus_ms"] > 0
    assert len(calls) == 1 + 2 * 2  # the prompt step declined it, then the one-call side's steps


def test_q4_linear_bench_times_both_sides_at_every_shape(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.bench.q4_linear import SHAPES, main

    rows = run_module(main, ["--rows", "1,5", "--iters", "1"], capsys, monkeypatch)
    results = rows[0]["results"]
    assert [(r["in"], r["out"], r["rows"]) for r in results] == [(k, n, m) for k, n in SHAPES for m in (1, 5)]
    assert all(r["float32_us"] > 0 and r["q4_1_us"] > 0 for r in results)


def test_f32_tiles_bench_checks_and_times_both_sides(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Per shape (and with --step, one decode step's linears in turn), the engine's tile kernel and oneDNN's packed
    weights both timed, and the kernel's output within float32 rounding of oneDNN's: rows that leave a tail of every
    size below the tile's 12."""
    from pagoda.bench import f32_tiles

    rows = run_module(f32_tiles.main, ["--rows", "1,11,13", "--iters", "1"], capsys, monkeypatch)
    assert [(r["rows"], r["in"], r["out"]) for r in rows] == [
        (m, k, n) for m in (1, 11, 13) for k, n in [*f32_tiles.SHAPES, f32_tiles.LM_HEAD]]
    assert all(r["tiles_ms"] > 0 and r["onednn_packed_ms"] > 0 and r["max_abs_diff"] < 1e-4 for r in rows)
    (step,) = run_module(f32_tiles.main, ["--step", "--layers", "1", "--rows", "23", "--iters", "1"], capsys,
                         monkeypatch)
    assert step["layers"] == 1 and step["tiles_speedup"] > 0 and step["max_abs_diff"] < 1e-4


def test_q4_linear_bench_fused_calls_against_the_calls_they_replace(capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.bench.q4_linear import main

    (row,) = run_module(main, ["--fused", "--rows", "3,20", "--iters", "1"], capsys, monkeypatch)
    assert [r["rows"] for r in row["results"]] == [3, 20]
    for r in row["results"]:
        assert all(r[f"{k}_us"] > 0 for k in ("norm_qkv", "norm_then_qkv", "norm_mlp", "norm_then_mlp", "mlp",
                                             "silu_mul_then_down"))
        assert r["mlp_speedup"] == pytest.approx(r["silu_mul_then_down_us"] / r["mlp_us"], rel=0.02)


def test_q4_linear_bench_one_stream_layers_against_the_reads_and_a_revision(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """--layers: one-row calls over that many layers' weights (on huge pages, called from C++), against reading their
    bytes in one buffer, against reading the weights themselves split as the kernel splits them, and (--versus-rev)
    the kernel built from its source at HEAD (read through git)."""
    from pagoda.bench.q4_linear import SHAPES, main

    (row,) = run_module(main, ["--layers", "2", "--iters", "1", "--versus-rev", "HEAD"], capsys, monkeypatch)
    assert row["layers"] == 2 and row["weight_bytes"] == 2 * sum(k * n * 5 // 8 for k, n in SHAPES)
    assert row["q4_1_ms"] > 0 and row["weights_read_ms"] > 0 and row["split_read_ms"] > 0
    assert row["versus_rev_ms"] > 0 and row["versus_rev"] == "HEAD"
    assert row["q4_1_over_split_read"] == pytest.approx(row["q4_1_ms"] / row["split_read_ms"], rel=0.02)


def test_q4_linear_bench_alternates_the_sides_each_after_a_flush() -> None:
    """Every side runs after a read of the flush buffer (else a side finds the end of the weights the side before it
    read still in cache), in turn, the first round unreported; each side's own seconds are its time."""
    from pagoda.bench.q4_linear import _alternate

    events: list[str] = []
    seconds = {"a": iter([9.0, 1.0, 3.0]), "b": iter([9.0, 2.0, 4.0])}

    def side(name: str) -> Callable[[], float]:
        return lambda: events.append(name) or next(seconds[name])

    medians = _alternate({"a": side("a"), "b": side("b")}, lambda: events.append("flush"), 2)
    assert events == ["flush", "a", "flush", "b"] * 3
    assert medians == {"a": 2.0, "b": 3.0}


def test_q4_linear_bench_rows_against_a_revision(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """--versus-rev without --layers: each shape and row count also timed with the kernel built at HEAD (its source
    read through git)."""
    from pagoda.bench.q4_linear import SHAPES, main
    from pagoda.layers.q4_linear import q4_library

    reads = spy_git_reads(monkeypatch, q4_library)
    (out,) = run_module(main, ["--rows", "2", "--iters", "1", "--versus-rev", "HEAD"], capsys, monkeypatch)
    assert ("q4_gemm.cpp", "HEAD") in reads
    results = out["results"]
    assert [(r["in"], r["out"]) for r in results] == list(SHAPES)
    for r in results:
        assert r["versus_rev_us"] > 0
        assert r["versus_over_q4_1"] == pytest.approx(r["versus_rev_us"] / r["q4_1_us"], rel=0.25)  # of rounded times


def test_issue_rates_reports_each_mix_and_the_openmp_costs(capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.bench.issue_rates import MIXES, main

    (out,) = run_module(main, ["--steps", "20000", "--omp-steps", "200", "--repeats", "1"], capsys, monkeypatch)
    assert out["omp_region_us"] > 0 and out["omp_barrier_us"] > 0
    assert out["add_chain_ghz"] is None or out["add_chain_ghz"] > 0
    if out["vpdpbusd_per_s"] is None:  # a CPU (or compiler target) without AVX-512 VNNI: the mixes are not built
        return
    assert out["vpdpbusd_per_s"] > 0 and out["fma_per_s"] > 0
    assert set(out["cycles_per_8_vpdpbusd"]) == set(MIXES.values())
    assert all(c > 0 for c in out["cycles_per_8_vpdpbusd"].values())


def test_decode_attention_versus_a_plain_read_and_shared_blocks(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """--versus-read reports a plain read of the context's bytes alongside the kernel, and their ratio; `shared`
    tables give every sequence the same blocks."""
    import torch

    from pagoda.bench.decode_attention import block_tables, main

    shared = block_tables(4, 3, 24, "shared", torch.Generator().manual_seed(0))
    assert shared.tolist() == [[0, 1, 2]] * 4
    rows = run_module(main, ["--num-seqs", "3", "--context", "20:40", "--iters", "1", "--backends", "cpp",
                             "--block-order", "shared", "--versus-read", "--kernel-only"], capsys, monkeypatch)
    r = rows[0]
    assert r["block_order"] == "shared" and r["ms_per_call"] > 0 and r["read_ms_per_layer"] > 0
    assert r["this_over_read"] > 0 and r["read_gb_per_s_plain"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiles_bench_checks_the_kernels_output(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                               dtype: str) -> None:
    """bench.f32_tiles times the engine's tile kernel of the dtype against oneDNN's packed weight (where oneDNN
    packs it), in bfloat16 F.linear, and at 1-4 rows the GEMV; the tiles' output is F.linear's up to rounding."""
    import torch

    from pagoda.bench.f32_tiles import main
    from pagoda.layers.linear import packable_rows

    rows = run_module(main, ["--rows", "1,13", "--iters", "1", "--dtype", dtype], capsys, monkeypatch)
    assert [r["rows"] for r in rows] == [1] * 5 + [13] * 5 and all(r["dtype"] == dtype for r in rows)
    assert all(r["max_abs_diff"] < (0.05 if dtype == "bfloat16" else 1e-4) for r in rows)
    assert all(("onednn_packed_ms" in r) == (packable_rows(getattr(torch, dtype)) is not None) for r in rows)
    assert all(("gemv_ms" in r) == (r["rows"] == 1) for r in rows)
