"""Request models and validation for the OpenAI-compatible API: the one place where client input is
checked. Pydantic checks shapes and types (strictly: "2" is not an integer); SamplingParams checks
every range (it is the single source of truth shared with the CLI and the offline API); the context
length and the vocabulary are checked against the engine's limits. Every failure becomes an
`APIError` that renders as OpenAI's error JSON, with the offending field in `param`.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagoda.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_N,
    SamplingParams,
)

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_BATCH_PROMPTS = 64  # prompts in one /v1/completions request
MAX_MESSAGES = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_ID_LEN = 128  # request ids (X-Request-Id, request_id), model names, user
MAX_PROMPT_TOKEN_IDS = 1 << 20  # a token-id prompt longer than this can never fit a context anyway
M = TypeVar("M", bound=BaseModel)
_REQUEST_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_ID_LEN}}}")
_CONTENT = re.compile(r"messages\[\d+\]\.content")


class APIError(Exception):
    """An error answer: HTTP status plus OpenAI's {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def param_of(message: str) -> str | None:
    """The request field a ValueError from SamplingParams or the engine is about: messages start with it."""
    if message.startswith("each stop string"):
        return "stop"
    m = re.match(r"(?:prompts\[\d+\]: )?([a-z_]+)", message)
    return m.group(1) if m and m.group(1) in _FIELD_NAMES else None


def value_error(exc: ValueError) -> APIError:
    message = str(exc)
    return bad_request(message, param_of(message))


def check_request_id(value: str | None, param: str) -> str | None:
    if value is not None and not _REQUEST_ID.fullmatch(value):
        raise bad_request(f"{param} must be 1 to {MAX_ID_LEN} printable ASCII characters without spaces", param)
    return value


# ---- models ----------------------------------------------------------------------------------------
class _Strict(BaseModel):
    # Unknown fields are ignored (clients such as LangChain send extras); known ones are typed strictly.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras)."""

    model: str | None = Field(None, max_length=MAX_ID_LEN)
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None  # counts and lengths: SamplingParams
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    user: str | None = Field(None, max_length=MAX_ID_LEN)
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    request_id: str | None = None
    # Known to OpenAI's API (or vLLM's) but not implemented here. Unknown fields are ignored, but these would
    # change what the client gets back, so each is refused (check_supported) where it asks for more than the
    # plain default, rather than dropped silently.
    best_of: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    truncate_prompt_tokens: Any = None

    def check_supported(self) -> None:
        """Refuse (400, code "unsupported") a request that asks for something this server does not do."""
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of is not supported: leave it out or set it to n ({self.n}), got "
                              f"{self.best_of!r}", "best_of", code="unsupported")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise bad_request('response_format is not supported: only {"type": "text"} (the default)',
                              "response_format", code="unsupported")
        if self.tools or self.functions:
            name = "tools" if self.tools else "functions"
            raise bad_request(f"{name} (tool calling) is not supported", name, code="unsupported")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                raise bad_request(f"{name} is not supported: tool calling is not implemented", name,
                                  code="unsupported")
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                     "truncate_prompt_tokens"):
            if getattr(self, name) is not None:
                raise bad_request(f"{name} is not supported", name, code="unsupported")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def build_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                              prompt_logprobs: int | None, vocab_size: int) -> SamplingParams:
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        try:
            params = SamplingParams(
                n=self.n, temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0),
                top_k=pick(self.top_k, -1), min_p=pick(self.min_p, 0.0), seed=self.seed,
                presence_penalty=pick(self.presence_penalty, 0.0),
                frequency_penalty=pick(self.frequency_penalty, 0.0),
                repetition_penalty=pick(self.repetition_penalty, 1.0),
                logit_bias=dict(self.logit_bias) if self.logit_bias is not None else None,  # type: ignore[arg-type]
                stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output)
            params.check_vocab(vocab_size)
        except ValueError as e:
            raise value_error(e) from None
        return params


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(max_length=MAX_PROMPT_TOKEN_IDS)
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix is not None:
            raise bad_request("suffix is not supported", "suffix", code="unsupported")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one text or token-id list, or a batch of them."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        if len(p) > MAX_BATCH_PROMPTS:
            raise bad_request(f"prompt may hold at most {MAX_BATCH_PROMPTS} prompts, got {len(p)}", "prompt")
        if len(p) * self.n > MAX_N:
            raise bad_request(f"prompts x n must be at most {MAX_N}, got {len(p)} x {self.n}", "n")
        return list(p)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str = Field(min_length=1, max_length=64)
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=MAX_ID_LEN)

    def as_dict(self) -> dict[str, str]:
        content = self.content
        text = "".join(p.text for p in content) if isinstance(content, list) else (content or "")
        out = {"role": self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        if not self.logprobs:
            return None
        top = self.top_logprobs or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        return top


class TokenizeRequest(_Strict):
    model: str | None = Field(None, max_length=MAX_ID_LEN)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = Field(None, max_length=MAX_ID_LEN)
    tokens: list[int] = Field(max_length=MAX_PROMPT_TOKEN_IDS)


_MODELS: tuple[type[BaseModel], ...] = (StreamOptions, CompletionRequest, ChatCompletionRequest, ChatMessage,
                                        TextPart, TokenizeRequest, DetokenizeRequest)
_FIELD_NAMES = frozenset(name for m in _MODELS for name in m.model_fields) | {"logit_bias", "prompt"}


# ---- parsing ---------------------------------------------------------------------------------------
def _param_path(loc: tuple[int | str, ...]) -> str | None:
    """'messages[2].content' from pydantic's loc, dropping union-member tags such as 'list[int]'."""
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif part in _FIELD_NAMES:
            parts.append(("." if parts else "") + part)
    return "".join(parts) or None


def parse_body(model: type[M], body: bytes) -> M:
    """Validate a raw JSON body: invalid UTF-8, malformed JSON, a non-object or a bad field -> 400."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise bad_request(f"the body is not valid JSON: {err['msg']}", code="invalid_json") from None
        if err["type"] == "model_type" and not err["loc"]:
            raise bad_request("the body must be a JSON object", code="invalid_json") from None
        param = _param_path(tuple(err["loc"]))
        if param is not None and _CONTENT.fullmatch(param):  # pydantic names only the union's first member
            raise bad_request(f'{param} must be a string or a list of text parts ({{"type": "text", "text": ...}}); '
                              "images, audio and files are not supported", param) from None
        raise bad_request(f"{param or 'body'}: {err['msg']}", param) from None
    except (ValueError, RecursionError) as e:  # e.g. nesting too deep for the parser
        raise bad_request(f"the body could not be parsed: {e}", code="invalid_json") from None
    if isinstance(request, _SamplingRequest):
        request.check_supported()
    return request


def check_context(num_prompt: int, max_tokens: int | None, max_model_len: int, prompt_param: str) -> None:
    """The prompt, and the prompt plus the requested output, must fit the model's context."""
    if num_prompt >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has {num_prompt} "
            f"tokens (it must be shorter than {max_model_len} to leave room for output).",
            prompt_param, code="context_length_exceeded")
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but {num_prompt + max_tokens} were "
            f"requested ({num_prompt} in the prompt, {max_tokens} for the output). Reduce the prompt or max_tokens.",
            "max_tokens", code="context_length_exceeded")
