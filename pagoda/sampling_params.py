"""SamplingParams: what a request asks of the sampler, validated once at construction.

Every bound is checked here so that the CLI, the offline API and (later) the server share one
set of rules; each error names the field and the allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Hard bounds that keep one request from asking for unbounded work.
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_SEED = 2**63 - 1


def _check_finite(name: str, value: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _check_range(name: str, value: float, lo: float, hi: float, what: str) -> None:
    _check_finite(name, value)
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _check_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


@dataclass
class SamplingParams:
    """Per-request sampling settings. temperature == 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per generated token (the chosen one is always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        _check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n}")
        _check_range("temperature", self.temperature, 0.0, 100.0, "in [0, 100] (0 means greedy)")
        _check_finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k}")
        _check_range("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed <= MAX_SEED:
                raise ValueError(f"seed must be in [0, 2**63 - 1], got {self.seed}")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_finite("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        self._validate_logit_bias()
        self._validate_stops()
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must be a mapping of token id to bias")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        clean: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            try:
                token_id = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids (integers), got {key!r}") from None
            if token_id < 0:
                raise ValueError(f"logit_bias token ids must be non-negative, got {token_id}")
            _check_range(f"logit_bias[{token_id}]", bias, -100.0, 100.0, "in [-100, 100]")
            clean[token_id] = float(bias)
        self.logit_bias = clean

    def _validate_stops(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
        for s in stops:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN:
                raise ValueError(f"each stop string must be a non-empty string of at most "
                                 f"{MAX_STOP_STRING_LEN} characters, got {s!r}")
        self.stop_strings = stops
        ids = list(self.stop_token_ids or [])
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", list(self.logit_bias or {})), ("stop_token_ids", self.stop_token_ids or [])):
            for t in ids:
                if t >= vocab_size:
                    raise ValueError(f"{name} token id {t} is outside the vocabulary [0, {vocab_size})")
