"""What a caller gets back: RequestOutput with one CompletionOutput per sample (n)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.request import RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # one dict per generated token, when asked for
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # None for the first prompt token
    metrics: RequestMetrics | None = None
    sample_metrics: list[RequestMetrics] = field(default_factory=list)

    # The first sample's fields, for the common n == 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
