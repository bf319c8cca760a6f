"""The one-call decode step (pagoda/model/one_stream.py) gives the eager forward's results bit for bit, is used for
exactly the steps that are one sequence's decode (any number of decodes alone, for a quantized model), and is left
out where its kernels are."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.model.one_stream import OPS, OneStreamForward

PROMPT_LENS = [1, 7, 16, 17, 40, 130]  # one, several and many blocks of 16, a block boundary


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENS]


def _generate(llm: LLM, seeded: bool) -> list[tuple[list[int], list[float]]]:
    out = []
    for i, prompt in enumerate(_prompts()):
        params = (SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True, logprobs=0) if seeded
                  else SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0))
        (res,) = llm.generate([prompt], params, use_tqdm=False)
        completion = res.outputs[0]
        out.append((list(completion.token_ids), [lp[t] for lp, t in zip(completion.logprobs, completion.token_ids,
                                                                          strict=True)]))
    return out


def _count_rows(model: object, rows: list[int]) -> None:
    """Wraps the model's one-call forward: each step offered to it appends the rows it took to rows (0: declined)."""
    one_call = model.one_stream_forward  # type: ignore[attr-defined]

    def counted(input_ids: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        out = one_call(input_ids, *args)
        rows.append(0 if out is None else input_ids.shape[0])
        return out

    model.one_stream_forward = type("Counted", (), {"__call__": staticmethod(counted)})()  # type: ignore[attr-defined]


def _many_decodes(llm: LLM, n: int, seed: int) -> Callable[[], list[tuple[list[int], list[dict[int, float]]]]]:
    """generate() for n requests of 8-token prompts (all in the first step, so every decode step has n rows), seeded
    sampling of 8 tokens each: their token ids and logprobs."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(8)] for _ in range(n)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=8, ignore_eos=True, logprobs=1) for i in range(n)]

    def generate() -> list[tuple[list[int], list[dict[int, float]]]]:
        return [(list(r.outputs[0].token_ids), list(r.outputs[0].logprobs or []))
                for r in llm.generate(prompts, params, use_tqdm=False)]

    return generate


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float32+q4_1", "float32+q4_1/bfloat16",
                                   "float32+q8_0", "float32+q8_0/float32", "float32/float16", "float32+q4_1/int8",
                                   "bfloat16/int8"])
@pytest.mark.parametrize("seeded", [False, True])
def test_matches_the_eager_forward_exactly(tiny_model: tuple[str, Path], seeded: bool, dtype: str) -> None:
    """float32+q4_1 (+q8_0): the linears through the Q4_1 (Q8_0) kernel's GEMV-shaped entry point, the KV cache
    float16 (what auto is under a quantization); /float32, /bfloat16, /float16: a float32 model's KV cache in
    that dtype (K and V rounded on write); /int8: quantized on write, a scale per token (a bfloat16 model's rows
    widened to float32 first, in the loop as in the eager path)."""
    arch, folder = tiny_model
    dtype, _, kv_cache_dtype = dtype.partition("/")
    dtype, _, quantization = dtype.partition("+")
    # no prefix caching: the second run's prompt steps would start from the first's blocks
    llm = LLM(str(folder), dtype=dtype, attention_backend="cpp", enable_prefix_caching=False,
              quantization=quantization or "none", kv_cache_dtype=kv_cache_dtype or "auto")
    want_cache = kv_cache_dtype or ("float16" if quantization else dtype)
    assert llm.engine.runner.kv_caches[0].k.dtype == getattr(torch, want_cache)
    model = llm.engine.model
    assert model.one_stream_forward is not None
    rows: list[int] = []
    _count_rows(model, rows)
    with_it = _generate(llm, seeded)
    model.one_stream_forward = None
    eager = _generate(llm, seeded)
    assert with_it == eager  # token ids and logprobs, exactly
    # taken for every decode step (23 per request) and the one-token prompt, declined for the other prompts
    assert len(rows) == len(PROMPT_LENS) * 24 and rows.count(1) == len(PROMPT_LENS) * 23 + 1
    assert rows.count(0) == len(PROMPT_LENS) - 1


@pytest.mark.parametrize("quantization", ["q4_1", "q8_0"])
def test_quantized_mlp_fuses_gate_up_with_silu_mul(tiny_model: tuple[str, Path], quantization: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Under q4_1 and q8_0 the eager MLP takes its two projections in one call (pagoda_packed_mlp, the gate_up
    projection fused with SiLU-and-multiply and then down) for steps of SILU_MUL_FUSED_MIN_ROWS rows or more (here
    lowered to 2: the prompts' steps, not the one-row decodes), and of the AMX tiles' fewest rows or more where the
    CPU has them; the tokens and logprobs are those of the fused gate_up and then down as two calls
    (pagoda_q4/q8_linear_silu_mul), and of the unfused path, exactly."""
    from pagoda.layers import q4_linear

    _, folder = tiny_model
    llm = LLM(str(folder), dtype="float32", attention_backend="cpp", enable_prefix_caching=False,
              quantization=quantization)
    model = llm.engine.model
    packed = [q4_linear.packed_of(layer.mlp.gate_up_proj) for layer in model.model.layers]
    assert all(p is not None and p.silu_mul_kernel is not None for p in packed)
    model.one_stream_forward = None  # every step through the eager MLP
    calls: list[tuple[str, int]] = []
    cls = type(packed[0])
    real_mlp, real_silu_mul, real_after_norm = cls.mlp, cls.silu_mul, cls.after_norm
    monkeypatch.setattr(q4_linear, "SILU_MUL_FUSED_MIN_ROWS", 2)
    monkeypatch.setattr(cls, "mlp", lambda self, x, down: calls.append(("mlp", x.shape[0])) or real_mlp(self, x, down))

    def after_norm(self: q4_linear.PackedLinear, x: torch.Tensor, *args: object) -> object:
        if len(args) > 3 and args[3] is not None:  # the MLP, with the norm ahead of it (norm_mlp)
            calls.append(("mlp", x.shape[0]))
        return real_after_norm(self, x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cls, "after_norm", after_norm)
    monkeypatch.setattr(cls, "silu_mul",
                        lambda self, x: calls.append(("silu_mul", x.shape[0])) or real_silu_mul(self, x))
    fused = _generate(llm, seeded=False)
    prompts = [n for n in PROMPT_LENS if n >= 2]  # each prompt of 2 tokens or more in one step, every layer
    assert sorted(calls) == sorted(("mlp", n) for n in prompts for _ in model.model.layers)
    calls.clear()
    # above SILU_MUL_FUSED_MIN_ROWS, the MLP is still one call from the AMX tiles' fewest rows (where the CPU has them)
    monkeypatch.setattr(q4_linear, "SILU_MUL_FUSED_MIN_ROWS", 10**9)
    assert _generate(llm, seeded=False) == fused
    amx = packed[0].amx_rows
    assert sorted(calls) == sorted(("mlp", n) for n in PROMPT_LENS if 0 < amx <= n for _ in model.model.layers)
    monkeypatch.setattr(q4_linear, "SILU_MUL_FUSED_MIN_ROWS", 2)
    calls.clear()
    monkeypatch.setattr(cls, "fuses_mlp_with", lambda self, down: False)  # gate_up with SiLU, then down: two calls
    assert _generate(llm, seeded=False) == fused
    assert sorted(calls) == sorted(("silu_mul", n) for n in prompts for _ in model.model.layers)
    for p in packed:
        p.silu_mul_kernel = None  # the MLP falls back to the projection, then the elementwise op
    assert _generate(llm, seeded=False) == fused


@pytest.mark.parametrize("quantization", ["q4_1", "q8_0"])
def test_quantized_norms_fuse_with_the_linear_after_them(tiny_model: tuple[str, Path], quantization: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Under q4_1 and q8_0 the eager forward runs each RMSNorm in one call with the qkv projection or the MLP after
    it (DecoderLayer's norm_qkv and norm_mlp: PackedLinear.after_norm) for steps the AMX tiles take; the tokens and
    logprobs are those of the norms' own calls exactly. Here every layer's threshold is lowered to 1 row, so that
    CPUs without AMX run the fused calls too (their scratch-buffer path)."""
    from pagoda.layers import q4_linear

    _, folder = tiny_model
    llm = LLM(str(folder), dtype="float32", attention_backend="cpp", enable_prefix_caching=False,
              quantization=quantization)
    model = llm.engine.model
    model.one_stream_forward = None  # every step through the eager forward
    for module in model.modules():
        if (p := q4_linear.packed_of(module)) is not None:
            p.amx_rows = 1
    calls: list[int] = []
    cls = type(q4_linear.packed_of(model.model.layers[0].self_attn.qkv_proj))
    real_after_norm = cls.after_norm
    monkeypatch.setattr(cls, "after_norm", lambda self, x, *args: calls.append(x.shape[0]) or real_after_norm(
        self, x, *args))
    fused = _generate(llm, seeded=False)
    steps = len(PROMPT_LENS) * 24  # a request's prompt step and 23 decodes, each alone
    assert len(calls) == 2 * steps * len(model.model.layers)
    monkeypatch.setattr(cls, "takes_norm", lambda self, *args: False)
    assert _generate(llm, seeded=False) == fused


def test_declines_more_decodes_than_the_gemv_takes(tiny_model: tuple[str, Path]) -> None:
    """Without tiles (--no-prepack-weights), five sequences decoding together (the GEMV takes 1-4 rows; oneDNN's
    matmuls more) run the eager forward, and give what each gives alone (which the one-call forward computes)."""
    arch, folder = tiny_model
    # no prefix caching: a prompt the first run cached could come back as a one-token step
    llm = LLM(str(folder), dtype="bfloat16", attention_backend="cpp", enable_prefix_caching=False,
              prepack_weights=False)
    forward = llm.engine.model.one_stream_forward
    assert forward is not None
    rows: list[int] = []
    _count_rows(llm.engine.model, rows)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(_prompts()[1:6], params, use_tqdm=False)]
    assert 0 in rows and max(rows) <= 4  # the 5-decode steps declined
    rows.clear()
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in _prompts()[1:6]]
    assert together == alone
    assert rows.count(1) == 5 * 9  # each alone: its 9 decode steps in the one call


@pytest.mark.parametrize("kwargs, reason", [
    (dict(dtype="float16"), "not bfloat16 or float32"),
    (dict(dtype="bfloat16", attention_backend="sdpa"), "not the cpp kernel"),
    (dict(dtype="float32", kv_cache_dtype="int8", kv_cache_scale_granularity="block"), "KV cache"),
    (dict(dtype="float32", kv_cache_dtype="fp8"), "int8 per token (--kv-cache-dtype int8) is the faster"),
    (dict(dtype="bfloat16", kv_cache_dtype="float16"), "KV cache"),
    (dict(dtype="bfloat16", fused_ops=False), "fused elementwise ops are off"),
])
def test_left_out_where_its_kernels_are(tiny_model: tuple[str, Path], caplog: pytest.LogCaptureFixture,
                                        kwargs: dict, reason: str) -> None:
    _, folder = tiny_model
    with caplog.at_level("INFO", logger="pagoda.model.one_stream"):
        llm = LLM(str(folder), **kwargs)
    assert llm.engine.model.one_stream_forward is None
    assert any(reason in r.getMessage() for r in caplog.records) or kwargs.get("fused_ops") is False


@pytest.mark.parametrize("dtype", ["float32+q4_1", "float32+q8_0/float32", "float32+q4_1/bfloat16", "bfloat16",
                                   "float32", "float32/float16", "float32/int8", "bfloat16/int8"])
@pytest.mark.parametrize("seeded", [False, True])
def test_batched_decode_steps_match_the_eager_forward(tiny_model: tuple[str, Path], seeded: bool, dtype: str) -> None:
    """Steps that are decodes alone, up to 4 of them (the GEMV's rows; any number for a quantized model), go through
    the one call and give what the eager forward gives, bit for bit: sequences of different lengths decoding together,
    the batch shrinking as they finish (max_tokens differ) and growing as a later one joins (max_num_seqs 4 of 6
    requests)."""
    arch, folder = tiny_model
    dtype, _, kv_cache_dtype = dtype.partition("/")
    dtype, _, quantization = dtype.partition("+")
    llm = LLM(str(folder), dtype=dtype, attention_backend="cpp", enable_prefix_caching=False, max_num_seqs=4,
              quantization=quantization or "none", kv_cache_dtype=kv_cache_dtype or "auto")
    model = llm.engine.model
    forward = model.one_stream_forward
    assert forward is not None and forward.max_rows >= 4
    rows: list[int] = []
    params = [SamplingParams(temperature=0.8 if seeded else 0.0, seed=i, max_tokens=6 + 3 * i, ignore_eos=True,
                             logprobs=1) for i in range(len(PROMPT_LENS))]

    def generate() -> list[tuple[list[int], list[dict[int, float]]]]:
        return [(list(r.outputs[0].token_ids), list(r.outputs[0].logprobs or []))
                for r in llm.generate(_prompts(), params, use_tqdm=False)]

    _count_rows(model, rows)
    with_it = generate()
    model.one_stream_forward = None
    eager = generate()
    assert with_it == eager  # token ids and logprobs, exactly
    taken = [r for r in rows if r]  # the prompt steps are declined
    assert max(taken) == 4 and 1 in taken and len(set(taken)) >= 3  # full batches, shrinking ones, a last sequence


@pytest.mark.parametrize("prepack", [True, False])
@pytest.mark.parametrize("quantization", ["q4_1", "q8_0"])
def test_quantized_decode_steps_of_many_rows(tiny_model: tuple[str, Path], quantization: str, prepack: bool) -> None:
    """Under q4_1 and q8_0, one-call steps of more decodes than the GEMV's rows give the eager forward's tokens and
    logprobs, exactly: the tiny models' lm_head (a vocabulary of 300, not whole tiles of 16) is not quantized but
    float32; packed (the default) it runs on the float32 tiles in the call; without prepack it is the GEMV's, which
    takes 1-4 rows, so these steps leave it to the caller (in the call, the rows past 4 had been left
    unwritten). On a CPU with AMX tiles, steps of amx_min_rows decodes or more run each layer's MLP as one call
    (pagoda_packed_mlp: no time in silu_mul or down_proj); without the tiles the separate calls stay. Either way each
    norm goes in one call with the linear or the MLP after it."""
    from pagoda.layers.q4_linear import amx_min_rows, packed_of, q4_library

    arch, folder = tiny_model
    llm = LLM(str(folder), dtype="float32", attention_backend="cpp", enable_prefix_caching=False,
              quantization=quantization, max_num_seqs=64, prepack_weights=prepack)
    model = llm.engine.model
    forward = model.one_stream_forward
    least = amx_min_rows(q4_library())
    assert forward is not None and forward.mlp_min_rows == least and packed_of(model.lm_head) is None
    assert forward.fused_norms  # pagoda_norm_linear (and _mlp with the MLP's call)
    generate = _many_decodes(llm, max(least, 5) + 4, seed=3)
    prof = llm.engine.enable_profiling()
    with_it = generate()
    report = prof.report()
    assert prof.counts["forward/one_call"] == 7  # the decode steps
    ms = {op: report.get(f"forward/one_call/{op}", {}).get("ms_per_step", 0.0) for op in OPS}
    assert ms["gate_up_proj"] > 0 and (ms["lm_head"] > 0) == prepack  # in the call, or the caller's
    assert (ms["silu_mul"] == 0 and ms["down_proj"] == 0) if least else (ms["silu_mul"] > 0 and ms["down_proj"] > 0)
    model.one_stream_forward = None
    assert generate() == with_it


@pytest.mark.parametrize(("dtype", "kv_cache_dtype"), [("float32", "auto"), ("float32", "float16"),
                                                       ("bfloat16", "auto")])
def test_decode_steps_on_tiles(tiny_model: tuple[str, Path], dtype: str, kv_cache_dtype: str) -> None:
    """A float32 model with packed weights (the default), or a bfloat16 one where the build has AVX-512, runs its
    linears on f32_tiles.cpp's kernels at every row count, and so its decode steps of any number of sequences go
    through the one call, lm_head included (the tiny vocabulary of 300 ends in a part panel), with the eager
    forward's tokens and logprobs, exactly. The tiny qwen2's tied embedding reads its rows from the lm_head's tiles,
    in the call as in the eager forward."""
    from pagoda.layers.linear import tiles_library, tiles_of
    from pagoda.layers.tied_embedding import TiedEmbedding

    arch, folder = tiny_model
    if dtype == "bfloat16" and not tiles_library().pagoda_bf16_tiles_enabled():
        pytest.skip("an AVX2 build: bfloat16 linears stay on the GEMV and oneDNN")
    llm = LLM(str(folder), dtype=dtype, attention_backend="cpp", enable_prefix_caching=False, max_num_seqs=64,
              kv_cache_dtype=kv_cache_dtype)
    model = llm.engine.model
    forward = model.one_stream_forward
    assert tiles_of(model.lm_head) is not None and forward is not None and forward.max_rows > 64
    assert isinstance(model.model.embed_tokens, TiedEmbedding) == (arch == "qwen2")
    n = 9
    generate = _many_decodes(llm, n, seed=5)
    rows: list[int] = []
    prof = llm.engine.enable_profiling()
    _count_rows(model, rows)
    with_it = generate()
    assert prof.counts["forward/one_call"] == 7 and [r for r in rows if r] == [n] * 7
    assert prof.report()["forward/one_call/lm_head"]["ms_per_step"] > 0  # in the call
    model.one_stream_forward = None
    assert generate() == with_it


def test_a_q8_0_embedding_read_from_the_lm_heads_records(tmp_path: Path) -> None:
    """A tied model whose embedding is Q8_0 (as the default model's; here the tiny qwen2's rounded so, its vocabulary
    whole tiles of 16) under q4_1: the lm_head's Q8_0 records hold the embedding exactly, so its float weight is
    freed and the embedding reads its rows from the records, in the one call as in the eager forward: the same
    tokens and logprobs."""
    from pagoda.layers.tied_embedding import Q8_0, TiedEmbedding
    from tests.conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "q8", "qwen2", vocab=320, q8_embedding=True)
    llm = LLM(str(folder), dtype="float32", attention_backend="cpp", enable_prefix_caching=False,
              quantization="q4_1", max_num_seqs=64)
    model = llm.engine.model
    embed = model.model.embed_tokens
    assert isinstance(embed, TiedEmbedding) and embed.layout == Q8_0 and model.lm_head.weight.numel() == 0
    assert model.one_stream_forward is not None
    generate = _many_decodes(llm, 6, seed=4)
    with_it = generate()
    model.one_stream_forward = None
    assert generate() == with_it


def test_applies_to_decode_steps_only() -> None:
    """Decodes alone, up to max_rows of them (1 here, as a test of the limit); a prompt chunk, alone or with decodes:
    never."""
    from pagoda.layers.attention.backend import build_attention_metadata

    def meta(seqs: list[tuple[list[int], int, int]]) -> object:  # as the cpp backend groups them: one decode group
        return build_attention_metadata(seqs, 16, float("inf"))

    one = meta([([0, 1], 20, 1)])
    two = meta([([0, 1], 20, 1), ([2], 5, 1)])
    prompt = meta([([0, 1], 0, 20)])
    mixed = meta([([0, 1], 20, 1), ([2], 0, 5)])
    single, batched = SimpleNamespace(max_rows=1), SimpleNamespace(max_rows=4)
    assert OneStreamForward.applies(single, one) and OneStreamForward.applies(batched, one)  # type: ignore[arg-type]
    assert OneStreamForward.applies(batched, two)  # type: ignore[arg-type]
    assert not OneStreamForward.applies(single, two)  # type: ignore[arg-type]
    for step in (prompt, mixed):
        assert not any(OneStreamForward.applies(f, step) for f in (single, batched))  # type: ignore[arg-type]


def test_profile_times_one_call_steps_apart(tiny_model: tuple[str, Path]) -> None:
    """`--profile`: one-call steps run no module hooks, so their forward is its own row (forward/one_call), timed by
    kind of call inside it (forward/one_call/<kind>), and the by-kind rows hold only the other steps."""
    arch, folder = tiny_model
    llm = LLM(str(folder), dtype="float32", attention_backend="cpp")
    prof = llm.engine.enable_profiling()
    llm.generate([_prompts()[4]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert prof.counts["forward/one_call"] == 11  # each decode step; the prompt step runs the eager forward
    assert prof.counts["forward"] == 12
    report = prof.report()
    assert 0 < report["forward/one_call"]["ms_per_step"] <= report["forward"]["ms_per_step"]
    assert report["forward/attention"]["ms_per_step"] > 0  # the prompt step's
    inside = [report[f"forward/one_call/{op}"]["ms_per_step"] for op in OPS]
    assert all(ms > 0 for ms in inside)  # every kind of call ran, and was timed, in each of the 11 steps
    assert sum(inside) <= report["forward/one_call"]["ms_per_step"]
