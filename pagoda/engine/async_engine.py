"""AsyncEngine: the synchronous LLMEngine driven by one thread, for an asyncio server.

The engine is not thread-safe, so exactly one thread (the engine loop) ever touches it. The HTTP
event loop talks to it through a thread-safe queue of typed commands (add, abort), never pickled.
Outputs go back through per-request asyncio queues fed with loop.call_soon_threadsafe. Between two
model steps the loop drains every command, so an abort (a client that went away) takes effect
before the next step.

Admission runs in the loop too, because it needs the engine's view of the KV cache: a request is
admitted only if its KV demand (prompt blocks after prefix hits, plus room for max_tokens per
sample) fits in the free blocks less the demand of requests admitted but not yet started. Those
reservations are released at a request's first output (or finish, or abort). The waiting count is
bounded by max_queued_requests. Rejections answer at once, before any model work is spent.

If the loop dies, every in-flight request gets a `Failure` and later adds raise EngineDeadError;
`healthy` is False from then on, and also when the loop stops making progress.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from pagoda.engine.llm_engine import LLMEngine
from pagoda.metrics import ServerMetrics
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.2  # an idle loop still wakes this often, so its heartbeat stays fresh


class EngineDeadError(RuntimeError):
    """The engine loop is not running (it died, or the server is shutting down)."""


class AdmissionRejected(Exception):
    """Refused at admission (load shedding); the client should retry later."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # "queue_full" | "kv_cache"


@dataclass(frozen=True)
class EngineRequest:
    request_id: str  # unique among live requests (the server makes it so)
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    tenant: str | None = None


@dataclass(frozen=True)
class Failure:
    """Sent to a request's channel instead of outputs when the engine loop dies."""

    message: str


class Channel:
    """Where the engine thread sends the outputs of one HTTP request (one or more engine requests)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[str, RequestOutput | Failure]] = asyncio.Queue()

    def push(self, request_id: str, item: RequestOutput | Failure) -> None:
        """Thread-safe: called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (request_id, item))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def get(self) -> tuple[str, RequestOutput | Failure]:
        return await self._queue.get()


def _settle(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():
        fut.set_result(value)


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None], exc: BaseException | None) -> None:
    """Thread-safe: settle an admission future unless its waiter was cancelled meanwhile."""
    def settle() -> None:
        if not fut.done():
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass


@dataclass
class _Add:
    request: EngineRequest
    channel: Channel
    admitted: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Kill:
    """Test hook: makes the loop raise, as a bug in the engine would."""


class _Stop:
    pass


@dataclass(frozen=True)
class _ResetPrefixCache:
    done: asyncio.Future[bool]
    loop: asyncio.AbstractEventLoop


_Command = _Add | _Abort | _Kill | _Stop | _ResetPrefixCache


@dataclass
class _Live:
    """The engine thread's record of an admitted request."""

    channel: Channel
    reserved_blocks: int
    started: bool = False  # produced its first output; its KV reservation is released
    last_token_time: float = 0.0
    num_tokens: int = 0


@dataclass
class _Admission:
    max_queued_requests: int
    reserved_blocks: int = 0  # KV demand of admitted requests that have not started yet
    num_queued: int = 0  # admitted requests that have not started yet
    live: dict[str, _Live] = field(default_factory=dict)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model_name: str, *, max_queued_requests: int = 1024,
                 stall_timeout_s: float = 120.0) -> None:
        if max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be at least 1, got {max_queued_requests}")
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self.snapshot: dict[str, int | float] = engine.get_metrics()  # replaced (never mutated) by the loop
        self.metrics = ServerMetrics(model_name, lambda: self.snapshot)
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._lock = threading.Lock()  # orders "is it dead?" against "queue a command"
        self._dead: str | None = None
        self._adm = _Admission(max_queued_requests)
        self._heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)

    # ---- called from the event loop ----------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is still running and end the loop."""
        with self._lock:
            if self._dead is None:
                self._commands.put(_Stop())
        self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return (self._dead is None and self._thread.is_alive()
                and time.monotonic() - self._heartbeat < self.stall_timeout_s)

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    async def add(self, request: EngineRequest, channel: Channel) -> None:
        """Queue a request; returns once admitted. Raises AdmissionRejected, ValueError (a bad
        request, naming the field) or EngineDeadError. Outputs then arrive on `channel`."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._put(_Add(request, channel, fut, loop))
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(request.request_id)  # queued after the add, so it always finds it
            raise

    def abort(self, request_id: str) -> None:
        """Abort a request (all its samples); takes effect before the engine's next step."""
        try:
            self._put(_Abort(request_id))
        except EngineDeadError:
            pass  # nothing runs any more

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached KV block; False (nothing done) while requests are running."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bool] = loop.create_future()
        self._put(_ResetPrefixCache(done, loop))
        return await done

    def kill_for_test(self) -> None:
        self._put(_Kill())

    def _put(self, cmd: _Command) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            self._commands.put(cmd)

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        reason = "the server is shutting down"
        try:
            while self._drain_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self.snapshot = self.engine.get_metrics()  # aborts free blocks without a step
                self._heartbeat = time.monotonic()
                self.metrics.maybe_log(self._heartbeat)
        except BaseException as exc:  # noqa: B036 -- whatever kills the loop must fail requests, not hang them
            logger.exception("the engine loop died")
            reason = f"the engine loop died: {exc!r}"
        self._close(reason)

    def _drain_commands(self, block: bool) -> bool:
        """Apply every queued command; False once asked to stop."""
        try:
            cmd = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Kill):
                raise RuntimeError("engine loop killed by the test hook")
            if isinstance(cmd, _Abort):
                self._abort(cmd.request_id)
            elif isinstance(cmd, _ResetPrefixCache):
                cmd.loop.call_soon_threadsafe(_settle, cmd.done, self.engine.reset_prefix_cache())
            else:
                self._admit(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _admit(self, cmd: _Add) -> None:
        req, adm = cmd.request, self._adm
        try:
            demand = self._kv_demand(req)
            rejection = self._check_admission(demand)
            if rejection is not None:
                self.metrics.reject(rejection.reason)
                _resolve(cmd.loop, cmd.admitted, rejection)
                return
            self.engine.add_request(req.request_id, req.prompt_token_ids, req.params, req.priority,
                                    cache_salt=req.cache_salt, tenant=req.tenant)
        except ValueError as e:
            _resolve(cmd.loop, cmd.admitted, e)
            return
        adm.live[req.request_id] = _Live(cmd.channel, demand)
        adm.reserved_blocks += demand
        adm.num_queued += 1
        _resolve(cmd.loop, cmd.admitted, None)

    def _kv_demand(self, req: EngineRequest) -> int:
        demand = self.engine.kv_demand_blocks(req.prompt_token_ids, req.params.max_tokens, req.params.n,
                                              req.cache_salt)
        # A request bigger than the whole cache still runs alone (the engine caps its length).
        return min(demand, int(self.snapshot["kv_blocks_total"]))

    def _check_admission(self, demand: int) -> AdmissionRejected | None:
        adm = self._adm
        if adm.num_queued >= adm.max_queued_requests:
            return AdmissionRejected("queue_full", f"the server is overloaded: {adm.num_queued} requests are "
                                                   "already waiting; retry later")
        available = self.engine.kv_free_blocks() - adm.reserved_blocks
        if demand > available:
            return AdmissionRejected("kv_cache", f"the server is overloaded: the request needs {demand} KV cache "
                                                 f"blocks and {max(available, 0)} are free; retry later")
        return None

    def _release(self, live: _Live) -> None:
        if not live.started:
            live.started = True
            self._adm.reserved_blocks -= live.reserved_blocks
            self._adm.num_queued -= 1

    def _abort(self, request_id: str) -> None:
        live = self._adm.live.pop(request_id, None)
        if live is None:
            return  # finished already, or never admitted
        self._release(live)
        out = self.engine.abort_request(request_id)
        if out is not None:
            self.metrics.observe_finished(out)
            live.channel.push(request_id, out)

    def _step(self) -> None:
        before = self.snapshot
        outputs = self.engine.step()
        self.snapshot = snap = self.engine.get_metrics()
        computed = (snap["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"]
                    + snap["num_generation_tokens"] - before["num_generation_tokens"])
        if computed > 0:
            self.metrics.iteration_tokens.observe(computed)
        now = time.monotonic()
        for out in outputs:
            live = self._adm.live.get(out.request_id)
            if live is None:
                continue
            self._observe_tokens(live, out, now)
            if out.finished:
                del self._adm.live[out.request_id]
                self.metrics.observe_finished(out)
            live.channel.push(out.request_id, out)

    def _observe_tokens(self, live: _Live, out: RequestOutput, now: float) -> None:
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        if num_tokens > live.num_tokens:
            if live.started:
                self.metrics.itl.observe(now - live.last_token_time)
            else:
                self.metrics.observe_first_token(out)
            live.last_token_time, live.num_tokens = now, num_tokens
        self._release(live)

    def _close(self, reason: str) -> None:
        """Fail everything in flight and refuse everything after: nothing may hang."""
        with self._lock:
            self._dead = reason
        failure = Failure(reason)
        for request_id, live in list(self._adm.live.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine may be broken; the clients must hear back regardless
                logger.exception("abort of %s failed", request_id)
            live.channel.push(request_id, failure)
        self._adm.live.clear()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                _resolve(cmd.loop, cmd.admitted, EngineDeadError(reason))
        self._heartbeat = 0.0
