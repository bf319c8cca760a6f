"""Sampler: greedy / random sampling, filters, penalties, logprobs and per-request seeding."""

from __future__ import annotations

import ctypes
import math
from array import array
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch

from pagoda.layers.sampler import (
    TOP_P_CANDIDATES,
    Sampler,
    SamplingRow,
    UniformStream,
    _apply_top_k,
    _apply_top_k_top_p,
    _inverse_cdf,
    _Processing,
    _sorted_top_k_top_p,
    apply_logit_processing,
    prompt_logprobs,
)
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

VOCAB = 50


@pytest.fixture(params=["torch", "fused"], autouse=True)
def sampler_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs twice: with the torch code only, and with the C++ pass taking the rows without bias,
    penalty or min_tokens block (greedy, or random with or without filters) of every Sampler() it makes."""
    if request.param == "fused":
        init = Sampler.__init__

        def fused_init(self: Sampler) -> None:
            init(self)
            self.enable_fused()
            assert self.lib is not None

        monkeypatch.setattr(Sampler, "__init__", fused_init)
    return str(request.param)


def _row(
    output: Sequence[int] = (),
    prompt: Sequence[int] = (1, 2, 3),
    eos: frozenset[int] = frozenset({0}),
    uniforms: UniformStream | None = None,
    **params: Any,
) -> SamplingRow:
    p = SamplingParams(**params)
    draws = uniforms if uniforms is not None else _stream(p.seed or 0)
    return SamplingRow(params=p, uniforms=draws, prompt_token_ids=list(prompt), output_token_ids=list(output),
                       eos_token_ids=eos)


def _stream(seed: int) -> UniformStream:
    return UniformStream(torch.Generator().manual_seed(seed))


def _logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_ties_go_to_lowest_id() -> None:
    logits = _logits(8)
    logits[3, 7] = logits[3, 11] = logits[3].max() + 1.0  # a tie
    out = Sampler()(logits, [_row(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[3] == 7


def test_greedy_rows_do_not_touch_generator_or_input() -> None:
    logits = _logits(2)
    before = logits.clone()
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    Sampler()(logits, [_row(temperature=0.0, uniforms=UniformStream(gen), repetition_penalty=1.5, logit_bias={3: 5.0}),
                       _row(temperature=0.7, seed=1, presence_penalty=1.0, output=[4, 4])])
    assert torch.equal(gen.get_state(), state)
    assert torch.equal(logits, before)  # the caller's logits are never modified


def _run_steps(seed_row_index: int, others: list[dict[str, Any]], steps: int = 20) -> list[int]:
    """Samples `steps` tokens for a seeded row placed at seed_row_index among other rows."""
    target: dict[str, Any] = dict(temperature=0.8, top_p=0.9, top_k=20, seed=1234)
    gens = [_stream(p.get("seed", 99 + i)) for i, p in enumerate(others)]
    target_gen = _stream(1234)
    outputs: list[list[int]] = [[] for _ in others]
    tokens: list[int] = []
    sampler = Sampler()
    for step in range(steps):
        rows = [_row(output=outputs[i], uniforms=gens[i], **p) for i, p in enumerate(others)]
        rows.insert(seed_row_index, _row(output=tokens, uniforms=target_gen, **target))
        step_logits = _logits(len(rows), seed=1000 + step)
        # The seeded row sees the same logits whatever its position in the batch.
        step_logits[seed_row_index] = _logits(1, seed=step)[0]
        out = sampler(step_logits, rows)
        tokens.append(out.token_ids[seed_row_index])
        others_out = out.token_ids[:seed_row_index] + out.token_ids[seed_row_index + 1:]
        for i, t in enumerate(others_out):
            outputs[i].append(t)
    return tokens


def test_seed_gives_same_tokens_whatever_the_batch() -> None:
    alone = _run_steps(0, [])
    others: list[dict[str, Any]] = [
        dict(temperature=0.0),
        dict(temperature=1.3, seed=7),
        dict(temperature=0.5, top_k=3, repetition_penalty=1.3),
        dict(temperature=1.0, min_p=0.2, frequency_penalty=0.5, presence_penalty=0.3),
        dict(temperature=0.0, logit_bias={4: 10.0}, logprobs=2),
    ]
    assert _run_steps(3, others) == alone
    assert _run_steps(5, others) == alone
    assert len(set(alone)) > 3  # it really sampled


def test_top_k_1_is_greedy() -> None:
    logits = _logits(6, seed=3)
    logits[2, 4] = logits[2, 9] = logits[2].max() + 1.0  # a tie: the stable sort keeps the lowest id
    rows = [_row(temperature=1.5, top_k=1, seed=s) for s in range(6)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_threshold_matches_stable_sort_with_ties() -> None:
    """The sort-free top-k (top-k-only rows) keeps the same set as the sorted path, ties included."""
    logits = torch.randint(0, 4, (6, 30), generator=torch.Generator().manual_seed(0)).float()
    top_k = torch.tensor([1, 2, 5, 7, 30, 13])
    fast = _apply_top_k(logits, top_k)
    sorted_path = _apply_top_k_top_p(logits, top_k, torch.ones(6))
    assert torch.equal(fast, sorted_path)
    assert (fast.isfinite().sum(dim=-1) == top_k).all()


@pytest.mark.parametrize("vocab", [50, 1500, 49152])
def test_top_p_from_candidates_keeps_what_the_full_sort_keeps(vocab: int) -> None:
    """The nucleus taken from each row's best TOP_P_CANDIDATES tokens (or, where that is not certain, from the full
    sort) keeps the tokens the full sort keeps, with their logits: peaked rows, rows whose nucleus is past the first
    candidates or past all of them, ties everywhere, -inf entries, top-k inside, past and off the candidates. Only a
    token whose mass before it is within float32's rounding of top_p may go either way (the softmax's sum runs in
    another order)."""
    g = torch.Generator().manual_seed(vocab)
    top_k = torch.tensor([vocab, 5, 2000, vocab, TOP_P_CANDIDATES[-1], TOP_P_CANDIDATES[0] + 1])
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.999, 0.8, 0.3])
    for scale in (8.0, 3.0, 0.3, 0.0):
        logits = torch.randn(6, vocab, generator=g) * scale
        if scale == 0.0:  # ties everywhere
            logits = torch.randint(0, 5, (6, vocab), generator=g).float()
        logits[1, ::3] = float("-inf")
        fast, full = _apply_top_k_top_p(logits, top_k, top_p), _sorted_top_k_top_p(logits, top_k, top_p)
        assert torch.equal(fast[fast.isfinite()], logits[fast.isfinite()])
        for i in range(6):
            differ = (fast[i].isfinite() != full[i].isfinite()).nonzero().squeeze(1)
            if differ.numel():
                x, ids = logits[i].double().sort(descending=True, stable=True)
                x[int(top_k[i]):] = float("-inf")
                probs = x.softmax(0)
                before = dict(zip(ids.tolist(), (probs.cumsum(0) - probs).tolist(), strict=True))
                assert all(abs(before[t] - float(top_p[i])) < 1e-5 for t in differ.tolist()), (scale, i)


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = _logits(6, seed=4)
    rows = [_row(temperature=1.0, top_p=1e-6, seed=s) for s in range(6)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_min_p_drops_tokens_below_threshold() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(400, 4).contiguous()
    gen = _stream(0)
    # min_p 0.4: threshold 0.2 = 0.4 * 0.5, so only tokens 0 and 1 survive.
    out = Sampler()(logits, [_row(temperature=1.0, min_p=0.4, uniforms=gen) for _ in range(400)])
    assert set(out.token_ids) == {0, 1}


def test_logit_bias_forces_a_token() -> None:
    logits = _logits(2, seed=5)
    low = int(logits[0].argmin())
    rows = [_row(temperature=0.0, logit_bias={low: 100.0}), _row(temperature=1.0, logit_bias={low: 100.0})]
    lo = logits.clone()
    lo[1] = logits[0]
    assert Sampler()(lo, rows).token_ids == [low, low]


def test_min_tokens_blocks_eos_and_stop_token_ids() -> None:
    logits = torch.zeros(1, 6)
    logits[0, 3], logits[0, 2], logits[0, 5] = 10.0, 9.0, 8.0  # 3 = eos, 2 = stop token id
    params: dict[str, Any] = dict(temperature=0.0, min_tokens=2, stop_token_ids=[2], max_tokens=10)
    sampler = Sampler()
    blocked = sampler(logits, [_row(output=[1], eos=frozenset({3}), **params)])
    assert blocked.token_ids == [5]
    # The reported logprob stays that of the raw distribution, blocked tokens included.
    assert blocked.logprobs[0] == pytest.approx(float(logits[0].log_softmax(-1)[5]), abs=1e-5)
    free = sampler(logits, [_row(output=[1, 1], eos=frozenset({3}), **params)])
    assert free.token_ids == [3]


def test_penalties_change_logits_exactly() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    row = _row(prompt=[0, 1], output=[2, 2, 4], repetition_penalty=2.0, frequency_penalty=0.5,
               presence_penalty=0.25)
    out = apply_logit_processing(logits, [row])
    # repetition over prompt + output {0, 1, 2, 4}: positive / 2, negative * 2; token 3, 5 unseen.
    # then token 2 (twice in output): 0.25 - 0.5 * 2 - 0.25; token 4 (once): -4 - 0.5 - 0.25.
    expected = torch.tensor([[1.0, -2.0, -1.0, 3.0, -4.75, 1.0]])
    torch.testing.assert_close(out, expected)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]))  # input untouched


def test_each_penalty_alone() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    cases: list[tuple[dict[str, Any], list[float]]] = [
        (dict(repetition_penalty=0.5), [4.0, -0.5, 1.0, 3.0]),  # prompt [0], output [1, 2, 2]
        (dict(frequency_penalty=-1.0), [2.0, 0.0, 2.5, 3.0]),  # output only: prompt token 0 untouched
        (dict(presence_penalty=2.0), [2.0, -3.0, -1.5, 3.0]),
        (dict(logit_bias={3: -5.0, 0: 1.5}), [3.5, -1.0, 0.5, -2.0]),
    ]
    for params, want in cases:
        out = apply_logit_processing(logits, [_row(prompt=[0], output=[1, 2, 2], **params)])
        torch.testing.assert_close(out, torch.tensor([want]), msg=str(params))


def test_processing_rows_together_equals_each_alone() -> None:
    """The bias, min_tokens and penalties of many rows applied at once (pairs of row and token for all of them) give
    each row what it gets alone, bit for bit: no row's tokens or values reach another's."""
    logits = _logits(9, seed=9)
    rows = _processing_rows()
    together = apply_logit_processing(logits, rows)
    for i, row in enumerate(rows):
        assert torch.equal(together[i], apply_logit_processing(logits[i: i + 1], [row])[0]), row.params
    assert not torch.equal(together, logits)


def _processing_rows() -> list[SamplingRow]:
    """Nine rows with biases, min_tokens blocks and penalties, alone and together (one with none), and prompts and
    outputs whose ids repeat."""
    params: list[dict[str, Any]] = [
        dict(repetition_penalty=1.5), dict(), dict(frequency_penalty=0.7, presence_penalty=-0.3),
        dict(logit_bias={1: 3.0, 49: -2.0}, repetition_penalty=0.8), dict(min_tokens=5, stop_token_ids=[7]),
        dict(presence_penalty=1.0, min_tokens=1), dict(repetition_penalty=1.2, frequency_penalty=0.2),
        dict(logit_bias={0: 1.0}), dict(repetition_penalty=2.0, presence_penalty=0.5, logit_bias={5: -1.0})]
    rng = torch.Generator().manual_seed(2)
    return [_row(prompt=torch.randint(VOCAB, (5 + i,), generator=rng).tolist(),
                 output=torch.randint(8, (i,), generator=rng).tolist(), eos=frozenset({i}), **p)
            for i, p in enumerate(params)]


def test_fused_processing_equals_the_torch_ops() -> None:
    """pagoda_process_row (bias, min_tokens block, repetition over distinct ids, frequency and presence by count) on
    each row gives the torch ops' processed logits bit for bit, ids repeated in prompt and outputs included; its
    scratch is left clear (a second call gives the same)."""
    logits = _logits(9, seed=9)
    rows = _processing_rows()
    want = apply_logit_processing(logits, rows)
    sampler = _fused_sampler()
    for _ in range(2):
        x = logits.clone()
        for i, row in enumerate(rows):
            processing = _Processing(row, VOCAB)
            sampler.lib.pagoda_process_row(x[i].data_ptr(), VOCAB, ctypes.addressof(processing))
        assert torch.equal(x, want)


def test_request_token_array_is_kept_and_extended() -> None:
    """Request.token_array: the prompt's ids then the outputs', int32, converted on first use and then extended in
    place by the tokens added since the last call (the same array while they grow), equal to the lists each time; a
    shorter list (the tokens past a stop dropped) converted anew."""
    req = Request(request_id="r", prompt_token_ids=[5, 6, 7], params=SamplingParams(), eos_token_ids=frozenset(),
                  max_total_tokens=100)
    tokens = req.token_array()
    assert list(tokens) == [5, 6, 7] and tokens.typecode == "i"
    for more in ([1], [2, 3], [], [4]):
        req.output_token_ids += more
        assert req.token_array() is tokens
        assert list(tokens) == req.prompt_token_ids + req.output_token_ids
    del req.output_token_ids[2:]
    assert list(req.token_array()) == [5, 6, 7, 1, 2]


def test_kept_token_array_gives_the_converted_lists_processing() -> None:
    """Rows that take their request's kept token array (SamplingRow.token_array) are processed as rows whose lists are
    converted, bit for bit: rows of their request's outputs, and rows whose outputs go past them (a call's earlier
    steps, drafts before a position), over several steps of a growing request."""
    rows = _processing_rows()
    sampler = _fused_sampler()
    for step in range(3):
        reqs = []
        for i, row in enumerate(rows):
            req = Request(request_id=str(i), prompt_token_ids=list(row.prompt_token_ids), params=row.params,
                          eos_token_ids=row.eos_token_ids, max_total_tokens=100)
            req.output_token_ids = list(row.output_token_ids)
            req.token_array()  # kept from an earlier step
            req.output_token_ids += [step, 2 * step + 1]  # this step's tokens
            reqs.append(req)
        for extra in ([], [4], [4, 1, 4]):
            plain = [SamplingRow(r.params, _stream(0), r.prompt_token_ids, [*r.output_token_ids, *extra],
                                 r.eos_token_ids) for r in reqs]
            kept = [replace(row, token_array=req.token_array) for row, req in zip(plain, reqs, strict=True)]
            logits = _logits(len(rows), seed=step)
            want, got = logits.clone(), logits.clone()
            for i in range(len(rows)):
                for x, row in ((want, plain[i]), (got, kept[i])):
                    processing = _Processing(row, VOCAB)
                    sampler.lib.pagoda_process_row(x[i].data_ptr(), VOCAB, ctypes.addressof(processing))
            assert not torch.equal(want, logits)
            assert torch.equal(got, want), (step, extra)


def test_rows_without_penalties_cost_nothing() -> None:
    logits = _logits(3)
    rows = [_row(temperature=0.7, top_k=5, min_p=0.1, min_tokens=1, output=[1]), _row(),
            _row(temperature=0.0)]
    assert apply_logit_processing(logits, rows) is logits  # no copy at all


def test_logprobs_are_raw_log_softmax() -> None:
    logits = _logits(3, seed=6).double()
    rows = [
        _row(temperature=0.0, repetition_penalty=1.7, logprobs=3),
        _row(temperature=0.6, seed=3, logit_bias={7: 20.0}, logprobs=0),
        _row(temperature=1.2, seed=4, top_k=4),
    ]
    out = Sampler()(logits, rows)
    raw = logits.log_softmax(dim=-1)
    for i, t in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(float(raw[i, t]))
    assert out.token_ids[1] == 7
    top0 = out.top_logprobs[0]
    assert top0 is not None
    vals, ids = raw[0].topk(3)
    assert list(top0)[0] == out.token_ids[0]  # the chosen token first
    for v, t in zip(vals.tolist(), ids.tolist(), strict=True):
        assert top0[t] == pytest.approx(v)
    assert len(top0) in (3, 4)
    assert top0[out.token_ids[0]] == out.logprobs[0]  # same value in both places
    assert out.top_logprobs[1] == {7: pytest.approx(float(raw[1, 7]))}  # logprobs=0: the chosen only
    assert out.top_logprobs[2] is None


def test_prompt_logprobs() -> None:
    logits = _logits(4, seed=8)
    nxt = torch.tensor([5, 6, 7, 8])
    out = prompt_logprobs(logits, nxt, num_top=2)
    raw = logits.log_softmax(dim=-1)
    assert len(out) == 4
    for i, entry in enumerate(out):
        assert list(entry)[0] == int(nxt[i])
        assert entry[int(nxt[i])] == pytest.approx(float(raw[i, nxt[i]]), abs=1e-5)
        vals, ids = raw[i].topk(2)
        for v, t in zip(vals.tolist(), ids.tolist(), strict=True):
            assert entry[t] == pytest.approx(v, abs=1e-5)
    assert [len(e) for e in prompt_logprobs(logits, nxt, num_top=0)] == [1, 1, 1, 1]


def _expected(probs: list[float], **params: Any) -> list[float]:
    """Reference distribution after temperature, then top_k, then top_p on the renormalised
    top-k distribution (as vLLM does), then min_p, in plain float64 Python."""
    p = [x ** (1.0 / params.get("temperature", 1.0)) for x in probs]
    order = sorted(range(len(p)), key=lambda t: -p[t])  # best first
    top_k = params.get("top_k", len(p))
    p = [x if order.index(t) < top_k else 0.0 for t, x in enumerate(p)]
    p = [x / sum(p) for x in p]
    mass = 0.0
    for t in order:
        if mass >= params.get("top_p", 1.0):
            mass, p[t] = mass + p[t], 0.0
        else:
            mass += p[t]
    p = [x if x >= params.get("min_p", 0.0) * max(p) else 0.0 for x in p]
    return [x / sum(p) for x in p]


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.5),
        dict(temperature=1.0, top_k=2),
        dict(temperature=1.0, top_p=0.75),
        dict(temperature=2.0, top_k=3, top_p=0.9),
        dict(temperature=1.0, top_k=3, top_p=0.75),  # keeps {2, 3} only: top-p sees the top-k renormalised
        dict(temperature=1.0, min_p=0.6),  # keeps {2, 3}
        dict(temperature=0.5, top_p=0.95, min_p=0.3),  # top-p keeps {1, 2, 3}, min-p then {2, 3}
    ],
)
def test_sampling_frequencies_match_distribution(params: dict[str, Any]) -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 4000
    logits = torch.tensor(probs).log().expand(n, 4).contiguous()
    gen = _stream(0)  # deterministic; shared by all rows, drawn in order
    out = Sampler()(logits, [_row(uniforms=gen, **params) for _ in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).tolist()
    for count, p in zip(counts, _expected(probs, **params), strict=True):
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(count - n * p) <= 5 * sigma + 1e-9, (counts, params)


@pytest.mark.parametrize("vocab", [1, 255, 256, 1000, 49152])
def test_inverse_cdf_matches_a_full_cumulative_sum(vocab: int) -> None:
    """The two-level search picks the same index as searching one float64 cumsum of the row.
    Integer weights (many of them zero) keep every sum exact, so the two agree exactly."""
    g = torch.Generator().manual_seed(vocab)
    weights = torch.randint(0, 4, (64, vocab), generator=g).float() * (torch.rand(64, vocab, generator=g) < 0.3)
    weights[:, torch.randint(0, vocab, (1,), generator=g)] = 1.0  # every row has a positive entry
    u = torch.rand(64, dtype=torch.float64, generator=g)
    u[:4] = torch.tensor([0.0, 1 - 2**-53, 0.5, 1e-9], dtype=torch.float64)
    cdf = weights.double().cumsum(dim=-1)
    expected = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    got = _inverse_cdf(weights, u)
    assert torch.equal(got, expected)
    assert bool((weights.gather(1, got.unsqueeze(1)) > 0).all())


def test_inverse_cdf_never_picks_zero_weight_when_the_draw_rounds_up() -> None:
    """u * total rounding up to the total falls back to the last entry of positive weight, also
    when the chunk sums (float32) and the float64 cumulative sums disagree in the last bits."""
    vocab = 3 * 256 + 7
    weights = torch.zeros(3, vocab)
    weights[0, 10] = 1.0  # one positive entry, first chunk
    weights[1, 300:700] = torch.rand(400, generator=torch.Generator().manual_seed(0)) * 1e-3 + 0.1
    weights[2, -1] = 5.0  # the padded last chunk
    ids = _inverse_cdf(weights, torch.full((3,), 1 - 2**-53, dtype=torch.float64))
    assert ids.tolist() == [10, 699, vocab - 1]
    assert _inverse_cdf(weights, torch.zeros(3, dtype=torch.float64)).tolist() == [10, 300, vocab - 1]


def test_random_sampling_follows_the_distribution_over_a_large_vocab() -> None:
    """Frequencies of 4,000 draws from a known distribution spread over several CDF chunks."""
    vocab, n = 1000, 4000
    probs = torch.zeros(vocab)
    probs[[3, 400, 401, 999]] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().expand(n, vocab).contiguous()
    gen = _stream(0)
    rows = [_row(uniforms=gen, temperature=1.0) for _ in range(n)]
    counts = torch.bincount(torch.tensor(Sampler()(logits, rows).token_ids), minlength=vocab).double() / n
    assert set(torch.nonzero(counts).flatten().tolist()) <= {3, 400, 401, 999}
    # 4 standard deviations of a frequency of 4,000 draws is at most 0.031
    assert torch.allclose(counts[[3, 400, 401, 999]], torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64),
                          atol=0.031)


def _fused_sampler() -> Sampler:
    sampler = Sampler()
    sampler.enable_fused()
    assert sampler.lib is not None
    return sampler


def test_float32_rows_take_the_fused_pass_and_others_the_torch_code(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagoda.layers.sampler as sampler_module

    sampler, seen = _fused_sampler(), []
    torch_path = sampler_module._sample_torch
    monkeypatch.setattr(sampler_module, "_sample_torch",
                        lambda lo, rows: seen.append(len(rows)) or torch_path(lo, rows))
    rows = [_row(temperature=0.0), _row(temperature=0.7, seed=1), _row(temperature=1.0, top_k=3, seed=2),
            _row(temperature=0.0, logit_bias={1: 1.0}), _row(temperature=1.0, top_k=VOCAB, seed=3),
            _row(temperature=1.0, repetition_penalty=1.2, top_p=0.5)]
    sampler(_logits(6), rows)
    assert seen == []  # filters, the bias and the penalty too
    sampler(_logits(6).double(), rows)  # float64 logits: the torch code for every row
    assert seen == [6]


def test_fused_pass_agrees_with_the_torch_code() -> None:
    """Same draws, same logits: the same tokens (a difference needs a draw within float32 rounding of a
    boundary between two tokens; none falls there with these seeds) and logprobs within rounding."""
    logits = torch.randn(64, 3000, generator=torch.Generator().manual_seed(0)) * 4
    logits[5, 100:2000] = float("-inf")  # masked entries: probability 0
    for t in (0.0, 0.3, 1.0, 1.7):
        rows = [_row(temperature=t, seed=s) for s in range(64)]
        torch_out = _sample_torch_only(logits, rows)
        fused_out = _fused_sampler()(logits, [_row(temperature=t, seed=s) for s in range(64)])
        assert fused_out.token_ids == torch_out.token_ids, t
        assert fused_out.logprobs == pytest.approx(torch_out.logprobs, abs=1e-5)
        assert not 100 <= fused_out.token_ids[5] < 2000
    greedy = _fused_sampler()(logits, [_row(temperature=0.0) for _ in range(64)]).token_ids
    assert greedy == logits.argmax(dim=-1).tolist()


FILTERS = [dict(top_p=0.9), dict(top_p=0.3), dict(top_k=5), dict(top_k=40, top_p=0.8), dict(min_p=0.1),
           dict(min_p=0.01, top_p=0.95), dict(top_k=2000), dict(min_p=0.5, top_k=3), dict(top_k=1)]


@pytest.mark.parametrize("vocab, scale", [(50, 3.0), (1003, 1.0), (3000, 4.0), (49152, 12.0)])
def test_fused_filters_agree_with_the_torch_code(vocab: int, scale: float) -> None:
    """Top-k, top-p and min-p in the C++ pass: the tokens the torch code draws with the same draws, and its
    logprobs (a difference needs a draw within rounding of a boundary between two tokens, or a token within
    rounding of a filter's threshold; none falls there with these seeds). The rows: peaked (a trained model's,
    scale 12: the nucleus within the first candidates' level), flat (scale 1: past every level), a vocabulary that
    is not whole vectors, -inf entries."""
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(vocab)) * scale
    logits[5, : vocab // 2] = float("-inf")
    for filters in FILTERS:
        for t in (0.5, 1.0, 1.5):
            torch_out = _sample_torch_only(logits, [_row(temperature=t, seed=s, **filters) for s in range(64)])
            fused_out = _fused_sampler()(logits, [_row(temperature=t, seed=s, **filters) for s in range(64)])
            assert fused_out.token_ids == torch_out.token_ids, (filters, t)
            assert fused_out.logprobs == pytest.approx(torch_out.logprobs, abs=1e-5)
            assert fused_out.token_ids[5] >= vocab // 2


PROCESSING = [dict(logit_bias={3: 30.0, 7: -50.0}), dict(repetition_penalty=1.6), dict(frequency_penalty=1.1),
              dict(presence_penalty=0.8, top_p=0.8), dict(min_tokens=9, top_k=5),
              dict(repetition_penalty=1.3, min_p=0.1),
              dict(logit_bias={3: 2.0, 8: -1.0}, repetition_penalty=1.4, frequency_penalty=0.3)]  # ids changed thrice


@pytest.mark.parametrize("vocab", [50, 1003])
def test_fused_pass_on_processed_rows_agrees_with_the_torch_code(vocab: int) -> None:
    """Rows with a bias, penalties or a min_tokens block (processed by the torch ops, then sampled by the C++ pass):
    the tokens the torch code draws, greedy and random, with and without filters, in one batch with plain rows;
    their logprobs those of the logits as given (raw), not of the processed ones; and the logits as given after
    (the pass processes the rows in place and puts them back, an entry changed three times included)."""
    logits = _logits(2 * len(PROCESSING) + 4, seed=5, vocab=vocab)
    eos = frozenset({int(logits[0].argmax())})
    params = [dict(temperature=t, seed=i, **p) for i, p in enumerate(PROCESSING) for t in (0.0, 0.9)]
    params += [dict(temperature=0.8, seed=40), dict(temperature=0.0), dict(temperature=1.0, top_p=0.7, seed=41),
               dict(temperature=0.5, seed=42)]

    def rows() -> list[SamplingRow]:
        return [_row(output=[3, 3, 8, 1], prompt=[7, 2, 3], eos=eos, **p) for p in params]

    given = logits.clone()
    for _ in range(3):  # the same draws each time round: seeded rows
        torch_out = _sample_torch_only(logits, rows())
        fused_out = _fused_sampler()(logits, rows())
        assert torch.equal(logits, given)
        assert fused_out.token_ids == torch_out.token_ids
        assert fused_out.logprobs == pytest.approx(torch_out.logprobs, abs=1e-5)
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert fused_out.logprobs == pytest.approx([float(raw[i, t]) for i, t in enumerate(fused_out.token_ids)],
                                               abs=1e-5)
    assert fused_out.token_ids[0] == 3 and fused_out.token_ids[1] == 3  # the bias chose it
    assert all(t not in eos for t in fused_out.token_ids[8:10])  # min_tokens blocks EOS


def test_fused_filters_break_ties_by_id() -> None:
    """Logits with many ties: top-k keeps the lowest ids among tokens tied at the k-th value, and top-p ranks
    tied tokens by id (the torch code's stable sort), so the C++ pass keeps the same sets: the tokens it draws
    for many draws are those the torch code draws."""
    logits = torch.randint(0, 4, (8, 40), generator=torch.Generator().manual_seed(0)).float().repeat(50, 1)
    for filters in [dict(top_k=3), dict(top_k=7), dict(top_p=0.2), dict(top_k=5, top_p=0.5)]:
        rows = [_row(temperature=1.0, seed=s, **filters) for s in range(400)]
        torch_ids = _sample_torch_only(logits, rows).token_ids
        fused_ids = _fused_sampler()(logits, [_row(temperature=1.0, seed=s, **filters) for s in range(400)]).token_ids
        assert fused_ids == torch_ids, filters
        if "top_p" not in filters:  # each row's kept set reached
            for r in range(8):
                assert len(set(fused_ids[r::8])) == filters["top_k"], (filters, r)


@pytest.mark.parametrize("width", [8, 4])
def test_fused_pass_at_narrower_vector_widths(width: int) -> None:
    """The pass as AVX2 CPUs (8 lanes) and older ones (4) build it, on this CPU too (its lane masks come from
    `vmovmskps` or lane by lane there), against the build for this one: the same tokens for the same draws, plain,
    filtered, processed and greedy rows, a vocabulary that is not whole vectors; and the draft check."""
    from pagoda.layers.sampler import _library
    from tests.layers.test_cpp_vector import NARROWER

    logits = _logits(24, seed=11, vocab=1003) * 3
    params = [dict(temperature=0.0), dict(temperature=0.8), *[dict(temperature=0.7, **f) for f in FILTERS],
              *[dict(temperature=0.9, **p) for p in PROCESSING]]

    def run(sampler: Sampler) -> tuple[list[int], list[int]]:
        rows = [_row(output=[3, 3, 8], **{**p, "seed": i}) for i, p in enumerate(params)]
        ids = sampler(logits[: len(rows)], rows).token_ids
        lp = array("d", [0.0])
        checks = [sampler.lib.pagoda_check_draft(logits[i].data_ptr(), 1003, 0.7, 40, 0.9, 0.0, d, u,
                                                 lp.buffer_info()[0], None)
                  for i, (d, u) in enumerate([(5, 0.3), (7, 0.9), (int(logits[2].argmax()), 0.2)])]
        return ids, checks

    narrow = _fused_sampler()
    narrow.lib = _library(NARROWER[width])
    assert run(narrow) == run(_fused_sampler())


def test_fused_filters_on_broken_rows() -> None:
    """Rows the model broke (NaN, all -inf, NaN entries among finite ones) with filters: tokens stay in the
    vocabulary (the first maximum where no token has weight) and the engine goes on."""
    base = torch.randn(4, 1003, generator=torch.Generator().manual_seed(1))
    base[0] = float("nan")
    base[1] = float("-inf")
    base[2, ::3] = float("nan")
    out = _fused_sampler()(base, [_row(temperature=1.0, seed=i, top_p=0.9, top_k=20, min_p=0.1) for i in range(4)])
    assert all(0 <= t < 1003 for t in out.token_ids)
    assert not math.isnan(float(base[2, out.token_ids[2]]))


def _sample_torch_only(logits: torch.Tensor, rows: list[SamplingRow]) -> Any:
    sampler = Sampler()
    sampler.lib = None
    return sampler(logits, rows)


def test_fused_pass_on_a_strided_subset_and_broken_rows() -> None:
    """Rows picked out of a larger batch (a view with a row stride), a vocabulary that is not whole vectors,
    and rows the model broke (NaN, all -inf): tokens stay in the vocabulary and the engine goes on."""
    base = torch.randn(6, 1003, generator=torch.Generator().manual_seed(1))
    base[1] = float("nan")
    base[2] = float("-inf")
    base[3, 1002] = 50.0  # the tail, past the last whole vector
    logits = base[:, :1003]
    out = _fused_sampler()(logits, [_row(temperature=t, seed=i) for i, t in enumerate((0.0, 1.0, 1.0, 0.5, 0.0, 2.0))])
    assert all(0 <= t < 1003 for t in out.token_ids)
    assert out.token_ids[0] == int(base[0].argmax()) and out.token_ids[3] == 1002
    assert out.token_ids[4] == int(base[4].argmax())


def test_a_plain_seeded_row_gives_the_same_tokens_whatever_the_batch() -> None:
    sampler = _fused_sampler()

    def tokens(others: list[dict[str, Any]], where: int) -> list[int]:
        gen, out = _stream(77), []
        other_gens = [_stream(i) for i in range(len(others))]
        for step in range(20):
            rows = [_row(uniforms=other_gens[i], **p) for i, p in enumerate(others)]
            rows.insert(where, _row(temperature=0.9, uniforms=gen))
            lo = _logits(len(rows), seed=500 + step)
            lo[where] = _logits(1, seed=step)[0]
            out.append(sampler(lo, rows).token_ids[where])
        return out

    alone = tokens([], 0)
    assert tokens([dict(temperature=1.0, top_p=0.5), dict(temperature=0.0, repetition_penalty=1.2)], 1) == alone
    assert len(set(alone)) > 3


def test_a_failed_build_leaves_every_row_to_the_torch_code(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    import pagoda.layers.sampler as sampler_module

    def fail() -> None:
        raise RuntimeError("no compiler")

    sampler = Sampler()  # (built by the autouse fixture's fused side, before _library fails)
    sampler.lib = None
    monkeypatch.setattr(sampler_module, "_library", fail)
    sampler.enable_fused()
    assert sampler.lib is None and "no compiler" in caplog.text
    logits = _logits(3)
    assert sampler(logits, [_row(temperature=0.0) for _ in range(3)]).token_ids == logits.argmax(dim=-1).tolist()


def test_uniform_stream_gives_the_draws_one_at_a_time_would() -> None:
    """Drawn a block at a time, the values are those of torch.rand called once per draw, across blocks, so a
    seed's tokens are what they were with one draw a step."""
    stream, gen = _stream(3), torch.Generator().manual_seed(3)
    n = 2 * UniformStream.BLOCK + 5
    one_at_a_time = [float(torch.rand((), dtype=torch.float64, generator=gen)) for _ in range(n)]
    assert [stream.next() for _ in range(n)] == one_at_a_time
    assert len(set(one_at_a_time)) == n
