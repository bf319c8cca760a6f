"""The OpenAI endpoints' logic: validated request -> prompt token ids -> admitted engine requests ->
one JSON response, or an SSE stream of deltas.

Streaming rules: a running sample's text is cumulative and, when stop strings are set, its tail may
still be cut (the stop string is removed once it completes), so the last (longest stop - 1)
characters are held back until the sample finishes; the engine never splits a UTF-8 character.
So the joined deltas equal the non-streamed text, and every stream ends with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.async_engine import AdmissionRejected, AsyncEngine, Channel, EngineDeadError, EngineRequest, Failure
from pagoda.entrypoints.openai.formats import (
    ChatFormat,
    CompletionFormat,
    ResponseFormat,
    Token,
    TokenLogprob,
    resolve_logprobs,
    usage,
)
from pagoda.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingRequest,
    bad_request,
    check_context,
    value_error,
)
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import _bytes_to_unicode

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


@dataclass
class RequestContext:
    request_id: str  # what the client sees: X-Request-Id, the body's request_id, or a generated one
    tenant: str | None


@dataclass(frozen=True)
class Prompt:
    text: str | None  # for echo; None when only token ids are known
    token_ids: list[int]


@dataclass
class _ChoiceState:
    sent_chars: int = 0
    sent_tokens: int = 0
    text_offset: int = 0  # characters already in front of the next token (completions' text_offset)
    done: bool = False


@dataclass
class Job:
    """One HTTP request's engine requests (one per prompt), all admitted, and how to answer."""

    engine: AsyncEngine
    channel: Channel
    request_ids: list[str]  # one per prompt, in prompt order
    prompts: list[Prompt]
    params: SamplingParams
    fmt: ResponseFormat
    include_usage: bool = False
    echo: bool = False
    finished: dict[str, RequestOutput] = field(default_factory=dict)

    def abort_unfinished(self) -> None:
        for rid in self.request_ids:
            if rid not in self.finished:
                self.engine.abort(rid)

    def usage(self) -> dict[str, Any]:
        outs = list(self.finished.values())
        return usage(sum(len(p.token_ids) for p in self.prompts),
                     sum(len(c.token_ids) for o in outs for c in o.outputs),
                     sum(o.num_cached_tokens for o in outs))


_BYTE_LEVEL = {ch: b for b, ch in _bytes_to_unicode().items()}


def _raw_bytes(spelled: str | None) -> bytes | None:
    """The bytes of a vocabulary entry: byte-level BPE spelling, or a <0xNN> byte-fallback token."""
    if spelled is None:
        return None
    if len(spelled) == 6 and spelled.startswith("<0x") and spelled.endswith(">"):
        return bytes([int(spelled[3:5], 16)])
    if all(ch in _BYTE_LEVEL for ch in spelled):
        return bytes(_BYTE_LEVEL[ch] for ch in spelled)
    return None


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def engine_error(exc: BaseException) -> APIError:
    if isinstance(exc, AdmissionRejected):
        return APIError(429, str(exc), type="rate_limit_error", code=exc.reason,
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_unavailable")
    if isinstance(exc, ValueError):
        return value_error(exc)
    raise exc


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_model_names: list[str]) -> None:
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.limits.max_model_len
        self.vocab_size = engine.engine.arch.vocab_size
        self.served_model_names = served_model_names
        self._ids = itertools.count()
        self._tokens: dict[int, Token] = {}

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def token(self, token_id: int) -> Token:
        """A token as logprobs show it; a piece of a UTF-8 character is spelled by its bytes, as OpenAI does."""
        tok = self._tokens.get(token_id)
        if tok is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = _raw_bytes(self.tokenizer.hf.id_to_token(token_id)) if "\ufffd" in text else None
            if not text and self.tokenizer.hf.id_to_token(token_id) is None:
                tok = Token(f"token_id:{token_id}", [])  # a model id the tokenizer has no entry for
            elif raw is None:
                tok = Token(text, list(text.encode("utf-8")))
            else:
                tok = Token("bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw))
            self._tokens[token_id] = tok
        return tok

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise bad_request(f"{param} token ids must be integers in [0, {self.vocab_size})", param)

    # ---- preparing requests -------------------------------------------------------------------
    async def _prompt(self, prompt: str | list[int], need_text: bool) -> Prompt:
        if isinstance(prompt, str):
            return Prompt(prompt, await asyncio.to_thread(self.tokenizer.encode, prompt))
        self.check_token_ids(prompt, "prompt")
        return Prompt(self.tokenizer.decode(prompt) if need_text else None, list(prompt))

    async def prepare_completion(self, req: CompletionRequest, ctx: RequestContext) -> Job:
        self.check_model(req.model)
        prompts = [await self._prompt(p, req.echo) for p in req.prompts()]
        for p in prompts:
            check_context(len(p.token_ids), req.max_tokens, self.max_model_len, "prompt")
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        params = req.build_sampling_params(req.max_tokens, req.logprobs, prompt_logprobs, self.vocab_size)
        fmt = CompletionFormat(f"cmpl-{ctx.request_id}", req.model or self.served_model_names[0])
        return await self._submit(req, ctx, prompts, params, fmt, echo=req.echo)

    async def prepare_chat(self, req: ChatCompletionRequest, ctx: RequestContext) -> Job:
        self.check_model(req.model)
        messages = [m.as_dict() for m in req.messages]

        def render() -> list[int]:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
            return self.tokenizer.encode(text, add_special_tokens=False)

        try:
            ids = await asyncio.to_thread(render)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        max_tokens = req.output_limit()
        check_context(len(ids), max_tokens, self.max_model_len, "messages")
        params = req.build_sampling_params(max_tokens, req.num_logprobs(), None, self.vocab_size)
        fmt = ChatFormat(f"chatcmpl-{ctx.request_id}", req.model or self.served_model_names[0])
        return await self._submit(req, ctx, [Prompt(None, ids)], params, fmt)

    async def _submit(self, req: _SamplingRequest, ctx: RequestContext, prompts: list[Prompt],
                      params: SamplingParams, fmt: ResponseFormat, echo: bool = False) -> Job:
        """Admit every prompt's engine request, or none (a batch is all-or-nothing)."""
        job = Job(self.engine, Channel(), [f"srv-{next(self._ids)}" for _ in prompts], prompts, params, fmt,
                  include_usage=req.include_usage, echo=echo)
        added: list[str] = []
        try:
            for rid, p in zip(job.request_ids, prompts, strict=True):
                await self.engine.add(EngineRequest(rid, p.token_ids, params, req.priority, req.cache_salt,
                                                    ctx.tenant), job.channel)
                added.append(rid)
        except BaseException as e:
            for rid in added:
                self.engine.abort(rid)
            if isinstance(e, AdmissionRejected | EngineDeadError | ValueError):
                raise engine_error(e) from None
            raise
        return job

    # ---- answering --------------------------------------------------------------------------
    async def _next(self, job: Job) -> tuple[str, RequestOutput]:
        rid, item = await job.channel.get()
        if isinstance(item, Failure):
            raise APIError(500, item.message, type="server_error", code="engine_error")
        if item.finished:
            job.finished[rid] = item
        return rid, item

    async def collect(self, job: Job) -> dict[str, Any]:
        try:
            while len(job.finished) < len(job.request_ids):
                await self._next(job)
        finally:
            job.abort_unfinished()  # cancelled: the client went away
        choices = []
        for i, rid in enumerate(job.request_ids):
            out = job.finished[rid]
            for comp in out.outputs:
                choice = self._choice(job, i, out, comp, _ChoiceState(), streaming=False)
                assert choice is not None  # not streaming: every sample has a choice
                choices.append(choice)
        return job.fmt.response(choices, job.usage())

    async def stream(self, job: Job) -> AsyncIterator[str]:
        states: dict[int, _ChoiceState] = {}
        num_choices = len(job.request_ids) * job.params.n
        try:
            for chunk in job.fmt.opening_chunks(num_choices, job.include_usage):
                yield sse(chunk)
            while len(job.finished) < len(job.request_ids):
                rid, out = await self._next(job)
                p = job.request_ids.index(rid)
                choices = []
                for comp in out.outputs:
                    state = states.setdefault(p * job.params.n + comp.index, _ChoiceState())
                    choice = self._choice(job, p, out, comp, state, streaming=True)
                    if choice is not None:
                        choices.append(choice)
                if choices:
                    yield sse(job.fmt.chunk(choices, job.include_usage))
            if job.include_usage:
                yield sse(job.fmt.usage_chunk(job.usage()))
        except APIError as e:
            yield sse(e.body())
        except Exception as e:  # a bug: still end the stream properly
            logger.exception("stream failed")
            yield sse(APIError(500, f"internal error: {e!r}", type="server_error").body())
        finally:
            job.abort_unfinished()
        yield "data: [DONE]\n\n"

    def _choice(self, job: Job, p: int, out: RequestOutput, comp: CompletionOutput, state: _ChoiceState,
                streaming: bool) -> dict[str, Any] | None:
        """The choice for sample `comp` of prompt `p`: all of it, or (streaming) what is new and safe."""
        if state.done:
            return None
        holdback = max((len(s) for s in job.params.stop_strings), default=1) - 1
        end = len(comp.text) if comp.finished or not streaming else max(state.sent_chars, len(comp.text) - holdback)
        text = comp.text[state.sent_chars:end]
        new_tokens = range(state.sent_tokens, len(comp.token_ids))
        logprobs = self._logprobs(job, comp, new_tokens)
        if job.echo and state.sent_chars == 0 and state.sent_tokens == 0:
            prompt = job.prompts[p]
            text = (prompt.text or "") + text
            if logprobs is not None and out.prompt_logprobs is not None:
                logprobs = self._prompt_logprobs(job, prompt, out) + logprobs
        if streaming and not text and not comp.finished and not (logprobs and len(new_tokens)):
            return None
        offset = state.text_offset
        state.sent_chars, state.sent_tokens, state.done = end, len(comp.token_ids), comp.finished
        state.text_offset += sum(len(e.token.text) for e in logprobs or [])
        delta = job.fmt.delta if streaming else job.fmt.choice
        return delta(p * job.params.n + comp.index, text, comp.finish_reason, comp.stop_reason, logprobs, offset)

    def _logprobs(self, job: Job, comp: CompletionOutput, tokens: range) -> list[TokenLogprob] | None:
        if job.params.logprobs is None or comp.logprobs is None:
            return None
        ids = comp.token_ids[tokens.start:tokens.stop]
        entries: list[dict[int, float] | None] = list(comp.logprobs[tokens.start:tokens.stop])
        return resolve_logprobs(ids, entries, job.params.logprobs, self.token)

    def _prompt_logprobs(self, job: Job, prompt: Prompt, out: RequestOutput) -> list[TokenLogprob]:
        assert out.prompt_logprobs is not None and job.params.prompt_logprobs is not None
        n = min(len(prompt.token_ids), len(out.prompt_logprobs))
        return resolve_logprobs(prompt.token_ids[:n], out.prompt_logprobs[:n], job.params.prompt_logprobs,
                                self.token)
