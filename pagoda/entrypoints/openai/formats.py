"""OpenAI response shapes for text completions and chat completions, streamed and not.

Logprobs arrive from the engine as one {token_id: logprob} dict per generated token (the top-N plus
the sampled token); `TokenLogprob` is that entry resolved against the sampled token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Token:
    text: str  # the token's text, or OpenAI's "bytes:\\xNN" spelling for part of a UTF-8 character
    bytes: list[int]


@dataclass(frozen=True)
class TokenLogprob:
    token: Token
    logprob: float | None  # None for the first prompt token (echo)
    top: list[tuple[Token, float]]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def resolve_logprobs(token_ids: list[int], entries: list[dict[int, float] | None], num_top: int,
                     token: Callable[[int], Token]) -> list[TokenLogprob]:
    out = []
    for tid, entry in zip(token_ids, entries, strict=False):  # a racing abort may leave one short
        if entry is None:
            out.append(TokenLogprob(token(tid), None, []))
            continue
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
        out.append(TokenLogprob(token(tid), entry.get(tid), [(token(t), lp) for t, lp in best]))
    return out


class ResponseFormat:
    """What differs between /v1/completions and /v1/chat/completions."""

    object_name = ""
    chunk_object = ""

    def __init__(self, response_id: str, model: str) -> None:
        self.id, self.model, self.created = response_id, model, int(time.time())

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[dict[str, Any]], use: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope(self.object_name), "choices": choices, "usage": use}

    def chunk(self, choices: list[dict[str, Any]], with_usage_field: bool) -> dict[str, Any]:
        body = {**self._envelope(self.chunk_object), "choices": choices}
        if with_usage_field:
            body["usage"] = None
        return body

    def usage_chunk(self, use: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object), "choices": [], "usage": use}

    def opening_chunks(self, num_choices: int, with_usage_field: bool) -> list[dict[str, Any]]:
        return []

    def choice(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None,
               logprobs: list[TokenLogprob] | None, text_offset: int) -> dict[str, Any]:
        raise NotImplementedError

    def delta(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None,
              logprobs: list[TokenLogprob] | None, text_offset: int) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    chunk_object = "text_completion"

    @staticmethod
    def _logprobs(entries: list[TokenLogprob] | None, text_offset: int) -> dict[str, Any] | None:
        if entries is None:
            return None
        offsets, pos = [], text_offset
        for e in entries:
            offsets.append(pos)
            pos += len(e.token.text)
        return {"tokens": [e.token.text for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t.text: lp for t, lp in e.top} if e.logprob is not None else None
                                 for e in entries],
                "text_offset": offsets}

    def choice(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None,
               logprobs: list[TokenLogprob] | None, text_offset: int) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": self._logprobs(logprobs, text_offset),
                "finish_reason": finish_reason, "stop_reason": stop_reason}

    delta = choice  # a streamed chunk's choice has the same shape, with the new text


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    @staticmethod
    def _logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None

        def item(token: Token, lp: float) -> dict[str, Any]:
            return {"token": token.text, "logprob": lp, "bytes": token.bytes}

        return {"content": [{**item(e.token, e.logprob if e.logprob is not None else 0.0),
                             "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}

    def choice(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None,
               logprobs: list[TokenLogprob] | None, text_offset: int) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason, "stop_reason": stop_reason}

    def opening_chunks(self, num_choices: int, with_usage_field: bool) -> list[dict[str, Any]]:
        # OpenAI's first chunk of each choice names the role.
        choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(num_choices)]
        return [self.chunk(choices, with_usage_field)]

    def delta(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None,
              logprobs: list[TokenLogprob] | None, text_offset: int) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": self._logprobs(logprobs),
                "finish_reason": finish_reason, "stop_reason": stop_reason}
