"""Sampler: turns one step's logits into one token per request, following vLLM's semantics.

Order of processing for each row (as vLLM does it):
  1. logit_bias is added;
  2. while fewer than min_tokens tokens have been generated, EOS ids and stop_token_ids get -inf
     (EOS is blocked whether or not ignore_eos is set; the caller passes the ids to block);
  3. repetition penalty (HF/vLLM style, over prompt + output tokens: positive logits are divided by
     it, negative ones multiplied), then frequency and presence penalties (OpenAI style, over output
     tokens only);
  4. greedy rows (temperature 0) take the argmax (ties: lowest id) and draw nothing from their
     generator; random rows are divided by their temperature, filtered by top-k, then top-p (on the
     renormalised top-k distribution), then min-p (vLLM v0's order; v1 applies min-p first), and
     sampled by inverse CDF with one uniform draw from the request's own generator, so that a seed
     gives the same tokens whatever else is in the batch.

Returned logprobs are those of the raw model distribution (log_softmax of the logits as given,
before bias, penalties and temperature), as vLLM reports them by default.

Float32 rows on the CPU can run in one C++ pass instead (`sampler.cpp`, once `Sampler.enable_fused` built it):
greedy, or random with a temperature and any of top-k, top-p and min-p; a row with a bias, penalties or a
min_tokens block is processed first, in place and put back after, in the same pass (pagoda_process_row, the torch
code's _process_rows in C++), its logprob taken from the logits as given. Same semantics, its own float32 rounding
(the source's header says what that changes). Which path a row takes depends on the row and the logits' dtype and
device alone, so a seed still gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pagoda.layers.cpp_build import load_library
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class UniformStream:
    """A request's uniform draws in [0, 1), float64: the values torch.rand gives one at a time from its generator,
    drawn BLOCK at a time. In a step's Python, after the forward has streamed the weights through the caches,
    each torch op costs ~100 us (one 0-d draw: 88 us a step in a one-stream engine, 8 us alone; BENCHMARKS.md,
    "The sampler's bookkeeping"): one op per BLOCK steps instead of one a step. Nothing else may draw from the
    generator, or the values would no longer follow each other."""

    BLOCK = 64

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator
        self._left: list[float] = []  # the block's values not taken yet, the next one last

    def next(self) -> float:
        if not self._left:
            block = torch.rand(self.BLOCK, dtype=torch.float64, generator=self.generator,
                               device=self.generator.device)
            self._left = block.tolist()[::-1]
        return self._left.pop()


@dataclass
class SamplingRow:
    """One request's row of logits this step."""

    params: SamplingParams
    uniforms: UniformStream  # owned by the request: its generator seeded from params.seed, or randomly
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far, before this step
    eos_token_ids: frozenset[int]
    # The request's token ids, prompt then outputs, as an int32 array kept across steps (Request.token_array), for
    # the C++ pass's penalties; output_token_ids begins with those outputs (it is them, or them and the tokens of a
    # call's earlier steps or of the drafts before a position). A function, not the array, so that rows without
    # penalties (most) never build one. None: the pass converts the lists, O(their length).
    token_array: Callable[[], array] | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # raw logprob of each chosen token
    # when params.logprobs is not None: the chosen token and the top-N raw logprobs; else None
    top_logprobs: list[dict[int, float] | None]

    def append(self, token_id: int, logprob: float, top: dict[int, float] | None = None) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.top_logprobs.append(top)


def _needs_logit_processing(p: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a row with these params and output tokens so far has any bias, min_tokens block or penalty to apply
    this step."""
    return bool(
        p.logit_bias
        or num_output_tokens < p.min_tokens
        or p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
    )


def _process_rows(x: torch.Tensor, rows: list[SamplingRow], which: Sequence[int]) -> None:
    """Applies bias, min_tokens and penalties to rows `which` of logits x (rows[j] the row of x[j]), in place: each
    kind as a few ops over the (row, token) pairs of all the rows at once, not per row (~130 us a row for a
    repetition penalty alone, BENCHMARKS.md). The torch path's; the C++ pass processes its rows itself
    (pagoda_process_row, from _Processing), the same arithmetic."""
    device, vocab = x.device, x.shape[1]

    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    def per_row(values: dict[int, float]) -> torch.Tensor:  # one value a row of x, 0 for the rows not given
        out = torch.zeros(x.shape[0], dtype=x.dtype, device=device)
        out[index(list(values))] = torch.tensor(list(values.values()), dtype=x.dtype, device=device)
        return out

    def unique_pairs(tokens: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The distinct (row, token) pairs of each row's tokens, and how often each occurs."""
        ids = index([t for ts in tokens.values() for t in ts])
        at = torch.repeat_interleave(index(list(tokens)), index([len(ts) for ts in tokens.values()]))
        keys, counts = torch.unique(at * vocab + ids, return_counts=True)
        return keys // vocab, keys % vocab, counts

    params = {j: rows[j].params for j in which}
    bias = [(j, t, b) for j, p in params.items() for t, b in (p.logit_bias or {}).items()]
    if bias:
        x.index_put_((index([j for j, _, _ in bias]), index([t for _, t, _ in bias])),
                     torch.tensor([b for _, _, b in bias], dtype=x.dtype, device=device), accumulate=True)
    blocked = [(j, t) for j, p in params.items() if len(rows[j].output_token_ids) < p.min_tokens
               for t in rows[j].eos_token_ids.union(p.stop_token_ids or []) if t < vocab]
    if blocked:
        x[index([j for j, _ in blocked]), index([t for _, t in blocked])] = float("-inf")
    seen = {j: [*rows[j].prompt_token_ids, *rows[j].output_token_ids] for j, p in params.items()
            if p.repetition_penalty != 1.0}
    seen = {j: ts for j, ts in seen.items() if ts}
    if seen:
        r, t, _ = unique_pairs(seen)
        penalty = per_row({j: params[j].repetition_penalty for j in seen})[r]
        vals = x[r, t]
        x[r, t] = torch.where(vals > 0, vals / penalty, vals * penalty)
    outputs = {j: list(rows[j].output_token_ids) for j, p in params.items()
               if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and rows[j].output_token_ids}
    if outputs:
        r, t, counts = unique_pairs(outputs)
        frequency = per_row({j: params[j].frequency_penalty for j in outputs})[r]
        presence = per_row({j: params[j].presence_penalty for j in outputs})[r]
        # logits -= frequency * count + presence * (count > 0)
        x[r, t] -= frequency * counts.to(x.dtype) + presence


def apply_logit_processing(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Bias, min_tokens and penalties for logits (num_rows, vocab), before temperature.

    Returns the input tensor itself when no row needs any of them, else a processed copy: the
    caller's tensor is never modified, and rows without bias or penalty cost nothing.
    """
    todo = [i for i, r in enumerate(rows) if _needs_logit_processing(r.params, len(r.output_token_ids))]
    if not todo:
        return logits
    processed = logits.clone()
    _process_rows(processed, rows, todo)
    return processed


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keeps the top_k (r,) best tokens of each row of logits (r, vocab), without a full sort.

    Ties at the k-th value go to the lowest ids (as a stable sort would), so top_k == 1 keeps
    exactly the token argmax picks.
    """
    kth = logits.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))  # (r, 1)
    above = logits > kth
    ties = logits == kth
    room = top_k.unsqueeze(1) - above.sum(dim=-1, keepdim=True)  # how many tied tokens still fit
    keep = above | (ties & (ties.cumsum(dim=-1) <= room))
    return logits.masked_fill(~keep, float("-inf"))


# Candidates the top-k / top-p filter takes from a partial top-k before it sorts a whole row (_apply_top_k_top_p):
# 64, then 1,024 for the rows whose nucleus is not certain among 64. A full sort of a 49,152-token row took 4.3 ms, a
# top-k of 1,024 0.17 ms; for 128 rows, top-k of 64 7.7 ms against 30 for 1,024 (Zen 4, BENCHMARKS.md); a nucleus of
# 0.9 over a trained model's logits is usually far smaller.
TOP_P_CANDIDATES = (64, 1024)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Filters rows of logits (r, vocab) to their top_k (r,) tokens, then to their nucleus top_p (r,)
    computed on the renormalised top-k distribution (as vLLM does). top_k >= vocab disables top-k; top_p == 1
    disables top-p.

    The nucleus is looked for among each row's best TOP_P_CANDIDATES[0] tokens, then, for the rows where it is not
    certain there, among their best TOP_P_CANDIDATES[1] (_from_candidates); the rows left take the full sort
    (_sorted_top_k_top_p). The two agree but for the last bits of the softmax's sum, which is taken in another order
    (tests/layers/test_sampler.py compares them)."""
    levels = [m for m in TOP_P_CANDIDATES if m < logits.shape[-1]]
    if not levels:
        return _sorted_top_k_top_p(logits, top_k, top_p)
    out, done = _from_candidates(logits, top_k, top_p, levels[0])
    rows = (~done).nonzero().squeeze(1)  # the rows not done yet
    for m in levels[1:]:
        if not rows.numel():
            return out
        got, done = _from_candidates(logits[rows], top_k[rows], top_p[rows], m)
        out[rows[done]] = got[done]
        rows = rows[~done]
    if rows.numel():
        out[rows] = _sorted_top_k_top_p(logits[rows], top_k[rows], top_p[rows])
    return out


def _from_candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """_apply_top_k_top_p's rows filtered from their m best tokens, in the order a stable descending sort gives them
    (tied logits by id), with the softmax's sum over all the tokens top-k keeps; and (r,) where that is certain:
    the row's top_k within the candidates, or the candidates' mass already top_p (every later token then has at
    least that much before it, so is dropped), and no tie at the candidates' last logit that the candidates cut
    (which tied ids topk took is not set). Rows whose top_k falls past the candidates but inside the vocabulary are
    not done either."""
    vocab = logits.shape[-1]
    vals, ids = logits.topk(m, dim=-1)  # best first; ties in no set order
    by_id = ids.argsort(dim=-1)
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    vals, order = vals.sort(dim=-1, descending=True, stable=True)  # ties by id, as the full stable sort
    ids = ids.gather(1, order)
    k = top_k.clamp(max=vocab).unsqueeze(1)  # (r, 1)
    ranks = torch.arange(m, device=logits.device)
    all_kept = k >= vocab  # (r, 1): top-k off, so the softmax's sum runs over the whole row
    top = vals[:, :1]
    weights = (vals - top).exp().masked_fill(ranks >= k, 0.0)
    total = torch.where(all_kept, (logits - top).exp().sum(dim=-1, keepdim=True), weights.sum(dim=-1, keepdim=True))
    probs = weights / total
    cdf = probs.cumsum(dim=-1)
    keep = (ranks < k) & (cdf - probs < top_p.unsqueeze(1))
    cut_tie = (logits >= vals[:, -1:]).sum(dim=-1, keepdim=True) > m  # tokens equal to the last candidate left out
    done = ((k <= m) | (all_kept & (cdf[:, -1:] >= top_p.unsqueeze(1)))) & ~cut_tie
    out = torch.full_like(logits, float("-inf")).scatter_(1, ids, vals.masked_fill(~keep, float("-inf")))
    return out, done.squeeze(1)


def _sorted_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """_apply_top_k_top_p by a full sort of each row: a stable descending sort puts tied logits in id order, like
    _apply_top_k."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)  # (r, vocab)
    ranks = torch.arange(logits.shape[-1], device=logits.device)  # (vocab,)
    sorted_logits.masked_fill_(ranks.unsqueeze(0) >= top_k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of all better-ranked tokens
    # The top token always has mass_before == 0 < top_p, so at least one token survives.
    sorted_logits.masked_fill_(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below min_p (r,) times the row's top probability."""
    probs = logits.softmax(dim=-1)  # (r, vocab)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """top-k, top-p then min-p on temperature-scaled logits (r, vocab), in place where it can.

    Only the rows that ask for a filter pay for it; top-p rows need a full sort, top-k-only rows
    do not.
    """
    device, dtype, vocab = logits.device, logits.dtype, logits.shape[-1]

    def index(ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=device)

    def k_of(row: SamplingRow) -> int:
        return row.params.top_k if 0 < row.params.top_k < vocab else vocab

    p_rows = [i for i, r in enumerate(rows) if r.params.top_p < 1.0]
    if p_rows:
        top_k = torch.tensor([k_of(rows[i]) for i in p_rows], device=device)
        top_p = torch.tensor([rows[i].params.top_p for i in p_rows], dtype=dtype, device=device)
        idx = index(p_rows)
        logits[idx] = _apply_top_k_top_p(logits[idx], top_k, top_p)
    k_rows = [i for i, r in enumerate(rows) if k_of(r) < vocab and r.params.top_p == 1.0]
    if k_rows:
        top_k = torch.tensor([k_of(rows[i]) for i in k_rows], device=device)
        idx = index(k_rows)
        logits[idx] = _apply_top_k(logits[idx], top_k)
    m_rows = [i for i, r in enumerate(rows) if r.params.min_p > 0.0]
    if m_rows:
        min_p = torch.tensor([rows[i].params.min_p for i in m_rows], dtype=dtype, device=device)
        idx = index(m_rows)
        logits[idx] = _apply_min_p(logits[idx], min_p)
    return logits


# Inverse-CDF sampling searches a two-level CDF: sums over chunks of this many vocab entries, then
# a cumulative sum within the one chunk each row's draw falls in. Searching one float64 cumsum over
# the whole vocabulary took 30-37 ms for 128 rows of 49,152 (7-9 ms with the engine's allocator
# setting, pagoda/worker/host_memory.py); the two-level search takes under 1 ms
# (`python -m pagoda.bench.sampler`).
_CDF_CHUNK = 256


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For non-negative weights (r, vocab), each row with a positive entry, and u (r,) in [0, 1):
    the first index whose cumulative weight exceeds u * total, per row; returns ids (r,).

    An entry of weight 0 is never chosen. When u * total rounds up to the total, the last entry of
    positive weight is taken.
    """
    r, vocab = weights.shape
    num_chunks = -(-vocab // _CDF_CHUNK)
    if num_chunks * _CDF_CHUNK != vocab:
        weights = torch.nn.functional.pad(weights, (0, num_chunks * _CDF_CHUNK - vocab))
    chunks = weights.view(r, num_chunks, _CDF_CHUNK)
    # Chunk sums in float32 (256 terms each), accumulated across chunks in float64.
    chunk_cdf = chunks.sum(dim=-1).double().cumsum(dim=-1)  # (r, num_chunks)
    total = chunk_cdf[:, -1:].contiguous()  # (r, 1)
    target = u.to(torch.float64).unsqueeze(1) * total  # (r, 1)

    def first_above(cdf: torch.Tensor, value: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        # first index with cdf > value; if none (rounding), the first index that reaches `last`,
        # which is the last step up of the cdf, so never an entry of weight 0
        return torch.minimum(torch.searchsorted(cdf, value, right=True), torch.searchsorted(cdf, last))

    chunk = first_above(chunk_cdf, target, total)  # (r, 1); that chunk has positive weight
    before = torch.where(chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp(min=0)), 0.0)  # (r, 1)
    local = chunks.gather(1, chunk.unsqueeze(-1).expand(r, 1, _CDF_CHUNK)).squeeze(1)  # (r, chunk)
    local_cdf = before + local.double().cumsum(dim=-1)  # (r, _CDF_CHUNK)
    within = first_above(local_cdf, target, local_cdf[:, -1:].contiguous())
    return (chunk * _CDF_CHUNK + within).squeeze(1)


def _weights(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The unnormalised probabilities (r, vocab) non-greedy rows of logits sample from: temperature, then the
    rows' filters (filtered-out tokens: 0)."""
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=logits.device)
    scaled = _filter(logits / temps.unsqueeze(1), rows)
    # Unnormalised: _inverse_cdf scales the draw by the row total instead.
    return (scaled - scaled.amax(dim=-1, keepdim=True)).exp_()


def _draws(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    """One uniform draw in [0, 1) per row from the row's own generator (r,), float64."""
    return torch.tensor([r.uniforms.next() for r in rows], dtype=torch.float64, device=device)


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Samples one token per row of logits (r, vocab) for non-greedy rows; returns ids (r,)."""
    # Inverse-CDF sampling with one uniform draw per row from the row's own generator, so the
    # tokens depend only on the request's seed and its own logits, not on the rest of the batch.
    # (One draw per row instead of one per vocab entry: far cheaper on CPU.)
    return _inverse_cdf(_weights(logits, rows), _draws(rows, logits.device))


def _logprob_dicts(
    logits: torch.Tensor, chosen_ids: torch.Tensor, nums: list[int]
) -> list[dict[int, float]]:
    """For rows of logits (r, vocab) and chosen ids (r,): {chosen: logprob, then the row's top nums[i]}.

    The chosen token comes first (as in vLLM); a top token equal to it is not repeated. Logprobs
    are logit - logsumexp, the same arithmetic as SamplerOutput.logprobs, so the values agree.
    """
    logprobs = logits - logits.logsumexp(dim=-1, keepdim=True)  # (r, vocab)
    chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
    max_n = min(max(nums, default=0), logprobs.shape[-1])
    top_vals, top_ids = logprobs.topk(max_n, dim=-1)  # (r, max_n), best first
    out: list[dict[int, float]] = []
    rows = zip(chosen_ids.tolist(), chosen, top_ids.tolist(), top_vals.tolist(), nums, strict=True)
    for token, lp, ids, vals, n in rows:
        entry = {token: lp}
        entry.update((t, v) for t, v in zip(ids[:n], vals[:n], strict=True) if t not in entry)
        out.append(entry)
    return out


def _top_logprobs(
    logits: torch.Tensor, token_ids: list[int], rows: list[SamplingRow]
) -> list[dict[int, float] | None]:
    """The chosen token and the top-N raw logprobs, for the rows that ask for logprobs (only
    those rows pay for a full log_softmax)."""
    out: list[dict[int, float] | None] = [None] * len(rows)
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if asked:
        idx = torch.tensor(asked, dtype=torch.long, device=logits.device)
        chosen = torch.tensor([token_ids[i] for i in asked], dtype=torch.long, device=logits.device)
        nums = [rows[i].params.logprobs or 0 for i in asked]
        entries = _logprob_dicts(logits[idx], chosen, nums)
        for i, entry in zip(asked, entries, strict=True):
            out[i] = entry
    return out


def _row_index(rows: list[int], num_rows: int, device: torch.device) -> torch.Tensor | slice:
    """An index for the given rows: a plain slice (a view, no copy) when it is all of them."""
    if len(rows) == num_rows:
        return slice(None)
    return torch.tensor(rows, dtype=torch.long, device=device)


_SOURCE = Path(__file__).with_name("sampler.cpp")


@functools.cache
def _library(extra_flags: tuple[str, ...] = ()) -> Any:
    """sampler.cpp built for this CPU (extra_flags: the tests' narrower vector widths)."""
    lib = load_library(_SOURCE, {"CHUNK": _CDF_CHUNK}, extra_flags)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pagoda_sample.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr]
    lib.pagoda_sample.restype = None
    f32 = ctypes.c_float
    lib.pagoda_check_draft.argtypes = [ptr, i64, f32, i64, f32, f32, i64, ctypes.c_double, ptr, ptr]
    lib.pagoda_check_draft.restype = i64
    lib.pagoda_process_row.argtypes = [ptr, i64, ptr]
    lib.pagoda_process_row.restype = i64
    return lib


class _Processing(ctypes.Structure):
    """A row's bias, min_tokens block and penalties as sampler.cpp's Processing takes them (pagoda_process_row): the
    arrays' addresses and lengths, and room for the values its changes replace (put back after the pass)."""

    _fields_ = [("bias_ids", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n_bias", ctypes.c_int64),
                ("blocked", ctypes.c_void_p), ("n_blocked", ctypes.c_int64), ("ids", ctypes.c_void_p),
                ("n_prompt", ctypes.c_int64), ("n_outputs", ctypes.c_int64), ("repetition", ctypes.c_float),
                ("frequency", ctypes.c_float), ("presence", ctypes.c_float), ("saved_ids", ctypes.c_void_p),
                ("saved", ctypes.c_void_p)]

    def __init__(self, row: SamplingRow, vocab: int) -> None:
        p, outputs = row.params, row.output_token_ids
        bias = p.logit_bias or {}
        bias_ids, bias_values = array("q", bias), array("f", bias.values())
        blocked = array("q", [t for t in row.eos_token_ids.union(p.stop_token_ids or []) if t < vocab]
                        if len(outputs) < p.min_tokens else [])
        repetition, counted = p.repetition_penalty != 1.0, p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        ids = _token_ids(row) if repetition or counted else array("i")
        n_prompt = len(row.prompt_token_ids) if ids else 0
        n_outputs = len(ids) - n_prompt  # what the array holds past the prompt: the C++ reads no further
        room = len(bias_ids) + len(blocked) + (n_prompt + n_outputs) * repetition + n_outputs * counted
        saved_ids, saved = array("q", bytes(8 * room)), array("f", bytes(4 * room))
        super().__init__(_address(bias_ids), _address(bias_values), len(bias_ids), _address(blocked), len(blocked),
                         _address(ids), n_prompt, n_outputs, p.repetition_penalty, p.frequency_penalty,
                         p.presence_penalty, _address(saved_ids), _address(saved))
        self.arrays = (bias_ids, bias_values, blocked, ids, saved_ids, saved)  # alive while self is

    @classmethod
    def of(cls, row: SamplingRow, vocab: int) -> _Processing | None:
        """The row's processing this step, or None where it has none."""
        return cls(row, vocab) if _needs_logit_processing(row.params, len(row.output_token_ids)) else None


def _token_ids(row: SamplingRow) -> array:
    """The row's prompt and output token ids, one int32 array: its request's kept one (SamplingRow.token_array),
    followed by the row's tokens past it (a call's earlier steps, drafts before a position), else converted from the
    row's lists."""
    if row.token_array is not None:
        tokens = row.token_array()
        past = len(tokens) - len(row.prompt_token_ids)  # the request's outputs
        if 0 <= past <= len(row.output_token_ids):
            extra = row.output_token_ids[past:]
            return tokens + array("i", extra) if extra else tokens
    return array("i", row.prompt_token_ids) + array("i", row.output_token_ids)


def _filtered(p: SamplingParams, vocab: int) -> bool:
    """A random row with top-k, top-p or min-p."""
    return not p.greedy and (p.top_p < 1.0 or 0 < p.top_k < vocab or p.min_p > 0.0)


def _plain(params: SamplingParams, num_output_tokens: int) -> bool:
    """A row the C++ pass samples with nothing else to do: no bias, penalty or min_tokens block now, so in every later
    step too (a min_tokens block only ends as tokens are added), and no logprobs."""
    return params.logprobs is None and not _needs_logit_processing(params, num_output_tokens)


class Sampler:
    """Stateless: everything a row needs (params, uniform draws, history) comes in its SamplingRow."""

    def __init__(self) -> None:
        self.lib: Any = None  # sampler.cpp, once enable_fused built it

    def enable_fused(self) -> float:
        """Build (or load from the cache) the C++ pass; its seconds. If building fails (logged), every row keeps the
        torch path."""
        start = time.perf_counter()
        try:
            self.lib = _library()
        except Exception as e:  # no C++ compiler, ...
            logger.warning("could not compile the sampler's fused pass (%s); sampling runs as torch ops", e)
            return time.perf_counter() - start
        seconds = time.perf_counter() - start
        logger.info("sampler's fused pass ready in %.1f s", seconds)
        return seconds

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits (num_rows, vocab), float32 or float64 (other dtypes are upcast to float32)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"expected logits of shape ({len(rows)}, vocab), got {tuple(logits.shape)}")
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        n, vocab = logits.shape
        # Python lists, not tensors: the caller wants lists, and with one or a few rows a step the ops that
        # build, scatter and convert small tensors cost more than the sampling itself (BENCHMARKS.md, "The
        # sampler's bookkeeping").
        token_ids, logprobs = [0] * n, [0.0] * n
        if self.lib is not None and logits.dtype == torch.float32 and logits.device.type == "cpu":
            if logits.stride(1) != 1 or logits.stride(0) < vocab:  # rows of their own: processing changes them
                logits = logits.contiguous()
            token_ids, logprobs = self._sample_fused(logits, rows, range(n))
        else:
            ids_t, lps_t = _sample_torch(logits, rows)
            token_ids, logprobs = ids_t.tolist(), lps_t.tolist()
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs,
                             top_logprobs=_top_logprobs(logits, token_ids, rows))

    def fused_steps(self, rows: list[SamplingRow], vocab: int, steps: int) -> tuple[
            Callable[[int, torch.Tensor, int], None], array, list[list[dict[int, float] | None]]] | None:
        """For several decode steps in one call (OneStreamForward.decode_steps): a function that samples step s's
        logits (len(rows), vocab; float32) into token ids (int64) at an address, as __call__ samples these rows in
        a step of their own, each random row's draw taken from its stream at each step; the array it writes their
        raw logprobs to (steps x rows, float64); and the list it appends each step's top logprobs to (None for a
        row without logprobs; nothing where no row asks for them). Rows with nothing but the pass to do (_plain)
        take the pass directly, its arguments built once; others go through __call__ with the tokens of the call's
        earlier steps among their outputs (penalties, min_tokens). None where the pass is not built."""
        if self.lib is None:
            return None
        n = len(rows)
        logprobs = array("d", bytes(8 * n * steps))
        tops: list[list[dict[int, float] | None]] = []
        if all(_plain(r.params, len(r.output_token_ids)) for r in rows):
            args = _PassArrays(rows, range(n), vocab, [None] * n)
            draws = [(i, r.uniforms) for i, r in enumerate(rows) if not r.params.greedy]
            lib = self.lib

            def sample(step: int, logits: torch.Tensor, ids: int) -> None:
                for i, stream in draws:
                    args.u[i] = stream.next()
                lib.pagoda_sample(logits.data_ptr(), *args.ahead(logits), ids, _address(logprobs) + 8 * n * step,
                                  args.work_address, None)

            return sample, logprobs, tops
        outputs = [list(r.output_token_ids) for r in rows]  # each row's, with the call's tokens so far

        def sample_rows(step: int, logits: torch.Tensor, ids: int) -> None:
            out = self(logits, [replace(r, output_token_ids=o) for r, o in zip(rows, outputs, strict=True)])
            got = (ctypes.c_int64 * n).from_address(ids)
            for i, t in enumerate(out.token_ids):
                got[i] = t
                outputs[i].append(t)
                logprobs[step * n + i] = out.logprobs[i]
            tops.append(out.top_logprobs)

        return sample_rows, logprobs, tops

    def verify(self, logits: torch.Tensor, drafts: list[int], row: SamplingRow) -> SamplerOutput:
        """Speculative decoding's check of one sequence's draft tokens: logits (len(drafts) + 1, vocab) float32, row
        j the logits after the sequence's j-th input (its last token, then the drafts). Returns the drafts accepted
        and one token more (ids, raw logprobs and, where the row asks, top logprobs), so that the tokens follow the
        distribution the row's own sampling gives, exactly:
        - greedy: draft j is accepted where it is the step's argmax (as a step of its own would choose it), and the
          first that is not gives way to that argmax: the tokens and logprobs of steps taken one by one;
        - random: draft d is accepted with probability p(d), p the step's distribution (temperature and filters),
          against a draw from the row's stream; where it is not, the token is drawn from p without d
          (renormalized). A token is then d with probability p(d), and t != d with (1 - p(d)) p(t) / (1 - p(d)) =
          p(t): the distribution of a step of its own (the draws differ, so the tokens of a seeded request do too).
        Where every draft is accepted, the last row gives one more token as a step would. Each position sees the
        drafts before it among the row's outputs (penalties, min_tokens). Rows with nothing but the pass to do
        (_plain: no logprobs, nothing to process) go through the C++ pass (a random row's check:
        pagoda_check_draft, one draw a position); the others position by position (_verify_processed)."""
        n = len(drafts)
        if self.lib is None or not _plain(row.params, len(row.output_token_ids)):
            return self._verify_processed(logits, drafts, row)
        if row.params.greedy:
            ids, lps = self._sample_fused(logits, [row] * (n + 1), list(range(n + 1)))
            got = 1 + next((j for j in range(n) if ids[j] != drafts[j]), n)
            return SamplerOutput(ids[:got], lps[:got], [None] * got)
        out = SamplerOutput([], [], [])
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        for j, d in enumerate(drafts):  # one row at a time: most checks end at the first draft
            t, logprob = self._check_draft(logits[j], d, row)
            out.append(t, logprob)
            if t != d:
                return out
        ids, lps = self._sample_fused(logits[n: n + 1], [row], [0])
        out.append(ids[0], lps[0])
        return out

    def _check_draft(self, x: torch.Tensor, d: int, row: SamplingRow,
                     processing: _Processing | None = None) -> tuple[int, float]:
        """pagoda_check_draft on a random row's logits x (vocab,), contiguous float32 (processing: the row's, which
        the call applies in place and puts back): the token and its raw logprob, one draw from the row's stream."""
        p, vocab = row.params, x.shape[0]
        logprob = array("d", [0.0])
        t = self.lib.pagoda_check_draft(x.data_ptr(), vocab, p.temperature, p.top_k if 0 < p.top_k < vocab else vocab,
                                        p.top_p, p.min_p, d, row.uniforms.next(), _address(logprob),
                                        None if processing is None else ctypes.addressof(processing))
        return t, logprob[0]

    def _verify_processed(self, logits: torch.Tensor, drafts: list[int], row: SamplingRow) -> SamplerOutput:
        """verify for a row with logprobs, bias, penalties, a min_tokens block or filters, position by position,
        each seeing the drafts before it among the row's outputs. A greedy row's positions, and the last one of a
        random row's, are sampled by the sampler itself (__call__ on that one row): the tokens, logprobs and top
        logprobs of steps one by one. A random row's draft d is kept against the step's distribution after its
        processing, temperature and filters, else the token is drawn from it without d: by the C++ check on the
        processed row where the pass is built and the logits are float32 on the CPU, else as __call__'s torch path
        computes that distribution."""
        out = SamplerOutput([], [], [])
        for j in range(len(drafts) + 1):
            at = replace(row, output_token_ids=[*row.output_token_ids, *drafts[:j]])  # the row at position j
            x = logits[j: j + 1]
            d = drafts[j] if j < len(drafts) else -1
            if row.params.greedy or d < 0:
                step = self(x, [at])
                t, logprob, top = step.token_ids[0], step.logprobs[0], step.top_logprobs[0]
            elif self.lib is not None and x.dtype == torch.float32 and x.device.type == "cpu":
                x = x.contiguous()  # its own copy where the row is strided: the check processes it in place
                t, logprob = self._check_draft(x[0], d, at, _Processing.of(at, x.shape[1]))
                top = _top_logprobs(x, [t], [at])[0]
            else:
                w = _weights(apply_logit_processing(x, [at]), [at])
                if row.uniforms.next() * float(w.sum(dtype=torch.float64)) < float(w[0, d]):
                    t = d
                else:
                    w[0, d] = 0.0  # p without d
                    t = int(_inverse_cdf(w, _draws([at], x.device)))
                ids = torch.tensor([t], dtype=torch.long, device=x.device)
                logprob = float(x.gather(1, ids.unsqueeze(1)).squeeze(1) - x.logsumexp(dim=-1))
                top = _top_logprobs(x, [t], [at])[0]
            out.append(t, logprob, top)
            if t != d:
                break
        return out

    def _sample_fused(self, logits: torch.Tensor, rows: list[SamplingRow],
                      which: Sequence[int]) -> tuple[list[int], list[float]]:
        """The C++ pass over rows `which` of logits (float32, on the CPU; rows of their own with unit stride),
        rows[j] the row of logits[which[j]]: their token ids and raw logprobs. A row with a bias, penalties or a
        min_tokens block is processed by the pass, in place, and put back."""
        vocab = logits.shape[1]
        args = _PassArrays(rows, which, vocab, [_Processing.of(r, vocab) for r in rows])
        # one draw per random row from its own generator, as the torch path draws it (greedy rows draw none)
        for j, row in enumerate(rows):
            if not row.params.greedy:
                args.u[j] = row.uniforms.next()
        n = len(rows)
        ids, lps = array("q", bytes(8 * n)), array("d", bytes(8 * n))
        self.lib.pagoda_sample(logits.data_ptr(), *args.ahead(logits), _address(ids), _address(lps),
                               args.work_address, args.processing)
        return ids.tolist(), lps.tolist()


class _PassArrays:
    """The C++ pass's arguments for rows (rows[j] at logits row which[j]) other than the logits and the outputs:
    which rows, temperatures, filters (top_k, top_p, min_p: the vocabulary, 1 and 0 where a row has none; null
    pointers where no row has any), each random row's draw (u, set by the caller), the work space and each row's
    processing (processing[j], None for none; a null pointer where no row has any)."""

    def __init__(self, rows: Sequence[SamplingRow], which: Sequence[int], vocab: int,
                 processing: list[_Processing | None]) -> None:
        n = len(rows)
        self.vocab = vocab
        self.picks, self.temps = array("q", which), array("f", [r.params.temperature for r in rows])
        self.filters: tuple[array, array, array] | None = None
        if any(_filtered(r.params, vocab) for r in rows):
            self.filters = (array("q", [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]),
                            array("f", [r.params.top_p for r in rows]), array("f", [r.params.min_p for r in rows]))
        self.u = array("d", bytes(8 * n))
        self.work = array("d", bytes(8 * n * -(-vocab // _CDF_CHUNK)))
        self.work_address = _address(self.work)
        self.processing: int | None = None
        if any(x is not None for x in processing):
            self.kept = processing  # alive while the pointers to them are
            self.pointers = (ctypes.c_void_p * n)(*[None if x is None else ctypes.addressof(x) for x in processing])
            self.processing = ctypes.addressof(self.pointers)

    def ahead(self, logits: torch.Tensor) -> tuple[int | None, ...]:
        """pagoda_sample's arguments between the logits and the outputs."""
        filters = [_address(a) for a in self.filters] if self.filters else [None, None, None]
        return (_address(self.picks), len(self.picks), self.vocab, logits.stride(0), _address(self.temps), *filters,
                _address(self.u))


def _address(values: array) -> int:
    """Where an array's items start (the array must outlive the call that reads them)."""
    return values.buffer_info()[0]


def _sample_torch(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path for rows of logits (r, vocab): token ids (r,) and their raw logprobs (r,)."""
    processed = apply_logit_processing(logits, rows)
    token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        idx = _row_index(greedy, len(rows), logits.device)
        token_ids[idx] = processed[idx].argmax(dim=-1)  # ties: lowest id
    rand = [i for i, r in enumerate(rows) if not r.params.greedy]
    if rand:
        idx = _row_index(rand, len(rows), logits.device)
        token_ids[idx] = _sample_random(processed[idx], [rows[i] for i in rand])
    # Raw logprob of the chosen tokens: logit - logsumexp, without a (num_rows, vocab) result.
    chosen = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1) - logits.logsumexp(dim=-1)
    return token_ids, chosen


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, num_top: int
) -> list[dict[int, float]]:
    """For each of n prompt positions: the raw logprob of the actual next prompt token (first),
    then the top num_top logprobs. logits (n, vocab), next_token_ids (n,)."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    next_ids = next_token_ids.to(device=logits.device, dtype=torch.long)
    return _logprob_dicts(logits, next_ids, [num_top] * logits.shape[0])
