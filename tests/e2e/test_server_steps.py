"""`pagoda serve --num-scheduler-steps 4` on a tiny model: streams (which come in bursts) join to the text of steps
taken one at a time, and the server says in /metrics that it generated every token."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from pagoda import LLM, SamplingParams
from tests.e2e.test_server_harness import ServerProcess, start_server, tiny_model_dir

FLAGS = ("--dtype", "float32", "--attention-backend", "cpp", "--kv-cache-memory", "32MiB", "--no-prefix-caching")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from start_server(tmp_path_factory, "server-steps", *FLAGS, "--num-scheduler-steps", "4",
                            "--served-model-name", "tiny")


def test_streams_of_several_steps_a_call_join_to_single_steps_text(server: ServerProcess,
                                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    prompts = ["The capital of France is", "Hello, my name is"]
    llm = LLM(str(tiny_model_dir(tmp_path_factory)), dtype="float32", attention_backend="cpp",
              kv_cache_memory="32MiB", enable_prefix_caching=False)
    for i, prompt in enumerate(prompts):
        want = llm.generate([prompt], SamplingParams(temperature=0.9, seed=i, max_tokens=30), use_tqdm=False)[0]
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0.9, seed=i,
                                           stream=True)
        chunks = [c.choices[0] for c in stream if c.choices]
        assert "".join(c.text for c in chunks) == want.outputs[0].text
        assert chunks[-1].finish_reason == want.outputs[0].finish_reason
        full = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0.9, seed=i)
        assert full.choices[0].text == want.outputs[0].text
        assert full.usage is not None and full.usage.completion_tokens == len(want.outputs[0].token_ids)
