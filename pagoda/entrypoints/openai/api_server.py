"""The OpenAI-compatible HTTP server: FastAPI app, routes, the auth/drain gate, and `run_server`.

The engine runs in its own thread (AsyncEngine); this event loop only parses, validates, admits and
streams, so /health and /metrics answer in milliseconds however busy the engine is.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import pagoda
from pagoda.engine.async_engine import AsyncEngine
from pagoda.entrypoints.openai.protocol import (
    MAX_BODY_BYTES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    check_request_id,
    parse_body,
)
from pagoda.entrypoints.openai.serving import Job, OpenAIServing, RequestContext

logger = logging.getLogger(__name__)
T = TypeVar("T")
TEST_HOOKS_ENV = "PAGODA_ENABLE_TEST_HOOKS"  # "1" adds POST /_test/kill_engine_loop (never in production)
_OPEN_PATHS = ("/health",)


@dataclass
class ServerState:
    engine: AsyncEngine
    serving: OpenAIServing
    api_keys: list[str] = field(default_factory=list)
    draining: bool = False  # set on SIGTERM: refuse new work, let in-flight requests finish


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class Gate:
    """Pure ASGI middleware (it must not buffer streams): X-Request-Id, body size, draining, API key."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    def _check(self, scope: Scope, headers: dict[bytes, bytes]) -> APIError | None:
        path = scope["path"]
        if path not in _OPEN_PATHS:
            if self.state.draining:
                return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
            if self.state.api_keys:
                index = self._key_index(headers.get(b"authorization", b""))
                if index is None:
                    return APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                                    type="authentication_error", code="invalid_api_key")
                scope["state"]["api_key_index"] = index
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            return APIError(413, f"the body must be at most {MAX_BODY_BYTES} bytes", code="body_too_large")
        return None

    def _key_index(self, auth: bytes) -> int | None:
        token = auth[7:] if auth[:7].lower() == b"bearer " else b""
        found = None
        for i, key in enumerate(self.state.api_keys):  # every key is compared: no early exit
            if hmac.compare_digest(token, key.encode()) and found is None:
                found = i
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        raw_id = headers.get(b"x-request-id")
        request_id = raw_id.decode("latin-1") if raw_id is not None else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":  # echo the id on every answer, errors too
                hdrs = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in hdrs):
                    hdrs.append((b"x-request-id", state["request_id"].encode("latin-1")))
                message = {**message, "headers": hdrs}
            await send(message)

        try:
            check_request_id(request_id, "X-Request-Id")
            err = self._check(scope, headers)
        except APIError as e:
            state["request_id"] = uuid.uuid4().hex  # never echo a malformed id
            err = e
        if err is not None:
            await error_response(err)(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)


async def read_body(request: Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the body must be at most {MAX_BODY_BYTES} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class ClientGone(Exception):
    pass


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (which aborts its engine requests) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


class JobStream(StreamingResponse):
    """SSE response that aborts its engine requests however it ends (even if never iterated)."""

    def __init__(self, job: Job, body: AsyncIterator[str], headers: dict[str, str]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.abort_unfinished()


def _context(request: Request, state: ServerState, body_id: str | None, user: str | None) -> RequestContext:
    header_id = request.headers.get("x-request-id")
    request_id = header_id or check_request_id(body_id, "request_id") or request.state.request_id
    request.state.request_id = request_id
    # Tenants for fair sharing: each API key is one when several are configured; else the user field.
    key_index = request.scope["state"].get("api_key_index")
    tenant = f"key{key_index}" if len(state.api_keys) > 1 else user
    return RequestContext(request_id, tenant)


def build_app(engine: AsyncEngine, served_model_names: list[str], api_keys: list[str] | None = None) -> FastAPI:
    state = ServerState(engine, OpenAIServing(engine, served_model_names), list(api_keys or []))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="Pagoda", version=pagoda.__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state
    _add_error_handlers(app)
    _add_routes(app, state)
    app.add_middleware(Gate, state=state)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail), code="not_found"
                                       if exc.status_code == 404 else None))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return error_response(APIError(500, f"internal error: {exc!r}", type="server_error"))


def _add_routes(app: FastAPI, state: ServerState) -> None:
    serving, engine = state.serving, state.engine

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return error_response(APIError(503, "the server is shutting down", type="server_error"))
        if not engine.healthy:
            reason = engine.dead_reason or "the engine loop is not making progress"
            return error_response(APIError(503, reason, type="server_error", code="engine_unavailable"))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagoda.__version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "pagoda", "root": name,
                 "max_model_len": serving.max_model_len} for name in serving.served_model_names]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def generate(request: Request, req: CompletionRequest | ChatCompletionRequest,
                       prepare: Callable[[Any, RequestContext], Awaitable[Job]]) -> Response:
        ctx = _context(request, state, req.request_id, req.user)
        headers = {"X-Request-Id": ctx.request_id}
        job = await until_disconnect(request, prepare(req, ctx))
        if req.stream:
            return JobStream(job, serving.stream(job), headers)
        return JSONResponse(await until_disconnect(request, serving.collect(job)), headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_body(CompletionRequest, await read_body(request))
        return await generate(request, req, serving.prepare_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, await read_body(request))
        return await generate(request, req, serving.prepare_chat)

    _add_token_routes(app, state)
    _add_admin_routes(app, engine)
    if os.environ.get(TEST_HOOKS_ENV) == "1":
        _add_test_hooks(app, engine)


def _add_admin_routes(app: FastAPI, engine: AsyncEngine) -> None:
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, str]:
        if not await engine.reset_prefix_cache():
            raise APIError(409, "the prefix cache can only be reset while no request is running; retry when idle",
                           code="requests_running")
        return {"status": "ok"}


def _add_test_hooks(app: FastAPI, engine: AsyncEngine) -> None:
    @app.post("/_test/kill_engine_loop")
    async def kill_engine_loop() -> dict[str, str]:
        engine.kill_for_test()
        return {"status": "killing"}


def _add_token_routes(app: FastAPI, state: ServerState) -> None:
    serving = state.serving

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = parse_body(TokenizeRequest, await read_body(request))
        serving.check_model(req.model)
        tok = serving.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        def encode() -> list[int]:
            if req.messages is None:
                return tok.encode(req.prompt or "", req.add_special_tokens)
            text = tok.apply_chat_template([m.as_dict() for m in req.messages], req.add_generation_prompt)
            return tok.encode(text, add_special_tokens=False)

        try:
            ids = await asyncio.to_thread(encode)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse_body(DetokenizeRequest, await read_body(request))
        serving.check_model(req.model)
        serving.check_token_ids(req.tokens, "tokens")
        return {"prompt": serving.tokenizer.decode(req.tokens)}


class _Server(uvicorn.Server):
    """uvicorn's graceful shutdown, plus: /health and new requests answer 503 from the first signal."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self._state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._state.draining = True
        super().handle_exit(sig, frame)


def run_server(engine: AsyncEngine, *, host: str, port: int, served_model_names: list[str],
               api_keys: list[str] | None, shutdown_timeout: float) -> None:
    """Serve until SIGINT/SIGTERM; then drain for up to `shutdown_timeout` s, abort the rest, return."""
    app = build_app(engine, served_model_names, api_keys)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=max(0, math.ceil(shutdown_timeout)), lifespan="on")
    logger.info("serving %s on http://%s:%d", ", ".join(served_model_names), host, port)
    _Server(config, app.state.server).run()
