"""Fairness between tenants (the `user` field), then engine death (last: it kills the engine loop).

One server for both, to pay its start-up once: 4 sequences at a time, so requests queue and the
scheduler's choice of who goes next decides who is served."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.test_server_harness import ServerProcess, is_openai_error, sse_events, start_server

FLAGS = ("--kv-cache-memory", "4MiB", "--max-num-seqs", "4")
NUM_A, NUM_B = 40, 4  # tenant A sends 10x the traffic of tenant B
# Long enough that a batch of A's outlasts the time B's requests take to reach the engine through the server (with
# 16, steps of ~1 ms let a whole batch of A's finish, and the next be admitted, before B's were queued)
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from start_server(tmp_path_factory, "server-fairness", *FLAGS, env={"PAGODA_ENABLE_TEST_HOOKS": "1"})


async def _tenant_burst(server: ServerProcess) -> tuple[list[tuple[str, float]], float]:
    """All requests at once (A's first); returns (tenant, finish time) in completion order, and the time B's were
    sent."""
    done: list[tuple[str, float]] = []
    t0 = time.monotonic()

    async def one(http: httpx.AsyncClient, tenant: str, i: int) -> None:
        r = await http.post("/v1/completions", json={"prompt": f"{tenant} {i:02d}", "max_tokens": MAX_TOKENS,
                                                     "ignore_eos": True, "user": tenant})
        assert r.status_code == 200, r.text
        done.append((tenant, time.monotonic() - t0))

    limits = httpx.Limits(max_connections=NUM_A + NUM_B, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
        tasks = [asyncio.create_task(one(http, "A", i)) for i in range(NUM_A)]
        await asyncio.sleep(0.05)  # A's flood is queued before B arrives
        b_sent = time.monotonic() - t0
        tasks += [asyncio.create_task(one(http, "B", i)) for i in range(NUM_B)]
        await asyncio.gather(*tasks)
    return done, b_sent


def test_light_tenant_gets_its_fair_share_under_a_flood(server: ServerProcess) -> None:
    order, b_sent = asyncio.run(_tenant_burst(server))
    # While both tenants have work (from B's arrival on: A's requests that finished before it, more of them the faster
    # the steps, are not contested), B's share of completions. Equal weights: fair is 0.5, less the A requests
    # running when B arrives (4 slots); first-come-first-served would give B about NUM_B / (NUM_A + NUM_B) = 0.09.
    contested = [(tenant, t) for tenant, t in order if t >= b_sent]
    last_b = max(i for i, (tenant, _) in enumerate(contested) if tenant == "B")
    b_share = NUM_B / (last_b + 1)
    a_mean = sum(t for tenant, t in order if tenant == "A") / NUM_A
    b_mean = sum(t for tenant, t in order if tenant == "B") / NUM_B
    print(f"fairness: B's share while both active = {b_share:.2f} (fair 0.50, FIFO {NUM_B / (NUM_A + NUM_B):.2f}); "
          f"B's last request finished {last_b + 1}th of the {len(contested)} after B arrived ({len(order)} in all); "
          f"mean latency A {a_mean:.2f} s, "
          f"B {b_mean:.2f} s")
    assert b_share >= 0.3


def _stream(server: ServerProcess) -> list[Any]:
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"prompt": "s", "max_tokens": 900, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        return sse_events(list(r.iter_lines()))


def _plain(server: ServerProcess) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", timeout=30,
                      json={"prompt": "p", "max_tokens": 900, "ignore_eos": True})


def test_dead_engine_loop_fails_in_flight_requests_and_health(server: ServerProcess) -> None:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(_stream, server) for _ in range(3)]
        plain = pool.submit(_plain, server)
        deadline = time.monotonic() + 30  # bounded waits: liveness, not speed
        while server.metrics()["pagoda:num_requests_running"] < 4:
            assert time.monotonic() < deadline, "requests never started"
            time.sleep(0.02)
        assert httpx.post(server.url + "/_test/kill_engine_loop").status_code == 200
        for f in streams:  # each stream: an error event, then [DONE]; never a hang (30 s client timeout)
            events = f.result()
            assert events[-1] == "[DONE]" and is_openai_error(events[-2])
            assert events[-2]["error"]["type"] == "server_error"
        r = plain.result()
        assert r.status_code == 500 and is_openai_error(r.json())
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and is_openai_error(health.json())
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and is_openai_error(r.json())
