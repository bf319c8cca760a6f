"""`pagoda serve --num-speculative-tokens 4` on a tiny model: greedy streams, whose steps verify draft tokens and so
come several tokens at a time, join to the text of an engine without drafts, and /metrics counts the drafts."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from pagoda import LLM, SamplingParams
from tests.e2e.test_server_harness import ServerProcess, start_server, tiny_model_dir

FLAGS = ("--dtype", "float32", "--attention-backend", "cpp", "--kv-cache-memory", "32MiB", "--no-prefix-caching")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from start_server(tmp_path_factory, "server-speculative", *FLAGS, "--num-speculative-tokens", "4",
                            "--served-model-name", "tiny")


def test_streams_with_drafts_join_to_the_text_without(server: ServerProcess,
                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    prompts = ["one two three one two three one two three one", "abc abc abc abc abc abc"]
    llm = LLM(str(tiny_model_dir(tmp_path_factory)), dtype="float32", attention_backend="cpp",
              kv_cache_memory="32MiB", enable_prefix_caching=False)
    before = server.metrics()
    for prompt in prompts:
        want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0.0,
                                           stream=True)
        chunks = [c.choices[0] for c in stream if c.choices]
        assert "".join(c.text for c in chunks) == want.outputs[0].text
        assert chunks[-1].finish_reason == want.outputs[0].finish_reason
    after = server.metrics()
    drafts = "pagoda:spec_decode_num_draft_tokens_total"
    accepted = "pagoda:spec_decode_num_accepted_tokens_total"
    assert after[drafts] > before.get(drafts, 0.0)
    assert 0 <= after[accepted] <= after[drafts]
