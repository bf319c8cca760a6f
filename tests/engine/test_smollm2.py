"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers on the same weights.

transformers dequantizes the same GGUF file itself, so this checks our GGUF reader, tokenizer and
model together. Greedy ids must match exactly: one prompt at a time, all together under a small
token budget (chunked prefill), and with a KV cache small enough to force preemption. float64 on
both sides so that float32 near-ties cannot flip a token.
"""

from __future__ import annotations

import collections
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.model.loader import resolve_model_path
from tests.conftest import check_greedy_against_reference, hf_greedy

pytestmark = pytest.mark.slow

PROMPT_LENS = [1, 7, 20, 45, 100, 210, 400, 600]
MAX_NEW = 10


def corpus_text() -> str:
    """Real English text that ships with Python: stdlib module docs."""
    return "\n\n".join(textwrap.dedent(m.__doc__ or "") for m in (json, collections, textwrap, torch.nn.Module))


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float64", kv_cache_memory="128MiB")


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    ids = llm.get_tokenizer().encode(corpus_text())
    assert len(ids) > max(PROMPT_LENS) + 40
    return [ids[3 * i: 3 * i + n] for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def hf_model(gguf_path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def reference(hf_model: Any, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    return [hf_greedy(hf_model, p, MAX_NEW) for p in prompts]


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


def check(outputs: list, reference: list[tuple[list[int], list[float]]]) -> None:
    check_greedy_against_reference(outputs, reference, PROMPT_LENS, logprob_tol=1e-4)


def test_one_at_a_time(llm: LLM, prompts: list[list[int]], reference: list) -> None:
    check([llm.generate([p], params(), use_tqdm=False)[0] for p in prompts], reference)


def test_together_chunked(prompts: list[list[int]], reference: list) -> None:
    llm = LLM(dtype="float64", kv_cache_memory="128MiB", max_num_batched_tokens=64)
    check(llm.generate(prompts, params(), use_tqdm=False), reference)
    assert llm.get_metrics()["kv_blocks_in_use"] == 0


def test_together_with_preemption(prompts: list[list[int]], reference: list) -> None:
    # 92160 bytes/token in float64: 672 tokens hold the longest request, not all eight at once; a
    # small token budget admits prompts chunk by chunk, so running requests compete for blocks.
    llm = LLM(dtype="float64", kv_cache_memory=92160 * 672, max_num_batched_tokens=128)
    check(llm.generate(prompts, params(), use_tqdm=False), reference)
    assert llm.get_metrics()["num_preemptions"] > 0
    assert llm.get_metrics()["kv_blocks_in_use"] == 0
