"""Helpers for the server tests (no tests here): a real `pagoda serve` process on a tiny model, on
loopback with a free port, plus SSE and /metrics parsing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import make_tiny_model

READY_TIMEOUT_S = 120.0  # start-up is seconds; the bound only keeps a broken server from hanging the run


def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny random qwen2 model (byte tokenizer, chat template) for every server test module."""
    folder = tmp_path_factory.getbasetemp() / "server-tiny-qwen2"
    if not (folder / "config.json").is_file():
        make_tiny_model(folder, "qwen2")
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(self, model: Path, log_path: Path, *flags: str, api_key: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        args = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--model", str(model),
                "--port", str(self.port), *flags]
        # One torch thread: on a shared 2-core machine, OpenMP spin-waiting makes steps ~50x slower.
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PAGODA_API_KEY": api_key or "", **(env or {})}
        self._log = open(log_path, "wb")  # a file, not a pipe: a full pipe would block the server
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {READY_TIMEOUT_S} s:\n{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        """Samples as {'name{label="v",...}': value}, parsed with prometheus_client's parser."""
        r = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10)
        assert r.status_code == 200, r.text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def start_server(tmp_path_factory: pytest.TempPathFactory, name: str, *flags: str, api_key: str | None = None,
                 env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """For a module-scoped fixture: yields a ready server, stops it afterwards."""
    model = tiny_model_dir(tmp_path_factory)
    server = ServerProcess(model, tmp_path_factory.getbasetemp() / f"{name}.log", *flags, api_key=api_key, env=env)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def sse_events(lines: list[str]) -> list[Any]:
    """The data payloads of an SSE stream: parsed JSON objects, and the literal '[DONE]'."""
    events: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def is_openai_error(body: Any) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and bool(err["message"]) and isinstance(err["type"], str))
