"""Every bad value gets a ValueError that names the field and what is allowed."""

from __future__ import annotations

import math

import pytest

from pagoda.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, parse_size
from pagoda.model.loader import resolve_model_path
from pagoda.sampling_params import SamplingParams


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.1}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 10**6}, "n"),
    ({"seed": -1}, "seed"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": math.inf}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 1000.0}}, "logit_bias"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"max_tokens": 2.5}, "max_tokens"),
])
def test_sampling_params_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_greedy() -> None:
    p = SamplingParams(temperature=0, stop="x", logit_bias={"7": 1})
    assert p.greedy and p.stop_strings == ["x"] and p.logit_bias == {7: 1.0}


@pytest.mark.parametrize(("make", "field"), [
    (lambda: ModelConfig(dtype="int3"), "dtype"),
    (lambda: ModelConfig(max_model_len=0), "max_model_len"),
    (lambda: CacheConfig(block_size=3), "block_size"),
    (lambda: CacheConfig(kv_cache_prefault="yes"), "kv_cache_prefault"),  # type: ignore[arg-type]
    (lambda: SchedulerConfig(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (lambda: SchedulerConfig(max_num_seqs=-1), "max_num_seqs"),
    (lambda: EngineConfig.from_options(kv_cache_memory="lots"), "kv_cache_memory"),
    (lambda: EngineConfig.from_options(bogus=1), "bogus"),
])
def test_engine_config_errors_name_the_field(make: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make()  # type: ignore[operator]


def test_parse_size() -> None:
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size(4096) == 4096
    with pytest.raises(ValueError):
        parse_size("-1")


def test_unknown_model_is_a_clear_error(tmp_path: object) -> None:
    with pytest.raises(ValueError, match="not a known alias"):
        resolve_model_path("no-such-model")
    assert resolve_model_path("smollm2-135m-instruct").name.endswith(".gguf")


def test_prepack_weights_and_compile_model_exclude_each_other() -> None:
    from pagoda.config import ModelConfig

    with pytest.raises(ValueError, match="prepack_weights and compile_model"):
        ModelConfig(prepack_weights=True, compile_model=True)
