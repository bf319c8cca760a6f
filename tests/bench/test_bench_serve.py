"""`pagoda bench serve` against fake OpenAI servers: an in-process httpx MockTransport driven by a
fake clock (so TTFT/ITL/TPOT/goodput are checked exactly, with no wall-clock timing), and one real
loopback HTTP server for the CLI path."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import Request  # at module level: FastAPI resolves the handler's string annotations here

from pagoda.bench.serve import arrival_offsets, parse_rates, parse_slo, run_bench_serve, run_sweep
from pagoda.entrypoints.cli import build_parser, main
from tests.conftest import TINY_VOCAB, write_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Just a tokenizer and a config.json: all `bench serve` needs from a model."""
    folder = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": TINY_VOCAB}))
    return folder


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def sse(obj: dict[str, Any] | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


class FakeServer:
    """An OpenAI-style streaming server. Request i (in arrival order) waits ttft(i) seconds of fake
    time before its first chunk, then itl between chunks; `fail` maps i to a failure mode."""

    def __init__(self, clock: FakeClock, ttft: Callable[[int], float], itl: float = 0.25,
                 usage: bool = True, fail: dict[int, str] | None = None) -> None:
        self.clock, self.ttft, self.itl, self.usage, self.fail = clock, ttft, itl, usage, fail or {}
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = self.max_in_flight = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}, {"id": "other"}]})
        body = json.loads(request.content)
        i = len(self.bodies)
        self.bodies.append(body)
        if self.fail.get(i) == "http":
            return httpx.Response(503, json={"error": {"message": "overloaded"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self.stream(i, body))

    async def stream(self, i: int, body: dict[str, Any]) -> AsyncIterator[bytes]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        chat = "messages" in body
        try:
            yield b": keep-alive comment\n\n"
            if chat:  # role-only chunk first, as OpenAI sends: carries no content, so no TTFT
                yield sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            if self.fail.get(i) == "event":
                yield sse({"error": {"message": "engine fell over", "code": 500}})
                return
            if self.fail.get(i) != "empty":
                for k in range(body["max_tokens"]):
                    await asyncio.sleep(0)  # let other streams interleave (for concurrency checks)
                    self.clock.t += self.ttft(i) if k == 0 else self.itl
                    piece = {"delta": {"content": "x"}} if chat else {"text": "x"}
                    yield sse({"choices": [{"index": 0, **piece, "finish_reason": None}]})
            if self.usage:
                yield sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": body["max_tokens"],
                                                    "total_tokens": 7 + body["max_tokens"]}})
            yield sse("[DONE]")
        finally:
            self.in_flight -= 1


def parse(tokenizer_dir: Path, *flags: str) -> Any:
    return build_parser().parse_args(["bench", "serve", "--tokenizer", str(tokenizer_dir), "--quiet",
                                      "--input-len", "5:9", *flags])


def run(args: Any, server: FakeServer) -> list[dict[str, Any]]:
    return asyncio.run(run_sweep(args, httpx.MockTransport(server.handle), clock=server.clock))


def test_metrics_match_the_server_delays(tokenizer_dir: Path) -> None:
    clock = FakeClock()
    server = FakeServer(clock, ttft=lambda i: 0.125 * (i + 1))  # 0.125, 0.25, 0.375, 0.5 s
    args = parse(tokenizer_dir, "--num-prompts", "4", "--output-len", "5", "--max-concurrency", "1",
                 "--slo", "ttft=300,tpot=250")
    [r] = run(args, server)
    results = r["results"]
    assert [x.ttft for x in results] == [0.125, 0.25, 0.375, 0.5]
    assert all(x.itl == [0.25] * 4 and x.tpot == 0.25 and x.output_tokens == 5 for x in results)
    assert [x.e2e for x in results] == [0.125 * (i + 1) + 1.0 for i in range(4)]
    assert r["model"] == "fake-model" and r["completed"] == 4 and r["failed"] == 0
    assert r["duration_s"] == pytest.approx(1.25 + 4.0)  # one at a time: the sum of the latencies
    assert r["ttft_ms"]["mean"] == pytest.approx(312.5) and r["ttft_ms"]["median"] == pytest.approx(312.5)
    assert r["tpot_ms"]["p99"] == pytest.approx(250) and r["itl_ms"]["p90"] == pytest.approx(250)
    assert r["total_output_tokens"] == 20 and r["total_input_tokens"] == 4 * 7  # prompt tokens from usage
    assert r["output_throughput"] == pytest.approx(20 / 5.25)
    assert r["goodput"] == pytest.approx(2 / 5.25)  # only TTFT 125 and 250 ms meet ttft<=300
    body = server.bodies[0]
    assert body["model"] == "fake-model" and body["max_tokens"] == 5 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and "seed" not in body
    assert all(isinstance(t, int) and 5 <= len(b["prompt"]) <= 9 for b in server.bodies for t in b["prompt"])


def test_tpot_and_slo_edge_cases(tokenizer_dir: Path) -> None:
    server = FakeServer(FakeClock(), ttft=lambda i: 0.5)
    [r] = run(parse(tokenizer_dir, "--num-prompts", "2", "--output-len", "1", "--slo", "tpot=1"), server)
    assert all(x.tpot is None for x in r["results"])  # one token: no time per *further* token
    assert r["tpot_ms"] == {} and r["goodput"] == pytest.approx(2 / r["duration_s"])  # no TPOT: not a miss


def test_without_usage_tokens_are_counted_from_chunks(tokenizer_dir: Path) -> None:
    server = FakeServer(FakeClock(), ttft=lambda i: 0.5, usage=False)
    [r] = run(parse(tokenizer_dir, "--num-prompts", "3", "--output-len", "4", "--temperature", "0.7"), server)
    assert [x.output_tokens for x in r["results"]] == [4, 4, 4]
    assert r["goodput"] is None
    assert [b["seed"] for b in server.bodies] == [0, 1, 2] and server.bodies[0]["temperature"] == 0.7
    # Prompt tokens come from the client's own count when the server sends no usage.
    assert [x.prompt_tokens for x in r["results"]] == [len(b["prompt"]) for b in server.bodies]


def test_failures_are_counted_with_their_errors(tokenizer_dir: Path) -> None:
    server = FakeServer(FakeClock(), ttft=lambda i: 0.5, fail={1: "http", 2: "event", 3: "empty"})
    [r] = run(parse(tokenizer_dir, "--num-prompts", "5", "--output-len", "3", "--max-concurrency", "1"), server)
    assert r["completed"] == 2 and r["failed"] == 3
    assert [x.success for x in r["results"]] == [True, False, False, False, True]
    errors = " | ".join(r["errors"])
    assert "HTTP 503" in errors and "overloaded" in errors and "engine fell over" in errors
    assert "without any generated text" in errors
    assert r["total_output_tokens"] == 6 and r["ttft_ms"]["mean"] == pytest.approx(500)


def test_chat_endpoint_sends_text_and_reads_deltas(tokenizer_dir: Path) -> None:
    server = FakeServer(FakeClock(), ttft=lambda i: 0.5)
    [r] = run(parse(tokenizer_dir, "--endpoint", "/v1/chat/completions", "--num-prompts", "2",
                    "--output-len", "3", "--model", "given", "--max-concurrency", "1"), server)
    assert r["completed"] == 2 and all(x.ttft == 0.5 and x.output_tokens == 3 for x in r["results"])
    for body in server.bodies:
        [message] = body["messages"]
        assert message["role"] == "user" and isinstance(message["content"], str) and "prompt" not in body
        assert body["model"] == "given"


@pytest.mark.parametrize("limit, expected", [("2", 2), (None, 6)])
def test_max_concurrency_bounds_requests_in_flight(tokenizer_dir: Path, limit: str | None, expected: int) -> None:
    server = FakeServer(FakeClock(), ttft=lambda i: 0.5)
    flags = ["--max-concurrency", limit] if limit else []
    [r] = run(parse(tokenizer_dir, "--num-prompts", "6", "--output-len", "3", *flags), server)
    assert r["completed"] == 6 and server.max_in_flight == expected


def test_arrivals_have_the_asked_rate_and_burstiness() -> None:
    for burstiness in (1.0, 4.0, 0.5):
        offsets = arrival_offsets(20_000, 8.0, burstiness, random.Random(0))
        gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
        assert offsets[0] == 0 and all(g >= 0 for g in gaps)
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(1 / 8, rel=0.03)
        # Gamma(shape k): squared coefficient of variation 1/k (1 for Poisson arrivals).
        assert statistics.variance(gaps) / mean**2 == pytest.approx(1 / burstiness, rel=0.08)
    assert arrival_offsets(50, 3.0, 1.0, random.Random(7)) == arrival_offsets(50, 3.0, 1.0, random.Random(7))
    assert arrival_offsets(50, 3.0, 1.0, random.Random(7)) != arrival_offsets(50, 3.0, 1.0, random.Random(8))
    assert arrival_offsets(4, math.inf, 1.0, random.Random(0)) == [0.0] * 4


def test_flag_parsing() -> None:
    assert parse_rates("inf") == [math.inf] and parse_rates("1,2.5,8") == [1.0, 2.5, 8.0]
    assert parse_slo("ttft=500,tpot=50") == {"ttft": 500.0, "tpot": 50.0}
    for bad in ("0", "-1", "x", ""):
        with pytest.raises(Exception, match="rate"):
            parse_rates(bad)
    for bad in ("ttft", "itl=5", "ttft=-1", "tpot=abc"):
        with pytest.raises(Exception, match="KEY=MS"):
            parse_slo(bad)


def test_sweep_saves_json_and_plots(tokenizer_dir: Path, tmp_path: Path) -> None:
    server = FakeServer(FakeClock(), ttft=lambda i: 0.5)
    out, plots = tmp_path / "result.json", tmp_path / "plots"
    args = parse(tokenizer_dir, "--num-prompts", "3", "--output-len", "3", "--request-rate", "1000,2000",
                 "--save-result", str(out), "--plot", str(plots), "--slo", "ttft=600")
    runs = run_bench_serve(args, httpx.MockTransport(server.handle), clock=server.clock)
    assert [r["request_rate"] for r in runs] == [1000.0, 2000.0] and len(server.bodies) == 6
    # Each rate runs on fresh prompts: the second is not served from the first one's prefix cache.
    assert server.bodies[0]["prompt"] != server.bodies[3]["prompt"]
    saved = json.loads(out.read_text())["runs"]
    for run_doc in saved:
        for key in ("completed", "failed", "duration_s", "request_throughput", "output_throughput",
                    "total_token_throughput", "goodput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "requests"):
            assert key in run_doc
        assert set(run_doc["ttft_ms"]) == {"mean", "median", "p90", "p99"} and len(run_doc["requests"]) == 3
        assert run_doc["goodput"] > 0 and "results" not in run_doc
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["latency_cdf_rate_1000.0.png", "latency_cdf_rate_2000.0.png", "sweep.png"]
    assert all((plots / n).read_bytes().startswith(b"\x89PNG") for n in names)


# ---- the CLI over real loopback HTTP ----------------------------------------------------------------
@pytest.fixture()
def http_server() -> Iterator[str]:
    """A FastAPI SSE server on 127.0.0.1 (free port) in a thread."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "loopback"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()

        async def events() -> AsyncIterator[bytes]:
            for _ in range(body["max_tokens"]):
                yield sse({"choices": [{"index": 0, "text": "y"}]})
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_cli_against_a_loopback_server(http_server: str, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    code = main(["bench", "serve", "--base-url", http_server, "--tokenizer", str(tokenizer_dir), "--num-prompts",
                 "4", "--input-len", "8", "--output-len", "3", "--request-rate", "inf", "--json", "--quiet"])
    assert code == 0
    [line] = capsys.readouterr().out.strip().splitlines()
    result = json.loads(line)
    assert result["errors"] == {}
    assert result["model"] == "loopback" and result["completed"] == 4 and result["failed"] == 0
    assert result["total_output_tokens"] == 12 and result["total_input_tokens"] == 32
    assert result["request_rate"] == "inf" and result["itl_ms"] and result["tpot_ms"]


def test_cli_reports_an_unreachable_server(tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.e2e.test_server_harness import free_port

    code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--tokenizer",
                 str(tokenizer_dir), "--num-prompts", "1", "--quiet"])
    assert code == 2 and "cannot reach" in capsys.readouterr().err


def test_text_prompts_from_a_file_are_sent_as_text(tokenizer_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n{"prompt": "abc"}\n')
    server = FakeServer(FakeClock(), ttft=lambda i: 0.5, usage=False)
    [r] = run(parse(tokenizer_dir, "--dataset", "file", "--dataset-path", str(prompts), "--num-prompts", "2",
                    "--output-len", "2"), server)
    assert sorted(b["prompt"] for b in server.bodies) == ["abc", "hello there"]
    # Counted with --tokenizer (bytes here) when the server reports no usage.
    assert sorted(x.prompt_tokens for x in r["results"]) == [3, 11]
