"""Several decode steps in one call (`--num-scheduler-steps`): the same tokens, logprobs, stops and finish reasons
as steps taken one by one, fewer engine steps, and the scheduler's rules for when it plans them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import SchedulerOutput
from pagoda.core.scheduler import Scheduler
from pagoda.request import Request

PROMPT_LENS = [1, 9, 16, 30, 47]


def _prompts(n: int = len(PROMPT_LENS)) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(256) for _ in range(PROMPT_LENS[i % len(PROMPT_LENS)])] for i in range(n)]


# The weights the one-call forward runs several steps (and drafts) for: float32, q4_1 under a float32 model, and
# bfloat16, whose logits the sampler takes converted to float32 (OneStreamForward.steps_rows)
WEIGHTS = {"float32": ("float32", "none"), "q4_1": ("float32", "q4_1"), "bfloat16": ("bfloat16", "none")}


def _llm(folder: Path, steps: int, weights: str) -> LLM:
    # no prefix caching: a second run's prompts would start from the first's blocks
    dtype, quantization = WEIGHTS[weights]
    return LLM(str(folder), dtype=dtype, attention_backend="cpp", enable_prefix_caching=False,
               quantization=quantization, num_scheduler_steps=steps, max_num_seqs=16)


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    return [(list(c.token_ids), c.text, c.cumulative_logprob, c.finish_reason, c.stop_reason, c.logprobs)
            for r in llm.generate(prompts, params, use_tqdm=False) for c in r.outputs]


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("together", [False, True])
def test_several_steps_a_call_give_the_tokens_of_single_steps(tiny_model: tuple[str, Path], weights: str,
                                                              together: bool) -> None:
    """Greedy and seeded random requests (without filters, with top-p, with top-k and min-p; with penalties, with a
    bias, presence penalty and top logprobs, with a min_tokens block that ends inside a call), one at a time (one
    stream) or all at once (decode steps of several rows), with max_tokens that are not multiples of the steps a
    call: token ids, text, logprobs, top logprobs and finish reasons the same, exactly, in fewer engine steps."""
    arch, folder = tiny_model
    prompts = _prompts(12)
    filters: list[dict] = [{}, dict(top_p=0.8), dict(top_k=20, min_p=0.05),
                           dict(repetition_penalty=1.3, frequency_penalty=0.4, top_p=0.9),
                           dict(logit_bias={5: 2.0, 9: -1.0}, presence_penalty=0.5, logprobs=2),
                           dict(min_tokens=6, stop_token_ids=[3, 4, 7])]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=13 + 5 * i, ignore_eos=True,
                             **filters[i // 2]) for i in range(len(prompts))]
    results, steps = {}, {}
    for n in (1, 4):
        llm = _llm(folder, n, weights)
        if together:
            results[n] = _run(llm, prompts, params)
        else:
            results[n] = [x for p, sp in zip(prompts, params, strict=True) for x in _run(llm, [p], [sp])]
        steps[n] = llm.engine.stats.num_steps
        assert not llm.engine.kv.block_tables  # every block handed back
        llm.engine.kv.check_invariants()
    assert results[4] == results[1]
    for r, p in zip(results[1], params, strict=True):  # a stop id may end a row after its min_tokens
        assert len(r[0]) == p.max_tokens or p.min_tokens <= len(r[0]) < p.max_tokens and r[0][-1] in p.stop_token_ids
    assert steps[4] < steps[1] * 0.45


def test_a_stop_inside_a_call_drops_the_tokens_after_it(tiny_model: tuple[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop token id, a stop string and EOS that come in the middle of a call's tokens end the request where
    steps one by one end it: its tokens, text and reason the same, the tokens computed after the stop dropped; and
    where every row of a call has stopped (by a token: EOS or a stop id), the call runs no more steps."""
    arch, folder = tiny_model
    prompt = _prompts(1)[0]
    free = _run(_llm(folder, 1, "float32"), [prompt], [SamplingParams(temperature=0.0, max_tokens=40,
                                                                       ignore_eos=True)])[0]
    tokens, text = free[0], free[1]
    stop_at = 9  # an index that is not the last of a call of 4 (the first call's tokens are 1-4, then 5-8, 9-12)
    token = tokens[stop_at]
    first = tokens.index(token)  # the first time that token comes is where it stops
    fragment = text[len(text) // 3: len(text) // 3 + 3] or text[:1]
    cases = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[token]),
             SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[fragment]),
             SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=False)]
    for n in (4, 1):
        llm = _llm(folder, n, "float32")
        llm.engine.tokenizer.eos_token_ids = frozenset({tokens[first]})  # what each new request takes
        got = _run(llm, [prompt] * len(cases), cases)
        if n == 4:
            several = got
        assert not llm.engine.kv.block_tables
    assert several == got
    # alone, a request that stops inside a call ends the call there: one step a token up to the stop, none after
    from pagoda.model.one_stream import OneStreamForward

    llm = _llm(folder, 4, "float32")
    llm.engine.tokenizer.eos_token_ids = frozenset({tokens[first]})
    calls: list[int] = []
    step = OneStreamForward._step
    monkeypatch.setattr(OneStreamForward, "_step", lambda self, *a: calls.append(1) or step(self, *a))
    assert _run(llm, [prompt], [cases[2]]) == [several[2]]
    # one step a token 0..first (the one-token prompt's step is a one-call step too); the stop falls inside a call
    # (tokens 1-4, 5-8, 9-12 are the calls), which would otherwise have run to its end
    assert len(prompt) == 1 and first % 4 and len(calls) == first + 1
    assert several[0][0] == tokens[:first + 1] and several[0][3] == "stop" and several[0][4] == token
    assert several[1][3] == "stop" and several[1][4] == fragment and len(several[1][0]) < len(tokens)
    assert several[2][0] == tokens[:first + 1] and several[2][3] == "stop" and several[2][4] is None  # EOS


def _scheduler(steps: int, num_blocks: int = 64) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks, block_size=4, enable_caching=False)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, num_scheduler_steps=steps), kv), kv


def _request(rid: str, prompt: int, max_tokens: int, max_total: int = 1000) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(prompt)),
                   params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_ids=frozenset(),
                   max_total_tokens=max_total)


def _decode(sched: Scheduler) -> None:
    """Run the prompt step and hand each request its first token, as the runner and update would."""
    from pagoda.core.outputs import ModelRunnerOutput, SampledToken

    out = sched.schedule()
    assert out.num_steps == 1  # prompt chunks: one step
    result = ModelRunnerOutput(sampled={s.request.request_id: SampledToken(1, 0.0) for s in out.seqs})
    sched.update(out, result)


def test_the_scheduler_plans_several_steps_only_for_decodes_alone_with_room() -> None:
    sched, kv = _scheduler(8)
    a, b = _request("a", 5, max_tokens=20), _request("b", 3, max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    _decode(sched)
    out = sched.schedule()
    # b may generate 5 more tokens (max_tokens 6, one out): 5 steps, and each table holds blocks for all of them
    assert out.num_steps == 5
    for s in out.seqs:
        assert len(kv.block_table(s.request.request_id)) * 4 >= s.request.num_computed_tokens + 5
    # a waiting request: one step (it would wait for the whole call)
    sched, kv = _scheduler(8)
    sched.add_request(_request("a", 5, max_tokens=20))
    _decode(sched)
    sched.add_request(_request("c", 30, max_tokens=4))
    sched.config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, num_scheduler_steps=8)
    assert sched.schedule().num_steps == 1
    # the context limit bounds it as max_tokens does: 7 tokens to reach 12 from a prompt of 5 and one output
    sched, kv = _scheduler(8)
    sched.add_request(_request("d", 5, max_tokens=100, max_total=12))
    _decode(sched)
    assert sched.schedule().num_steps == 6
    # no room for all the steps' blocks: one step
    sched, kv = _scheduler(8, num_blocks=3)
    sched.add_request(_request("e", 7, max_tokens=100))
    _decode(sched)
    assert sched.schedule().num_steps == 1
    # the default: one
    sched, kv = _scheduler(1)
    sched.add_request(_request("f", 5, max_tokens=100))
    _decode(sched)
    assert sched.schedule().num_steps == 1


def test_the_scheduler_plans_several_steps_only_for_the_rows_a_call_takes() -> None:
    """More rows than the several-step call takes (max_steps_rows): one step, and no blocks given ahead."""
    sched, kv = _scheduler(8)
    for rid in ("a", "b"):
        sched.add_request(_request(rid, 5, max_tokens=20))
    _decode(sched)
    sched.max_steps_rows = 1
    out = sched.schedule()
    assert out.num_steps == 1
    for s in out.seqs:  # the blocks of this step's token alone
        assert len(kv.block_table(s.request.request_id)) == -(-(s.request.num_computed_tokens + 1) // 4)


def _count_planned_steps(sched: Scheduler) -> list[int]:
    """The num_steps of every step the scheduler plans from now on, in a list it appends to."""
    planned: list[int] = []
    schedule = sched.schedule

    def counted() -> SchedulerOutput:
        out = schedule()
        planned.append(out.num_steps)
        return out

    sched.schedule = counted  # type: ignore[method-assign]
    return planned


def test_rows_with_logprobs_or_penalties_take_several_steps(tiny_model: tuple[str, Path]) -> None:
    """A request asking for logprobs beside one with a repetition penalty, with --num-scheduler-steps 4: the engine
    plans calls of 4 steps for them, and the tokens are those of N = 1."""
    _, folder = tiny_model
    prompts = _prompts(2)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)]
    results, steps = {}, {}
    for n in (1, 4):
        llm = _llm(folder, n, "float32")
        steps[n] = _count_planned_steps(llm.engine.scheduler)
        results[n] = _run(llm, prompts, params)
    assert results[4] == results[1]
    assert set(steps[1]) == {1}
    assert 4 in steps[4]


def test_the_flag_is_checked() -> None:
    with pytest.raises(ValueError, match="num_scheduler_steps must be an integer in \\[1, 64\\]"):
        SchedulerConfig(num_scheduler_steps=0)
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        SchedulerConfig(num_scheduler_steps=65)
