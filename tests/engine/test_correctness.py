"""Greedy token ids identical to HF transformers on tiny random Llama / Qwen2 / Qwen3 models.

Three ways through the engine: one prompt at a time; all together under a small token budget
(chunked prefill mixed with decodes); and with a KV cache too small for all of them (preemption).
Compared in float64 so that near-ties cannot flip a token.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.layers.linear import packable_rows, tiles_library
from pagoda.model.llama import ArchConfig
from tests.conftest import check_greedy_against_reference, hf_greedy

# bfloat16 linears get packed weights: on the tiles where the build has AVX-512, else by oneDNN where it packs them
BF16_PACKED = bool(tiles_library().pagoda_bf16_tiles_enabled()) or packable_rows(torch.bfloat16) is not None

PROMPT_LENS = [1, 5, 17, 33, 64, 130, 300, 600]
MAX_NEW = 12


def prompts() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(tiny_model: tuple[str, Path]) -> list[tuple[list[int], list[float]]]:
    from transformers import AutoModelForCausalLM

    _, folder = tiny_model
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    return [hf_greedy(model, p, MAX_NEW) for p in prompts()]


def greedy_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


def check(outputs: list, reference: list[tuple[list[int], list[float]]]) -> None:
    # HF computes RMSNorm and rope angles in float32 even for a float64 model; we stay in float64.
    check_greedy_against_reference(outputs, reference, PROMPT_LENS, logprob_tol=1e-5)
    assert all(out.finish_reason == "length" for out in outputs)


def test_one_at_a_time(tiny_model: tuple[str, Path], reference: list) -> None:
    llm = LLM(str(tiny_model[1]), dtype="float64")
    outputs = [llm.generate([p], greedy_params(), use_tqdm=False)[0] for p in prompts()]
    check(outputs, reference)
    assert llm.get_metrics()["kv_blocks_in_use"] == 0


@pytest.mark.parametrize("backend", ["sdpa", "compiled", "torch"])
def test_all_together_with_chunked_prefill(tiny_model: tuple[str, Path], reference: list, backend: str) -> None:
    llm = LLM(str(tiny_model[1]), dtype="float64", max_num_batched_tokens=48, attention_backend=backend)
    outputs = llm.generate(prompts(), greedy_params(), use_tqdm=False)
    check(outputs, reference)
    assert llm.get_metrics()["num_steps"] > sum(PROMPT_LENS) // 48  # prompts really were chunked
    assert llm.get_metrics()["kv_blocks_in_use"] == 0


def test_compiled_forward_with_chunked_prefill(tiny_model: tuple[str, Path], reference: list) -> None:
    """--compile-model: the forward pass compiled by torch.compile, attention as an opaque op; then one
    prompt at a time, whose decode steps run the one-stream graph (attention inside the graph)."""
    llm = LLM(str(tiny_model[1]), dtype="float64", max_num_batched_tokens=48, compile_model=True)
    model = llm.engine.model
    assert model.compiled_forward is not None and model.compiled_one_stream is not None
    outputs = llm.generate(prompts(), greedy_params(), use_tqdm=False)
    check(outputs, reference)
    assert llm.get_metrics()["kv_blocks_in_use"] == 0

    graph, calls = model.compiled_one_stream, []
    model.compiled_one_stream = lambda *args: calls.append(1) or graph(*args)
    outputs = [llm.generate([p], greedy_params(), use_tqdm=False)[0] for p in prompts()]
    check(outputs, reference)
    # every decode step after each first token, and single-token prompt steps (prefix-cache hits)
    assert len(calls) >= len(PROMPT_LENS) * (MAX_NEW - 1)


@pytest.mark.parametrize("backend", ["sdpa", "compiled"])
def test_all_together_with_preemption(tiny_model: tuple[str, Path], reference: list, backend: str) -> None:
    arch = ArchConfig.from_hf(json.loads((tiny_model[1] / "config.json").read_text()))
    budget = arch.kv_bytes_per_token(8) * 800  # 50 blocks of 16: the longest fits, not all at once
    llm = LLM(str(tiny_model[1]), dtype="float64", kv_cache_memory=budget, max_num_batched_tokens=256,
              attention_backend=backend)
    outputs = llm.generate(prompts(), greedy_params(), use_tqdm=False)
    check(outputs, reference)
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0
    assert metrics["kv_blocks_in_use"] == 0


def test_prepack_weights_by_default_for_small_float32_and_bfloat16_models(tiny_model: tuple[str, Path],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """prepack_weights left to the engine: float32 and bfloat16 models are packed (bfloat16 where BF16_PACKED),
    float64 and q4_1 ones not, nor a model whose packing would add more than PREPACK_AUTO_MAX_BYTES (on the tiles
    none adds anything: the plain weights are freed, a tied lm_head's too); asking decides either way."""
    from torch import nn

    import pagoda.layers.linear as linear
    from pagoda.layers.q4_linear import is_quantized

    def packed(**kwargs: object) -> bool:
        model = LLM(str(tiny_model[1]), **kwargs).engine.model
        return any(linear.is_packed(m) for m in model.modules() if isinstance(m, nn.Linear))

    assert packed(dtype="bfloat16") == BF16_PACKED and packed(dtype="float32") and not packed(dtype="float64")
    q4_model = LLM(str(tiny_model[1]), dtype="float32", quantization="q4_1").engine.model
    quantized = [m for m in q4_model.modules() if isinstance(m, nn.Linear) and is_quantized(m)]
    assert quantized and not any(linear.is_packed(m) for m in quantized)  # only float layers get a packed copy
    assert not packed(dtype="float32", prepack_weights=False) and not packed(dtype="bfloat16", prepack_weights=False)
    monkeypatch.setattr(linear, "PREPACK_AUTO_MAX_BYTES", 1024)
    # on the tiles nothing is copied (the tiny qwen2's tied embedding reads the lm_head's tiles); on oneDNN's packing
    # (bfloat16 in AVX2 builds) every weight is
    assert packed(dtype="float32") and packed(dtype="float32", prepack_weights=True)
    assert packed(dtype="bfloat16") == bool(tiles_library().pagoda_bf16_tiles_enabled())
    assert packed(dtype="bfloat16", prepack_weights=True) == BF16_PACKED


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not BF16_PACKED, reason="no bfloat16 tiles (AVX2 build) and oneDNN does not pack bfloat16 on this CPU"))])
def test_prepacked_weights_match_plain(tiny_model: tuple[str, Path], dtype: str) -> None:
    """--prepack-weights: packed linears (the tiles at every step; bfloat16 on AVX-512 builds, else oneDNN's
    1-1024-token steps where it packs bfloat16) give the plain engine's greedy tokens, and logprobs equal up to
    float rounding."""
    from torch import nn

    from pagoda.layers.linear import is_packed

    kwargs = {"dtype": dtype, "max_num_batched_tokens": 48}
    plain = LLM(str(tiny_model[1]), prepack_weights=False, **kwargs).generate(prompts(), greedy_params(),
                                                                                use_tqdm=False)
    packed_llm = LLM(str(tiny_model[1]), prepack_weights=True, **kwargs)
    linears = [m for m in packed_llm.engine.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(is_packed(m) for m in linears)  # every linear got the packed path
    packed = packed_llm.generate(prompts(), greedy_params(), use_tqdm=False)
    for a, b in zip(plain, packed, strict=True):
        assert b.token_ids == a.token_ids
        chosen = [[lp[t] for lp, t in zip(o.logprobs, o.token_ids, strict=True)] for o in (a, b)]
        assert chosen[1] == pytest.approx(chosen[0], abs=1e-4 if dtype == "float32" else 2e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_elementwise_ops_match_torch_ops(tiny_model: tuple[str, Path], dtype: str) -> None:
    """The fused C++ elementwise ops (the default for float32 and 16-bit models) give the greedy tokens of
    the same engine with torch ops (--no-fused-ops), and logprobs equal up to float rounding. In bfloat16
    that is up to 0.03 on these random models: rotary and SiLU-and-multiply match torch's bit for bit in the
    model, but RMSNorm's float32 sum of squares, added in another order, sometimes rounds to the other
    bfloat16 neighbour."""
    kwargs = {"dtype": dtype, "max_num_batched_tokens": 48}
    plain_llm = LLM(str(tiny_model[1]), fused_ops=False, **kwargs)
    fused_llm = LLM(str(tiny_model[1]), **kwargs)
    assert plain_llm.engine.model.ops.lib is None and fused_llm.engine.model.ops.lib is not None
    plain = plain_llm.generate(prompts(), greedy_params(), use_tqdm=False)
    fused = fused_llm.generate(prompts(), greedy_params(), use_tqdm=False)
    for a, b in zip(plain, fused, strict=True):
        assert b.token_ids == a.token_ids
        chosen = [[lp[t] for lp, t in zip(o.logprobs, o.token_ids, strict=True)] for o in (a, b)]
        assert chosen[1] == pytest.approx(chosen[0], abs=1e-4 if dtype == "float32" else 5e-2)
