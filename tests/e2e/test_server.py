"""End to end against a real `pagoda serve` process on a tiny model: the official openai client,
streaming correctness, the bad-input suite, auth, metrics, 64 concurrent streams with disconnects,
and SIGTERM (last: it stops the server)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pagoda import LLM, SamplingParams
from tests.e2e.test_server_harness import ServerProcess, is_openai_error, sse_events, start_server, tiny_model_dir

API_KEY = "test-key-123"
ENGINE_FLAGS = ("--dtype", "float64", "--kv-cache-memory", "32MiB")  # float64: greedy ties cannot flip
PROMPTS = ["The capital of France is", "Hello, my name is", "1 2 3 4"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from start_server(tmp_path_factory, "server-main", *ENGINE_FLAGS, "--shutdown-timeout", "2",
                            "--served-model-name", "tiny", api_key=API_KEY)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _post(server: ServerProcess, path: str, body: Any, **kw: Any) -> httpx.Response:
    headers = {**server.headers, **kw.pop("headers", {})}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=kw.pop("timeout", 60), **kw)


# ---- the openai client --------------------------------------------------------------------------
def test_greedy_completions_equal_offline_llm(client: openai.OpenAI, tmp_path_factory: pytest.TempPathFactory
                                              ) -> None:
    llm = LLM(str(tiny_model_dir(tmp_path_factory)), dtype="float64", kv_cache_memory="32MiB")
    want = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    got = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert [c.finish_reason for c in got.choices] == [w.finish_reason for w in want]
    assert got.usage is not None
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    assert got.usage.prompt_tokens == sum(len(p.encode()) for p in PROMPTS)  # byte tokenizer, no BOS


def test_chat_stream_joins_to_non_stream_text(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Tell me a story."}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, seed=7, temperature=1.0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, seed=7,
                                            temperature=1.0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]


def test_stop_strings_streamed_and_not_agree(client: openai.OpenAI) -> None:
    base = client.completions.create(model="tiny", prompt="abc", max_tokens=20, seed=11, temperature=1.0)
    text = base.choices[0].text
    assert len(text) >= 6, text
    stop = text[3:5]  # a stop string that certainly occurs, possibly spanning tokens
    for include in (False, True):
        extra = {"include_stop_str_in_output": include}
        full = client.completions.create(model="tiny", prompt="abc", max_tokens=20, seed=11, temperature=1.0,
                                         stop=[stop, "\u00e9\u00e9\u00e9"], extra_body=extra)
        streamed = client.completions.create(model="tiny", prompt="abc", max_tokens=20, seed=11, temperature=1.0,
                                             stop=[stop, "\u00e9\u00e9\u00e9"], extra_body=extra, stream=True)
        joined = "".join(c.choices[0].text for c in streamed)
        cut = text.index(stop) + (len(stop) if include else 0)
        assert full.choices[0].text == joined == text[:cut]
        assert full.choices[0].finish_reason == "stop"


def test_seed_reproducibility_and_n(client: openai.OpenAI) -> None:
    def run(seed: int) -> list[str]:
        r = client.completions.create(model="tiny", prompt="Once", max_tokens=16, n=3, seed=seed, temperature=1.0)
        assert sorted(c.index for c in r.choices) == [0, 1, 2]
        assert r.usage is not None and r.usage.completion_tokens > 0
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    a, b, c = run(1), run(1), run(2)
    assert a == b and a != c
    assert len(set(a)) > 1  # sample i is seeded seed + i: the n samples differ


def test_logprobs_completions_and_chat(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=6, logprobs=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs and lp.top_logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen is not None and chosen <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(chosen)  # greedy: the chosen token is the best
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_streaming_n_with_logprobs_ends_each_choice_once(server: ServerProcess) -> None:
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers, timeout=60,
                      json={"prompt": "ab", "max_tokens": 8, "n": 2, "stream": True, "logprobs": 1,
                            "ignore_eos": True}) as r:
        assert r.status_code == 200
        events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    finishes = [ch["index"] for e in events[:-1] for ch in e["choices"] if ch["finish_reason"]]
    assert sorted(finishes) == [0, 1]
    for i in (0, 1):
        tokens = [t for e in events[:-1] for ch in e["choices"] if ch["index"] == i and ch["logprobs"]
                  for t in ch["logprobs"]["tokens"]]
        assert len(tokens) == 8


def test_request_id_echo_usage_and_token_routes(server: ServerProcess) -> None:
    r = _post(server, "/v1/completions", {"prompt": "xyz", "max_tokens": 2}, headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    body = r.json()
    assert body["id"] == "cmpl-abc-123"
    assert set(body["usage"]) >= {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    generated = _post(server, "/v1/completions", {"prompt": "xyz", "max_tokens": 2})
    assert generated.headers["x-request-id"] and generated.json()["id"].endswith(generated.headers["x-request-id"])
    toks = _post(server, "/tokenize", {"prompt": "h\u00e9llo"}).json()
    assert toks["count"] == 6 and toks["max_model_len"] == 1024
    assert _post(server, "/detokenize", {"tokens": toks["tokens"]}).json() == {"prompt": "h\u00e9llo"}
    models = httpx.get(server.url + "/v1/models", headers=server.headers).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert httpx.get(server.url + "/version", headers=server.headers).json()["version"]


def test_repeated_prompt_reports_cached_tokens(server: ServerProcess) -> None:
    prompt = "a shared prefix that is longer than a couple of KV blocks, " * 2
    _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    usage = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 16  # at least one full block hit
    r = httpx.post(server.url + "/reset_prefix_cache", headers=server.headers)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    usage = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_api_key_required_everywhere_but_health(server: ServerProcess) -> None:
    for path in ("/v1/models", "/metrics", "/version"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401 and is_openai_error(r.json())
        assert httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200


# ---- bad input ----------------------------------------------------------------------------------
_C, _CHAT = "/v1/completions", "/v1/chat/completions"
_MSG = [{"role": "user", "content": "hi"}]
# (path, body: raw bytes or a JSON-able object, expected status, expected param or None)
BAD_REQUESTS: list[tuple[str, Any, int, str | None]] = [
    (_C, b"{", 400, None), (_C, b"", 400, None), (_C, b"[]", 400, None), (_C, b'"text"', 400, None),
    (_C, b"null", 400, None), (_C, b"123", 400, None), (_C, b"\xff\xfe\xfd", 400, None),
    (_C, b'{"prompt": "\xff\xfe"}', 400, None), (_C, b"[" * 100_000 + b"]" * 100_000, 400, None),
    (_C, {}, 400, "prompt"), (_C, {"prompt": 5}, 400, "prompt"), (_C, {"prompt": ["a", 1]}, 400, "prompt"),
    (_C, {"prompt": [999999]}, 400, "prompt"), (_C, {"prompt": [-1]}, 400, "prompt"),
    (_C, {"prompt": [7] * 1100}, 400, "prompt"), (_C, {"prompt": "x", "max_tokens": 1024}, 400, "max_tokens"),
    (_C, {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"), (_C, {"prompt": "x", "max_tokens": 0}, 400,
                                                                    "max_tokens"),
    (_C, {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"), (_C, {"prompt": "x", "max_tokens": 1.5}, 400,
                                                                      "max_tokens"),
    (_C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    (_C, b'{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
    (_C, b'{"prompt": "x", "top_p": 1e400}', 400, "top_p"), (_C, {"prompt": "x", "temperature": -1}, 400,
                                                              "temperature"),
    (_C, {"prompt": "x", "top_p": 0}, 400, "top_p"), (_C, {"prompt": "x", "top_k": -5}, 400, "top_k"),
    (_C, {"prompt": "x", "min_p": 2}, 400, "min_p"), (_C, {"prompt": "x", "n": 0}, 400, "n"),
    (_C, {"prompt": "x", "n": 10**6}, 400, "n"), (_C, {"prompt": "x", "n": True}, 400, "n"),
    (_C, {"prompt": "x", "logprobs": 100}, 400, "logprobs"), (_C, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    (_C, {"prompt": "x", "stop": [str(i) for i in range(65)]}, 400, "stop"), (_C, {"prompt": "x", "stop": [""]}, 400,
                                                                              "stop"),
    (_C, {"prompt": "x", "stop": 5}, 400, "stop"), (_C, {"prompt": "x", "stop": "s" * 2000}, 400, "stop"),
    (_C, {"prompt": "x", "seed": -1}, 400, "seed"), (_C, {"prompt": "x", "seed": 2**64}, 400, "seed"),
    (_C, {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty"),
    (_C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (_C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (_C, {"prompt": "x", "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    (_C, {"prompt": "x", "logit_bias": {"100000": 1}}, 400, "logit_bias"),
    (_C, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (_C, {"prompt": "x", "stop_token_ids": [1] * 2000}, 400, "stop_token_ids"),
    (_C, {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
    (_C, {"prompt": "x", "priority": 2**40}, 400, "priority"), (_C, {"prompt": "x", "cache_salt": ""}, 400,
                                                                "cache_salt"),
    (_C, {"prompt": "x", "stream": "yes"}, 400, "stream"), (_C, {"prompt": "x", "echo": "no"}, 400, "echo"),
    (_C, {"prompt": "x", "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage"),
    (_C, {"prompt": "x", "user": "u" * 1000}, 400, "user"), (_C, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    (_C, {"prompt": ["p"] * 65}, 400, "prompt"), (_C, {"prompt": "x", "request_id": "has space"}, 400, "request_id"),
    (_C, {"prompt": "x", "model": "no-such-model"}, 404, "model"),
    (_CHAT, {}, 400, "messages"), (_CHAT, {"messages": []}, 400, "messages"), (_CHAT, {"messages": "hi"}, 400,
                                                                             "messages"),
    (_CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (_CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (_CHAT, {"messages": _MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (_CHAT, {"messages": _MSG, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (_CHAT, {"messages": _MSG, "max_completion_tokens": -3}, 400, "max_tokens"),
    (_C, {"prompt": "x", "best_of": 4}, 400, "best_of"),
    (_CHAT, {"messages": _MSG, "response_format": {"type": "json_object"}}, 400, "response_format"),
    (_CHAT, {"messages": _MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/tokenize", {"prompt": "x", "messages": _MSG}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"), ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
]


def test_bad_input_suite_gets_openai_errors_and_no_5xx(server: ServerProcess) -> None:
    assert len(BAD_REQUESTS) >= 40
    failures = []
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        for path, body, status, param in BAD_REQUESTS:
            content = body if isinstance(body, bytes) else None
            r = http.post(path, content=content, json=None if content is not None else body)
            ok = r.status_code == status and is_openai_error(r.json())
            if ok and param is not None:
                ok = r.json()["error"]["param"] == param
            if not ok:
                failures.append((path, str(body)[:80], r.status_code, r.text[:300]))
        odd = [http.get("/v1/completions"), http.get("/no/such/route"),
               http.post(_C, content=b"{}" + b" " * (9 * 2**20)),  # over the body limit
               http.post(_C, json={"prompt": "x"}, headers={"X-Request-Id": "bad id"}),
               http.post(_C, json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}),
               http.post(_C, json={"prompt": "x"}, headers={"Authorization": ""})]
        for r, status in zip(odd, (405, 404, 413, 400, 401, 401), strict=True):
            if r.status_code != status or not is_openai_error(r.json()):
                failures.append(("odd", status, r.status_code, r.text[:300]))
        too_long = http.post(_C, json={"prompt": [7] * 1100}).json()["error"]["message"]
        assert "1024" in too_long and "1100" in too_long  # both lengths
        assert http.get("/health").status_code == 200  # still fine afterwards
        ok = http.post(_C, json={"prompt": "x", "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert not failures, "\n".join(map(str, failures))


# ---- metrics ------------------------------------------------------------------------------------
def test_metrics_parse_and_counters_move(server: ServerProcess) -> None:
    before = server.metrics()
    r = _post(server, _C, {"prompt": "abcdefgh", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    after = server.metrics()
    assert after["pagoda:generation_tokens_total"] - before["pagoda:generation_tokens_total"] == 5
    assert after["pagoda:prompt_tokens_total"] - before["pagoda:prompt_tokens_total"] >= 1
    key = 'pagoda:request_success_total{finished_reason="length"}'
    assert after[key] - before.get(key, 0) == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_time_per_output_token_seconds"):
        name = f"pagoda:{hist}_count"
        assert after[name] - before.get(name, 0) == 1, name
    assert after["pagoda:inter_token_latency_seconds_count"] - before["pagoda:inter_token_latency_seconds_count"] == 4
    assert after["pagoda:iteration_tokens_total_count"] > before["pagoda:iteration_tokens_total_count"]
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                  "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert f"pagoda:{gauge}" in after, gauge


# ---- concurrency and cancellation ---------------------------------------------------------------
async def _stream_client(http: httpx.AsyncClient, i: int, disconnect: bool) -> tuple[str, list[Any]]:
    body = {"prompt": f"client {i}:", "max_tokens": 160 if disconnect else 24, "ignore_eos": True, "stream": True,
            "temperature": 1.0, "seed": i}
    events: list[Any] = []
    async with http.stream("POST", _C, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            events.extend(sse_events([line]))
            if disconnect and len(events) >= 3:
                return "gone", events  # leaving the block closes the connection mid-stream
    return "done", events


async def _health_while_busy(http: httpx.AsyncClient) -> list[int]:
    codes = []
    for _ in range(5):  # the engine is saturated; /health is served by the event loop regardless
        await asyncio.sleep(0.05)
        codes.append((await http.get("/health")).status_code)
    return codes


async def _run_64_clients(server: ServerProcess) -> list[tuple[str, list[Any]]]:
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120, limits=limits) as http:
        health = asyncio.create_task(_health_while_busy(http))
        results = await asyncio.gather(*(_stream_client(http, i, disconnect=i % 2 == 1) for i in range(64)))
        assert await health == [200] * 5
        return results


def _kv_in_use(server: ServerProcess) -> float:
    return server.metrics()["pagoda:kv_cache_blocks_in_use"]


def test_64_streams_32_disconnect_and_blocks_return(server: ServerProcess) -> None:
    before = server.metrics()
    results = asyncio.run(_run_64_clients(server))
    last_finish = time.monotonic()
    done = [events for how, events in results if how == "done"]
    assert len(done) == 32
    for events in done:
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        reasons = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
        assert reasons == ["length"]
    while _kv_in_use(server) != 0:  # every disconnected request was aborted and its blocks freed
        assert time.monotonic() - last_finish < 1.0, "KV blocks still in use a second after the last finish"
        time.sleep(0.02)
    after = server.metrics()
    key = 'pagoda:request_success_total{finished_reason="abort"}'
    assert after[key] - before.get(key, 0) == 32  # aborted mid-stream, not run to completion
    assert after["pagoda:num_requests_running"] == 0 and after["pagoda:num_requests_waiting"] == 0


def test_non_streaming_client_disconnect_aborts(server: ServerProcess) -> None:
    key = 'pagoda:request_success_total{finished_reason="abort"}'
    before = server.metrics().get(key, 0)
    with pytest.raises(httpx.TimeoutException):  # the client gives up (closes the connection) mid-decode
        _post(server, _C, {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "n": 8},
              timeout=httpx.Timeout(60, read=0.3))
    deadline = time.monotonic() + 30  # bounded wait for liveness only
    while server.metrics().get(key, 0) == before:
        assert time.monotonic() < deadline, "non-streaming request not aborted after the client left"
        time.sleep(0.05)
    assert _kv_in_use(server) == 0


# ---- SIGTERM (last: it stops the server) ----------------------------------------------------------
def _read_stream(server: ServerProcess, body: dict[str, Any], started: list[bool]) -> list[Any] | str:
    lines: list[str] = []
    try:
        with httpx.stream("POST", server.url + _C, json={**body, "stream": True}, headers=server.headers,
                          timeout=60) as r:
            for line in r.iter_lines():
                lines.append(line)
                started.append(True)
    except httpx.HTTPError as e:
        return f"cut: {e!r}"
    events = sse_events(lines)
    return events if events and events[-1] == "[DONE]" else "cut"


def test_sigterm_drains_then_aborts_and_exits(server: ServerProcess) -> None:
    import concurrent.futures

    short_started: list[bool] = []
    long_started: list[bool] = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(_read_stream, server, {"prompt": "x", "max_tokens": 1000, "n": 16, "ignore_eos": True},
                           long_started)
        deadline = time.monotonic() + 60
        while not long_started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        short = pool.submit(_read_stream, server, {"prompt": "y", "max_tokens": 4, "ignore_eos": True},
                            short_started)
        while not short_started and not short.done():
            assert time.monotonic() < deadline
            time.sleep(0.005)
        server.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:  # no new work: 503 while draining, or the listening socket is already closed
            assert httpx.get(server.url + "/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass
        short_events = short.result()
        long_result = long.result()
    server.proc.wait(timeout=60)
    exit_after = time.monotonic() - t0
    assert isinstance(short_events, list) and short_events[-1] == "[DONE]"  # in-flight finished normally
    # The long request (16 x 1000 tokens) outlives --shutdown-timeout 2: it is aborted, and the process exits.
    assert isinstance(long_result, str), "the long request was not cut at the shutdown timeout"
    assert exit_after < 2 + 30  # bounded: liveness, not speed
