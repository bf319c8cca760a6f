"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Works against Pagoda's server, llama.cpp's llama-server and vLLM: the body uses only OpenAI fields
plus `ignore_eos` (a vLLM extension the other two accept), and the reply is read as server-sent
events, `data: {...}` lines ending with `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

CHAT_ENDPOINT = "/v1/chat/completions"
MAX_ERROR_CHARS = 500


@dataclass
class RequestResult:
    """What the client saw of one request; times in seconds from when it was sent."""

    prompt_tokens: int
    success: bool = False
    error: str = ""
    ttft: float = 0.0  # to the first chunk with content
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    e2e: float = 0.0
    output_tokens: int = 0
    start: float = 0.0  # clock value when sent (to place requests on the run's timeline)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None when there was only one."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class RequestSpec:
    prompt: list[int] | str
    prompt_tokens: int
    output_len: int
    seed: int


def build_body(spec: RequestSpec, endpoint: str, model: str, temperature: float) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "max_tokens": spec.output_len, "temperature": temperature, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if temperature > 0:  # sampled: a seed per request keeps runs reproducible
        body["seed"] = spec.seed
    if endpoint == CHAT_ENDPOINT:
        if not isinstance(spec.prompt, str):
            raise ValueError("the chat endpoint takes text prompts; decode token ids before building the body")
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


def _content(chunk: dict[str, Any]) -> str:
    """The text a completion or chat chunk carries ("" for role-only, usage-only or final chunks)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        delta = choice.get("delta") or {}
        return str(delta.get("content") or delta.get("reasoning_content") or "")
    return str(choice.get("text") or "")


class _StreamReader:
    """Folds SSE events into a RequestResult as they arrive."""

    def __init__(self, result: RequestResult, clock: Callable[[], float]) -> None:
        self.result, self.clock = result, clock
        self.chunks = 0
        self.usage_tokens: int | None = None
        self.last = 0.0
        self.done = False

    def feed(self, line: str) -> None:
        if not line.startswith("data:"):
            return  # comments, event names, blank separators
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"server error in stream: {json.dumps(chunk['error'])[:MAX_ERROR_CHARS]}")
        usage = chunk.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.usage_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens"):
                self.result.prompt_tokens = int(usage["prompt_tokens"])
        if _content(chunk):
            now = self.clock() - self.result.start
            if self.chunks == 0:
                self.result.ttft = now
            else:
                self.result.itl.append(now - self.last)
            self.last, self.chunks = now, self.chunks + 1

    def finish(self) -> None:
        r = self.result
        r.e2e = self.clock() - r.start
        if self.chunks == 0:
            raise RuntimeError("the stream ended without any generated text")
        r.output_tokens = self.usage_tokens if self.usage_tokens is not None else self.chunks
        r.success = True


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                       prompt_tokens: int, clock: Callable[[], float] = time.perf_counter) -> RequestResult:
    """Send one streaming request and time it; never raises: a failure is a result with `error`."""
    result = RequestResult(prompt_tokens=prompt_tokens, start=clock())
    reader = _StreamReader(result, clock)
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {text[:MAX_ERROR_CHARS]}")
            async for line in response.aiter_lines():
                reader.feed(line)
        reader.finish()
    except Exception as e:  # noqa: BLE001 (one failed request is data, not the end of the run)
        result.success = False
        result.error = str(e) or type(e).__name__
        result.e2e = clock() - result.start
    return result
