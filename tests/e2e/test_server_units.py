"""In-process checks of the server's parts, without a model: admission accounting in AsyncEngine (with a
fake engine whose requests never start), engine death, the 10 s stat line, and error `param` naming."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest

from pagoda.engine.async_engine import AdmissionRejected, AsyncEngine, Channel, EngineDeadError, EngineRequest, Failure
from pagoda.entrypoints.openai.protocol import CompletionRequest, param_of, parse_body
from pagoda.metrics import StatLogger
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams

TOTAL_BLOCKS = 10


class FakeEngine:
    """Just enough of LLMEngine for AsyncEngine: requests are queued but only start when told to."""

    def __init__(self) -> None:
        self.requests: dict[str, list[int]] = {}
        self.start: set[str] = set()
        self.aborted: list[str] = []

    def get_metrics(self) -> dict[str, int | float]:
        return {"kv_blocks_total": TOTAL_BLOCKS, "num_prompt_tokens_computed": 0, "num_generation_tokens": 0}

    def kv_demand_blocks(self, ids: list[int], max_tokens: int | None, n: int = 1, salt: str | None = None) -> int:
        return n * -(-(len(ids) + (max_tokens or 0)) // 4)

    def kv_free_blocks(self) -> int:
        return TOTAL_BLOCKS

    def add_request(self, rid: str, prompt: list[int], params: SamplingParams, priority: int = 0, *,
                    cache_salt: str | None = None, tenant: str | None = None) -> None:
        if not prompt:
            raise ValueError("prompt must not be empty")
        self.requests[rid] = prompt

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.001)
        outs = []
        for rid in list(self.start & set(self.requests)):
            del self.requests[rid]
            outs.append(RequestOutput(rid, None, [1], [CompletionOutput(0, "a", [5], 0.0, None, "length")], True))
        return outs

    def abort_request(self, rid: str) -> RequestOutput | None:
        self.aborted.append(rid)
        return RequestOutput(rid, None, [1], [], True) if self.requests.pop(rid, None) is not None else None


def _request(rid: str, num_prompt: int = 4, max_tokens: int = 12) -> EngineRequest:
    return EngineRequest(rid, [1] * num_prompt, SamplingParams(max_tokens=max_tokens))


async def _admission_scenario() -> dict[str, Any]:
    fake = FakeEngine()
    engine = AsyncEngine(fake, "fake", max_queued_requests=3)  # type: ignore[arg-type]
    engine.start()
    ch = Channel()
    seen: dict[str, Any] = {}
    await engine.add(_request("a"), Channel())  # 4 of 10 blocks reserved
    with pytest.raises(ValueError):  # the engine's own validation: nothing reserved
        await engine.add(_request("bad", 0), ch)
    await engine.add(_request("b"), ch)  # 8 of 10
    with pytest.raises(AdmissionRejected) as kv:
        await engine.add(_request("c"), ch)  # needs 4, 2 left
    seen["kv"] = kv.value.reason
    await engine.add(_request("d", 4, 4), ch)  # 2 blocks: fits exactly
    with pytest.raises(AdmissionRejected) as full:
        await engine.add(_request("e", 1, 1), ch)  # 3 queued already
    seen["full"] = full.value.reason
    engine.abort("a")  # frees its reservation
    await engine.add(_request("f"), ch)
    fake.start.add("b")  # b starts: its reservation is released, its output arrives
    seen["b"] = await asyncio.wait_for(ch.get(), 10)
    await engine.add(_request("g"), ch)
    engine.kill_for_test()
    seen["failures"] = [await asyncio.wait_for(ch.get(), 10) for _ in range(3)]  # d, f, g
    with pytest.raises(EngineDeadError):
        await engine.add(_request("h"), ch)
    seen["healthy"] = engine.healthy
    seen["aborted"] = fake.aborted
    engine.stop()
    return seen


def test_admission_reserves_kv_and_bounds_the_queue_then_death_fails_everything() -> None:
    seen = asyncio.run(_admission_scenario())
    assert seen["kv"] == "kv_cache" and seen["full"] == "queue_full"
    rid, out = seen["b"]
    assert rid == "b" and isinstance(out, RequestOutput) and out.finished
    assert sorted(r for r, _ in seen["failures"]) == ["d", "f", "g"]
    assert all(isinstance(f, Failure) and "killed" in f.message for _, f in seen["failures"])
    assert seen["healthy"] is False
    assert "a" in seen["aborted"]


def test_stat_logger_line_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    stat = StatLogger(interval=10.0)
    snap = {"num_prompt_tokens_computed": 100, "num_generation_tokens": 50, "num_requests_running": 3,
            "num_requests_waiting": 2, "kv_cache_usage": 0.25, "prefix_cache_queries": 80, "prefix_cache_hits": 20}
    with caplog.at_level(logging.INFO, logger="pagoda.metrics"):
        stat.maybe_log(snap, time.monotonic())  # too soon: nothing
        stat.maybe_log(snap, time.monotonic() + 10.5)
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    for part in ("generation throughput", "running: 3", "waiting: 2", "KV cache usage: 25.0%",
                 "prefix cache hit rate: 25.0%"):
        assert part in line, line


@pytest.mark.parametrize(("message", "param"), [
    ("top_p must be in (0, 1], got 2", "top_p"), ("each stop string must be a non-empty string", "stop"),
    ("logit_bias[5] must be in [-100, 100]", "logit_bias"), ("prompt must not be empty", "prompt"),
    ("something else entirely", None)])
def test_value_errors_name_their_field(message: str, param: str | None) -> None:
    assert param_of(message) == param


def test_parse_body_names_nested_fields() -> None:
    from pagoda.entrypoints.openai.protocol import APIError, ChatCompletionRequest

    with pytest.raises(APIError) as e:
        parse_body(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}, {"role": 3}]}')
    assert e.value.status == 400 and e.value.param == "messages[1].role"
    req = parse_body(CompletionRequest, b'{"prompt": [[1, 2], [3]], "n": 2, "unknown_field": 1}')
    assert req.prompts() == [[1, 2], [3]]


_CHAT = {"messages": [{"role": "user", "content": "x"}]}
_TEXT = {"prompt": "x"}


def _parse(body: dict[str, Any]) -> Any:
    from pagoda.entrypoints.openai.protocol import ChatCompletionRequest

    return parse_body(ChatCompletionRequest if "messages" in body else CompletionRequest, json.dumps(body).encode())


@pytest.mark.parametrize(("body", "param"), [
    (_TEXT | {"best_of": 3}, "best_of"), (_TEXT | {"n": 2, "best_of": 1}, "best_of"),
    (_TEXT | {"guided_json": {"type": "object"}}, "guided_json"),
    (_TEXT | {"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    (_CHAT | {"response_format": {"type": "json_object"}}, "response_format"),
    (_CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (_CHAT | {"functions": [{"name": "f"}]}, "functions"), (_CHAT | {"tool_choice": "required"}, "tool_choice"),
    (_CHAT | {"function_call": {"name": "f"}}, "function_call"), (_TEXT | {"suffix": "y"}, "suffix"),
])
def test_unsupported_fields_are_refused_not_dropped(body: dict[str, Any], param: str) -> None:
    """A field this server does not implement, set to ask for more than the default, is a 400 naming it (code
    "unsupported"): ignoring it would hand back something other than what was asked for."""
    from pagoda.entrypoints.openai.protocol import APIError

    with pytest.raises(APIError) as e:
        _parse(body)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "unsupported")
    assert param in e.value.message


@pytest.mark.parametrize("body", [
    _TEXT | {"best_of": 1}, _TEXT | {"n": 2, "best_of": 2}, _TEXT | {"best_of": None},
    _CHAT | {"response_format": {"type": "text"}}, _CHAT | {"tools": []}, _CHAT | {"tool_choice": "none"},
    _CHAT | {"tool_choice": "auto"}])
def test_unsupported_fields_at_their_defaults_are_accepted(body: dict[str, Any]) -> None:
    _parse(body)


def test_non_text_content_parts_get_a_clear_error() -> None:
    from pagoda.entrypoints.openai.protocol import APIError, ChatCompletionRequest

    body = b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}'
    with pytest.raises(APIError) as e:
        parse_body(ChatCompletionRequest, body)
    assert e.value.param == "messages[0].content"
    assert "text parts" in e.value.message and "images" in e.value.message
