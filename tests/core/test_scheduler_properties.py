"""Property-based tests of the block pool and scheduler, driven without a model.

A fake runner "samples" a token for every request whose step brings it up to date. After every
step: free + held + cached-free == total, and each block's ref count equals the number of block
tables holding it. At the end everything is free.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import ModelRunnerOutput, SampledToken, SchedulerOutput
from pagoda.core.scheduler import Scheduler
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

EOS = 0


def fake_run(sched: SchedulerOutput, token: int) -> ModelRunnerOutput:
    out = ModelRunnerOutput()
    for seq in sched.seqs:
        if seq.samples:
            out.sampled[seq.request.request_id] = SampledToken(token, 0.0)
    return out


def check_step(s: Scheduler, sched: SchedulerOutput) -> None:
    s.kv.check_invariants()
    assert sched.num_batched_tokens <= s.config.max_num_batched_tokens
    assert len(s.running) <= s.config.max_num_seqs
    for seq in sched.seqs:
        assert seq.num_new_tokens >= 1
        assert seq.start_pos + seq.num_new_tokens <= seq.request.num_tokens
        # the request holds enough blocks for every token it will have computed
        assert len(seq.block_table) * s.kv.block_size >= seq.start_pos + seq.num_new_tokens
    ids = [seq.request.request_id for seq in sched.seqs]
    assert len(ids) == len(set(ids))


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 70), st.integers(1, 40), st.integers(0, 2)),
        st.tuples(st.just("step"), st.integers(0, 255)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    min_size=1, max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(6, 40), block_size=st.sampled_from([1, 2, 4, 16]),
       budget=st.integers(1, 64), max_seqs=st.integers(1, 8))
def test_random_add_step_abort_keeps_block_invariants(ops: list[tuple], num_blocks: int, block_size: int,
                                                      budget: int, max_seqs: int) -> None:
    kv = KVCacheManager(num_blocks, block_size)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv)
    capacity = num_blocks * block_size
    added: list[str] = []
    clock = 0.0
    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, priority = op
            prompt_len = min(prompt_len, capacity - 1)
            clock += 1
            rid = f"r{len(added)}"
            s.add_request(Request(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens),
                                  frozenset({EOS}), capacity, priority=priority, arrival_time=clock))
            added.append(rid)
        elif op[0] == "step":
            sched = s.schedule()
            check_step(s, sched)
            s.update(sched, fake_run(sched, op[1]))
            kv.check_invariants()
        elif added:
            s.abort([added[op[1] % len(added)]])
            kv.check_invariants()
    # Drain: everything finishes (no deadlock) and every block comes back.
    for _ in range(10_000):
        if not s.has_unfinished():
            break
        sched = s.schedule()
        assert not sched.is_empty, "no progress with requests queued"
        check_step(s, sched)
        s.update(sched, fake_run(sched, 5))
    assert not s.has_unfinished()
    kv.check_invariants()
    assert kv.pool.num_free_blocks == num_blocks
    assert not kv.block_tables


def make_req(rid: str, n: int, priority: int = 0, arrival: float = 0.0, max_tokens: int = 8,
             capacity: int = 10_000) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), frozenset({EOS}),
                   capacity, priority=priority, arrival_time=arrival)


def test_decodes_first_then_chunks_under_the_token_budget() -> None:
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8), KVCacheManager(100, 4))
    s.add_request(make_req("a", 3, arrival=0))
    sched = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in sched.seqs] == [("a", 3)]
    s.update(sched, fake_run(sched, 7))
    s.add_request(make_req("b", 20, arrival=1))
    sched = s.schedule()
    # a decodes (1 token) first; b's prompt is chunked into the remaining 7
    assert [(x.request.request_id, x.num_new_tokens) for x in sched.seqs] == [("a", 1), ("b", 7)]
    s.update(sched, fake_run(sched, 7))
    sched = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in sched.seqs] == [("a", 1), ("b", 7)]
    assert not sched.seqs[1].samples
    s.update(sched, fake_run(sched, 7))
    sched = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in sched.seqs] == [("a", 1), ("b", 6)]
    assert sched.seqs[1].samples


def test_priority_orders_admission_and_fcfs_within_priority() -> None:
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=1), KVCacheManager(100, 4))
    s.add_request(make_req("late-low", 2, priority=1, arrival=0))
    s.add_request(make_req("b", 2, priority=0, arrival=2))
    s.add_request(make_req("a", 2, priority=0, arrival=1))
    order = []
    while s.has_unfinished():
        sched = s.schedule()
        order += [x.request.request_id for x in sched.seqs if x.start_pos == 0]
        s.update(sched, fake_run(sched, 3))
    assert order == ["a", "b", "late-low"]


def test_preemption_picks_lowest_priority_latest_arrival_and_requeues_in_front() -> None:
    # 4 blocks of 2 tokens: three 2-token prompts fill 3 blocks; decoding needs more.
    kv = KVCacheManager(4, 2)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8), kv)
    s.add_request(make_req("x", 2, priority=0, arrival=0, capacity=8))
    s.add_request(make_req("y", 2, priority=1, arrival=1, capacity=8))
    s.add_request(make_req("z", 2, priority=0, arrival=2, capacity=8))
    sched = s.schedule()
    s.update(sched, fake_run(sched, 3))
    sched = s.schedule()  # each needs a new block for its 3rd token; only one is free
    assert sched.preempted[0] == "y"  # lowest priority first, despite arriving before z
    assert s.num_preemptions >= 1
    assert s.waiting[0].request_id in sched.preempted
    kv.check_invariants()
    while s.has_unfinished():
        sched = s.schedule()
        assert not sched.is_empty
        s.update(sched, fake_run(sched, 3))
    assert kv.pool.num_free_blocks == 4


def test_abort_frees_blocks_at_once() -> None:
    kv = KVCacheManager(10, 4)
    s = Scheduler(SchedulerConfig(), kv)
    s.add_request(make_req("a", 9))
    sched = s.schedule()
    s.update(sched, fake_run(sched, 3))
    assert kv.pool.num_used_blocks == 3
    s.abort(["a"])
    assert kv.pool.num_used_blocks == 0
    assert not s.has_unfinished()
    kv.check_invariants()


def test_generation_stops_at_max_total_tokens_with_length() -> None:
    s = Scheduler(SchedulerConfig(), KVCacheManager(10, 4))
    req = make_req("a", 5, max_tokens=100, capacity=8)
    s.add_request(req)
    while s.has_unfinished():
        sched = s.schedule()
        s.update(sched, fake_run(sched, 3))
    assert req.num_tokens == 8
    assert req.status.value == "length"
