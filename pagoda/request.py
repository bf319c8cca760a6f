"""Request state as the scheduler sees it: tokens, how many are in the KV cache, status, timings."""

from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from pagoda.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class Request:
    """One sequence being generated. `num_tokens - num_computed_tokens` is what it still needs."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_total_tokens: int  # prompt + output may not pass this (max_model_len or the cache's capacity)
    priority: int = 0  # lower runs sooner
    arrival_time: float = field(default_factory=time.monotonic)
    seed: int = 0  # seeds this request's own generator (params.seed, or one drawn by the engine)
    cache_salt: str | None = None  # prefix-cache isolation: only requests with the same salt share blocks
    tenant: str | None = None  # fairness: who the request is for (API key or user)
    # Sample i > 0 of an n > 1 request waits for sample 0 to compute the prompt's full blocks, then
    # shares them (prefix lookup) and computes only the prompt's last partial block itself.
    follows: Request | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks so far
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first schedule
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    stop_reason: int | str | None = None

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self._uniforms: Any = None
        self._token_array: array | None = None

    @property
    def uniforms(self) -> Any:
        """This request's uniform draws (pagoda.layers.sampler.UniformStream) from its own torch.Generator, seeded
        with `seed`; made on first use (keeps core/ free of torch)."""
        if self._uniforms is None:
            import torch

            from pagoda.layers.sampler import UniformStream

            self._uniforms = UniformStream(torch.Generator().manual_seed(self.seed))
        return self._uniforms

    def token_array(self) -> array:
        """The request's token ids, prompt then outputs, as an int32 array kept across calls: converted on first
        use, then extended by the tokens added since the last call. While a request runs its outputs only grow (the
        tokens after a stop inside a call are dropped as it finishes; a shorter list is converted anew), so its
        readers, the n-gram proposer's search and the sampler's penalties in C++, cost O(the new tokens) a step,
        not O(the request's length): converting 4,096 Python ints to an array takes ~0.1 ms. Valid until the
        request's tokens change."""
        tokens, n = self._token_array, self.num_tokens
        if tokens is None or len(tokens) > n:
            tokens = self._token_array = array("i", self.prompt_token_ids)
        if len(tokens) < n:
            tokens.extend(self.token_ids(len(tokens), n))
        return tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_reachable_tokens(self) -> int:
        """The most tokens this request can reach: its prompt and max_tokens, within max_total_tokens."""
        if self.params.max_tokens is None:
            return self.max_total_tokens
        return min(self.max_total_tokens, self.num_prompt_tokens + self.params.max_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def stop_tokens(self) -> frozenset[int]:
        """The tokens that end this request once min_tokens are out: EOS (unless ignore_eos) and stop_token_ids."""
        eos = frozenset() if self.params.ignore_eos else self.eos_token_ids
        return eos | frozenset(self.params.stop_token_ids or ())

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids in [start, end) over prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def sort_key(self) -> tuple[int, float, str]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time, self.request_id)
