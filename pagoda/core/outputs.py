"""The contract between the scheduler (core) and the model runner (worker)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.request import Request


@dataclass
class ScheduledSeq:
    """One request's share of a step: tokens [start_pos, start_pos + num_new_tokens)."""

    request: Request
    num_new_tokens: int
    start_pos: int  # == request.num_computed_tokens when scheduled
    block_table: list[int]
    # Draft tokens to verify after the request's last token (speculative decoding, core/ngram.py): they are the
    # last len(draft) of num_new_tokens, and the runner returns the ones it accepted and one more token
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step brings the request up to date, so its last logits give a new token."""
        return self.start_pos + self.num_new_tokens - len(self.draft) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)  # batch order: decodes first, then prompt chunks
    preempted: list[str] = field(default_factory=list)
    # Second-tier copies to make before the forward pass, outs first: (block, slot) and (slot, block).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Decode steps to run (each sequence then has a token in each, its own sampled token the next's input), with
    # the blocks of all of them in the tables; the runner may run fewer (ModelRunnerOutput.more says how many).
    num_steps: int = 1

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None = None


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, SampledToken] = field(default_factory=dict)  # only requests whose step samples
    # Where the runner ran several decode steps (SchedulerOutput.num_steps), or accepted draft tokens
    # (ScheduledSeq.draft): each request's tokens after the first
    more: dict[str, list[SampledToken]] = field(default_factory=dict)
    # Per request asking for prompt logprobs: (index of the first prompt token covered, one dict per
    # prompt token from there on) for the prompt positions computed this step.
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)

    def add(self, request_id: str, tokens: list[SampledToken]) -> None:
        """A request's tokens of this step, in order (one, or several: `more` takes those after the first)."""
        self.sampled[request_id] = tokens[0]
        if len(tokens) > 1:
            self.more[request_id] = tokens[1:]
