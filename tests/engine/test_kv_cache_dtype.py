"""kv_cache_dtype: the engine end to end with an int8 / fp8 or a 16-bit KV cache on a tiny model, capacity from
the plan, validation, and `pagoda kv-calc --kv-cache-dtype`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.config import CacheConfig, EngineConfig
from pagoda.entrypoints.cli import main
from pagoda.model.llama import ArchConfig
from pagoda.worker.host_memory import huge_pages_enabled
from pagoda.worker.kv_cache import allocate_kv_cache, plan_kv_cache
from tests.conftest import make_tiny_model, resident_pages

# SmolLM2-135M's attention shape: 30 layers, 3 kv heads of 64.
SMOLLM2 = ArchConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                     num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5, rope_scaling=None,
                     max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False, qk_norm=False)
BUDGET = 512 * 2**20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.mark.parametrize("kv_cache_dtype,granularity", [("int8", "token"), ("fp8", "token"), ("int8", "block"),
                                                        ("fp8", "block")])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_engine_generates_and_frees_every_block(model_dir: Path, kv_cache_dtype: str, granularity: str,
                                                dtype: str) -> None:
    llm = LLM(str(model_dir), dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_scale_granularity=granularity,
              kv_cache_memory="1MiB", max_num_batched_tokens=48, max_model_len=512)
    cache = llm.engine.runner.kv_caches[0]
    assert cache.k.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_cache_dtype]
    assert cache.k_scale is not None and cache.k_scale.dtype == torch.float16
    # Prompts longer than the step budget (chunked prefill), shorter ones, and decodes in between.
    prompts = [[(7 * i + j) % 250 for j in range(n)] for i, n in enumerate([5, 60, 17, 120, 1, 33])]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        assert out.finished and len(out.token_ids) == 20
        assert out.outputs[0].logprobs is not None
        assert all(v == v and v <= 0 for entry in out.outputs[0].logprobs for v in entry.values())  # no NaN
    metrics = llm.get_metrics()
    assert metrics["kv_blocks_in_use"] == 0
    llm.engine.kv.check_invariants()


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("backend", ["sdpa", "cpp"])
def test_16_bit_cache_under_a_float32_model(model_dir: Path, kv_cache_dtype: str, backend: str) -> None:
    """Chunked prompts and decodes over a bfloat16 / float16 cache: no scales, every block freed, and the greedy
    tokens' logprobs close to a float32 cache's."""
    prompts = [[(7 * i + j) % 250 for j in range(n)] for i, n in enumerate([5, 60, 17, 120, 1, 33])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = {}
    for kv in ("auto", kv_cache_dtype):
        llm = LLM(str(model_dir), dtype="float32", kv_cache_dtype=kv, attention_backend=backend,
                  kv_cache_memory="1MiB", max_num_batched_tokens=48, max_model_len=512)
        cache = llm.engine.runner.kv_caches[0]
        assert cache.k.dtype == getattr(torch, "float32" if kv == "auto" else kv) and cache.k_scale is None
        outs[kv] = llm.generate(prompts, params, use_tqdm=False)
        assert llm.get_metrics()["kv_blocks_in_use"] == 0
        llm.engine.kv.check_invariants()
    for ref, out in zip(outs["auto"], outs[kv_cache_dtype], strict=True):
        assert len(out.token_ids) == 12
        # the first token comes from the prompt step; its logprob shows the cache's rounding alone
        first_ref, first = ref.outputs[0].logprobs[0], out.outputs[0].logprobs[0]
        token = ref.token_ids[0]
        assert out.token_ids[0] == token and first[token] == pytest.approx(first_ref[token], abs=0.05)


def test_16_bit_cache_under_the_compiled_forward(model_dir: Path) -> None:
    """--compile-model over a float16 cache: the compiled forward writes and reads it through the attention op
    (the one-stream graph, which holds caches of the model's dtype, is left out) and gives the eager
    forward's tokens. A float64 model, as in test_correctness, so that the two forwards' own rounding cannot
    flip a near tie."""
    prompts = [[(7 * i + j) % 250 for j in range(n)] for i, n in enumerate([5, 60, 17])]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = []
    for compile_model in (False, True):
        llm = LLM(str(model_dir), dtype="float64", kv_cache_dtype="float16", compile_model=compile_model,
                  kv_cache_memory="1MiB", max_num_batched_tokens=48)
        model = llm.engine.model
        assert (model.compiled_forward is not None) == compile_model and model.compiled_one_stream is None
        outs.append(llm.generate(prompts, params, use_tqdm=False))
        assert llm.get_metrics()["kv_blocks_in_use"] == 0
    for eager, compiled in zip(*outs, strict=True):
        assert compiled.token_ids == eager.token_ids


def test_int8_prompt_logprobs_close_to_the_unquantized_cache(model_dir: Path) -> None:
    prompt = [(13 * j) % 250 for j in range(200)]
    params = SamplingParams(prompt_logprobs=0, max_tokens=1)
    got = {}
    for kv in ("auto", "int8", "fp8"):
        out = LLM(str(model_dir), kv_cache_dtype=kv, kv_cache_memory="1MiB").generate(prompt, params, use_tqdm=False)[0]
        assert out.prompt_logprobs is not None
        got[kv] = torch.tensor([e[t] for e, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)
                                if e is not None])
    assert len(got["auto"]) == len(prompt) - 1
    # The tiny model has large random weights (sharp logits), so this is loose; BENCHMARKS.md has the real model.
    assert float((got["int8"] - got["auto"]).abs().mean()) < 0.05
    assert float((got["fp8"] - got["auto"]).abs().mean()) < 0.25


def test_capacity_grows_with_quantization() -> None:
    def tokens(dtype: torch.dtype, kv: str, granularity: str = "token") -> int:
        return plan_kv_cache(SMOLLM2, dtype, 16, BUDGET, kv, granularity).num_tokens

    f32, bf16, f16 = tokens(torch.float32, "auto"), tokens(torch.bfloat16, "auto"), tokens(torch.float16, "auto")
    # a 16-bit cache under a float32 model: twice the tokens, as a 16-bit model's
    assert tokens(torch.float32, "bfloat16") == tokens(torch.float32, "float16") == bf16 == 2 * f32
    for kv in ("int8", "fp8"):
        for granularity in ("token", "block"):
            # The KV dtype, not the model dtype, decides the capacity.
            assert tokens(torch.float32, kv, granularity) == tokens(torch.bfloat16, kv, granularity)
            q = tokens(torch.float32, kv, granularity)
            assert q / f32 >= 3.8 and q / bf16 >= 1.9 and q / f16 >= 1.9
    # Per (token, head): 64 + 2 bytes instead of 256; per (block, head) a little more.
    assert tokens(torch.float32, "int8") / f32 == pytest.approx(256 / 66, rel=0.01)
    assert tokens(torch.float32, "int8", "block") > tokens(torch.float32, "int8")


@pytest.mark.parametrize("kv,granularity", [("auto", "token"), ("int8", "token"), ("fp8", "block")])
def test_allocation_matches_the_plan(kv: str, granularity: str) -> None:
    arch = SMOLLM2
    plan = plan_kv_cache(arch, torch.float32, 16, 4 * 2**20, kv, granularity)
    caches = allocate_kv_cache(arch, plan, torch.float32)
    assert len(caches) == arch.num_layers
    allocated = sum(t.numel() * t.element_size() for c in caches for t in (c.k, c.v, c.k_scale, c.v_scale)
                    if t is not None)
    assert allocated == plan.num_blocks * plan.bytes_per_block <= plan.budget_bytes
    assert plan.scale_bytes_per_block == (0 if kv == "auto" else allocated // plan.num_blocks - 16 * 3 * 64 * 60)


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_prefault_backs_every_page_of_the_cache(kv: str) -> None:
    """Without prefault no page is backed before its first write, and none of them will be a huge page
    (kv_cache._zeros says why); with it every page is backed at once, on huge pages where the system has them."""
    from tests.engine.test_host_memory import _advised, _anon_huge_kib

    plan = plan_kv_cache(SMOLLM2, torch.float32, 16, 8 * 2**20, kv, "token")
    for prefault in (False, True):
        caches = allocate_kv_cache(SMOLLM2, plan, torch.float32, prefault=prefault)
        for t in (t for c in caches for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None):
            resident, pages = resident_pages(t)
            assert resident == (pages if prefault else 0), (prefault, resident, pages)
            assert int(t.count_nonzero()) == 0
        k = caches[0].k
        assert _advised(k.data_ptr()) == (prefault and huge_pages_enabled())
        if not prefault:
            k.fill_(1)  # every page backed now, none of them huge
            assert _anon_huge_kib(k.data_ptr()) == 0


def test_bad_kv_cache_dtype_names_the_field(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, float16, int8, fp8"):
        LLM(str(model_dir), kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="float64")
    with pytest.raises(ValueError, match="kv_cache_dtype 'float32' needs a float32 model"):
        LLM(str(model_dir), dtype="bfloat16", kv_cache_dtype="float32")
    with pytest.raises(ValueError, match="kv_cache_scale_granularity"):
        EngineConfig.from_options(kv_cache_dtype="int8", kv_cache_scale_granularity="channel")
    assert EngineConfig.from_options(kv_cache_dtype="fp8").cache.kv_cache_dtype == "fp8"


def test_kv_calc_shows_the_quantized_capacity(capsys: pytest.CaptureFixture) -> None:
    def calc(*flags: str) -> dict:
        assert main(["kv-calc", "--kv-cache-memory", "512MiB", "--context-len", "2048", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    auto, int8 = calc(), calc("--kv-cache-dtype", "int8")
    # SmolLM2-135M: 30 layers x 2 x 3 kv heads x (64 x 1 byte + a 2-byte float16 scale)
    assert int8["bytes_per_token"] == 30 * 2 * 3 * (64 + 2) and int8["scale_bytes_per_token"] == 30 * 2 * 3 * 2
    assert int8["bytes_per_element"] == 1 and int8["kv_cache_storage"] == "int8 per token"
    assert int8["num_tokens"] / auto["num_tokens"] >= 3.8
    assert main(["kv-calc", "--kv-cache-memory", "512MiB", "--kv-cache-dtype", "fp8"]) == 0
    assert "2 scale bytes" in capsys.readouterr().out
