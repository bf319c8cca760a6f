"""Turns sampled tokens into text: incremental detokenization, stop strings, RequestOutput.

One `SeqState` per sample; one `ParentState` per user request (n samples). Stop strings are matched
on the text, so across token boundaries; the matched string is cut from the text unless
include_stop_str_in_output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.core.outputs import SampledToken
from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import Tokenizer


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The earliest stop string that ends in the last `num_new_chars` characters: (stop, start)."""
    best: tuple[str, int] | None = None
    for stop in stops:
        # A match must end inside the new text, so it starts no earlier than this.
        begin = max(0, len(text) - num_new_chars - len(stop) + 1)
        idx = text.find(stop, begin)
        if idx != -1 and (best is None or idx < best[1]):
            best = (stop, idx)
    return best


@dataclass
class SeqState:
    index: int
    request: Request
    detok: IncrementalDetokenizer
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add_token(self, token: SampledToken) -> bool:
        """Append one token's text; True if a stop string now ends the sequence."""
        p = self.request.params
        self.cumulative_logprob += token.logprob
        if self.logprobs is not None and token.top_logprobs is not None:
            self.logprobs.append(token.top_logprobs)
        piece = self.detok.add_tokens([token.token_id])
        self.text += piece
        if not p.stop_strings or not piece:
            return False
        hit = find_stop_string(self.text, len(piece), p.stop_strings)
        if hit is None:
            return False
        stop, idx = hit
        self.text = self.text[: idx + len(stop)] if p.include_stop_str_in_output else self.text[:idx]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def finish(self, status: RequestStatus) -> None:
        if self.finish_reason is not None:
            return
        if status is not RequestStatus.FINISHED_ABORTED:
            self.text += self.detok.finish()
        self.finish_reason = status.value
        self.stop_reason = self.request.stop_reason

    def completion(self) -> CompletionOutput:
        return CompletionOutput(index=self.index, text=self.text, token_ids=list(self.request.output_token_ids),
                                cumulative_logprob=self.cumulative_logprob, logprobs=self.logprobs,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SeqState] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def add_prompt_logprobs(self, first: int, entries: list[dict[int, float]]) -> None:
        """Record entries for prompt tokens first, first+1, ...; recomputation repeats none."""
        assert self.prompt_logprobs is not None
        for offset, entry in enumerate(entries):
            if first + offset == len(self.prompt_logprobs):
                self.prompt_logprobs.append(entry)

    def output(self) -> RequestOutput:
        first = self.seqs[0].request
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion() for s in self.seqs], finished=self.finished,
            num_cached_tokens=first.num_cached_tokens, prompt_logprobs=self.prompt_logprobs,
            metrics=first.metrics, sample_metrics=[s.request.metrics for s in self.seqs])


def new_parent(request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
               children: list[Request], tokenizer: Tokenizer) -> ParentState:
    parent = ParentState(request_id, prompt, prompt_token_ids, params,
                         prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
    for i, child in enumerate(children):
        detok = IncrementalDetokenizer(tokenizer.hf, prompt_token_ids, params.skip_special_tokens)
        parent.seqs.append(SeqState(i, child, detok, logprobs=[] if params.logprobs is not None else None))
    return parent
