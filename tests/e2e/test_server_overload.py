"""Overload: bursts well past capacity get 429 + Retry-After at once for the excess (KV shortfall, then a
full queue); every accepted request completes with exactly one terminal response."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.test_server_harness import ServerProcess, is_openai_error, sse_events, start_server

# 1 MiB of float32 KV for the tiny model = 64 blocks of 16 tokens; one request runs at a time, so
# admitted requests wait and their KV reservations add up.
FLAGS = ("--kv-cache-memory", "1MiB", "--max-num-seqs", "1", "--max-queued-requests", "8")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from start_server(tmp_path_factory, "server-overload", *FLAGS)


async def _one(http: httpx.AsyncClient, i: int, max_tokens: int) -> dict[str, Any]:
    """One request of the burst (even ones stream): its status, and what it ended with."""
    body = {"prompt": f"burst {i:02d}", "max_tokens": max_tokens, "ignore_eos": True, "stream": i % 2 == 0}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        raw = await r.aread()
        out: dict[str, Any] = {"status": r.status_code, "retry_after": r.headers.get("retry-after")}
        if r.status_code != 200:
            out["body"] = httpx.Response(r.status_code, content=raw).json()
        elif body["stream"]:
            events = sse_events(raw.decode().splitlines())
            out["done_markers"] = events.count("[DONE]")
            out["errors"] = [e for e in events if isinstance(e, dict) and "error" in e]
            out["finishes"] = [c["finish_reason"] for e in events if isinstance(e, dict)
                               for c in e.get("choices", []) if c["finish_reason"]]
            out["last"] = events[-1] if events else None
        else:
            out["done_markers"], out["errors"], out["last"] = 1, [], "[DONE]"
            out["finishes"] = [c["finish_reason"] for c in httpx.Response(200, content=raw).json()["choices"]]
        return out


async def _burst(server: ServerProcess, n: int, max_tokens: int) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
        return await asyncio.gather(*(_one(http, i, max_tokens) for i in range(n)))


def _check_burst(server: ServerProcess, results: list[dict[str, Any]], before: dict[str, float]) -> dict[str, int]:
    accepted = [r for r in results if r["status"] == 200]
    rejected = [r for r in results if r["status"] == 429]
    assert len(accepted) + len(rejected) == len(results), [r["status"] for r in results]
    assert accepted and rejected
    for r in accepted:  # exactly one terminal response each, no error
        assert r["finishes"] == ["length"] and r["done_markers"] == 1 and r["last"] == "[DONE]"
        assert not r["errors"]
    reasons: dict[str, int] = {}
    for r in rejected:
        assert r["retry_after"] is not None and int(r["retry_after"]) >= 1
        assert is_openai_error(r["body"]) and r["body"]["error"]["code"] in ("kv_cache", "queue_full")
        reasons[r["body"]["error"]["code"]] = reasons.get(r["body"]["error"]["code"], 0) + 1
    after = server.metrics()
    for reason, count in reasons.items():
        key = f'pagoda:admission_rejections_total{{reason="{reason}"}}'
        assert after[key] - before.get(key, 0) == count
    assert after["pagoda:kv_cache_blocks_in_use"] == 0
    return reasons


def test_burst_past_kv_capacity_is_shed_with_429(server: ServerProcess) -> None:
    # Each request may need (8 + 150) / 16 -> 10 blocks: about 6 fit in 64 blocks, the rest are shed.
    before = server.metrics()
    reasons = _check_burst(server, asyncio.run(_burst(server, 40, 150)), before)
    assert reasons.get("kv_cache", 0) > 0, reasons


def test_burst_past_queue_limit_is_shed_with_429(server: ServerProcess) -> None:
    # Small requests (3 blocks each) fit the cache; the 8-request queue limit sheds the excess.
    before = server.metrics()
    reasons = _check_burst(server, asyncio.run(_burst(server, 30, 30)), before)
    assert reasons.get("queue_full", 0) > 0, reasons
    assert httpx.get(server.url + "/health").status_code == 200
