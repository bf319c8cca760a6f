"""Property-based tests of prefix caching in the block pool / scheduler, without a model.

A fake runner writes each scheduled token id into a fake KV store at the slots of its block
table. Checked after every step: the block invariants; no block is both free and held; every
hash in the prefix map points at a block whose stored tokens are exactly the tokens that hash
names; requests with different salts never share a block.
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


class FakeKV:
    """Which token id sits in each (block, slot): what a real KV cache would hold."""

    def __init__(self, num_blocks: int, block_size: int, tier_slots: int = 0) -> None:
        self.bs = block_size
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.tier: list[list[int | None]] = [[None] * block_size for _ in range(tier_slots)]
        self.hash_tokens: dict[bytes, tuple[int, ...]] = {}  # what each hash names (full chain prefix)

    def run(self, sched: SchedulerOutput, token: int) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        for block, slot in sched.swap_out:  # as the worker does: outs, then ins, then the forward
            self.tier[slot] = list(self.slots[block])
        for slot, block in sched.swap_in:
            self.slots[block] = list(self.tier[slot])
        for seq in sched.seqs:
            req = seq.request
            for pos in range(seq.start_pos, seq.start_pos + seq.num_new_tokens):
                self.slots[seq.block_table[pos // self.bs]][pos % self.bs] = req.token_ids(pos, pos + 1)[0]
            if seq.samples:
                out.sampled[req.request_id] = SampledToken(token, 0.0)
        return out

    def check(self, kv: KVCacheManager, requests: list[Request]) -> None:
        for req in requests:
            for i, h in enumerate(req.block_hashes):
                chain = (req.cache_salt, tuple(req.token_ids(0, (i + 1) * self.bs)))
                seen = self.hash_tokens.setdefault(h, chain)  # type: ignore[arg-type]
                assert seen == chain, "one hash names two different token chains"
        for h, block_id in kv.pool.hash_to_block.items():
            _, tokens = self.hash_tokens[h]
            assert tuple(self.slots[block_id]) == tokens[-self.bs:], "a hash points at a block holding other tokens"
        for h, slot in (kv.offload._lru.items() if kv.offload else []):
            _, tokens = self.hash_tokens[h]
            assert tuple(self.tier[slot]) == tokens[-self.bs:], "a tier slot holds other tokens than its hash"


@settings(max_examples=120, deadline=None)
@given(
    prefixes=st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=40), min_size=1, max_size=3),
    reqs=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(1, 4), max_size=20), st.integers(1, 12),
                            st.sampled_from([None, "a", "b"]), st.integers(0, 3)), min_size=1, max_size=12),
    num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 2, 4]), budget=st.integers(1, 48),
    caching=st.booleans(), tier=st.sampled_from([0, 0, 1, 3, 12]),
)
def test_prefix_caching_keeps_blocks_and_hashes_consistent(
        prefixes: list[list[int]], reqs: list[tuple], num_blocks: int, block_size: int, budget: int,
        caching: bool, tier: int) -> None:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching, model_identity="m", offload_blocks=tier)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6), kv)
    fake = FakeKV(num_blocks, block_size, tier)
    capacity = num_blocks * block_size
    all_reqs: list[Request] = []
    for i, (pi, suffix, max_tokens, salt, steps_after) in enumerate(reqs):
        prompt = (prefixes[pi % len(prefixes)] + suffix)[: capacity - 1] or [1]
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), frozenset(), capacity,
                      arrival_time=float(i), cache_salt=salt)
        s.add_request(req)
        all_reqs.append(req)
        for _ in range(steps_after):
            sched = s.schedule()
            s.update(sched, fake.run(sched, 7))
            kv.check_invariants()
            fake.check(kv, all_reqs)
    for _ in range(5000):
        if not s.has_unfinished():
            break
        sched = s.schedule()
        assert not sched.is_empty
        s.update(sched, fake.run(sched, 7))
        kv.check_invariants()
        fake.check(kv, all_reqs)
    assert not s.has_unfinished()
    assert kv.pool.num_free_blocks == num_blocks
    if not caching:
        assert kv.pool.num_cached_free_blocks == 0 and not kv.pool.hash_to_block


def _req(rid: str, prompt: list[int], salt: str | None = None, max_tokens: int = 2) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), frozenset(), 10_000, cache_salt=salt)


def _run_to_end(s: Scheduler) -> None:
    while s.has_unfinished():
        sched = s.schedule()
        s.update(sched, ModelRunnerOutput(sampled={x.request.request_id: SampledToken(9, 0.0)
                                                   for x in sched.seqs if x.samples}))


def test_hit_skips_cached_blocks_but_computes_the_last_token() -> None:
    kv = KVCacheManager(32, 4, model_identity="m")
    s = Scheduler(SchedulerConfig(), kv)
    s.add_request(_req("a", list(range(1, 13))))  # 12 tokens = 3 full blocks
    _run_to_end(s)
    b = _req("b", list(range(1, 13)))
    s.add_request(b)
    sched = s.schedule()
    # 3 full blocks cached, but the last token must be computed: 2 blocks hit, 4 tokens computed
    assert b.num_cached_tokens == 8 and sched.seqs[0].num_new_tokens == 4
    assert kv.prefix_hits == 8 and kv.prefix_queries == 12 + 12


def test_salts_never_share() -> None:
    kv = KVCacheManager(32, 4, model_identity="m")
    s = Scheduler(SchedulerConfig(), kv)
    prompt = list(range(1, 14))
    for rid, salt in [("a", "t1"), ("b", "t1"), ("c", "t2"), ("d", None)]:
        r = _req(rid, prompt, salt)
        s.add_request(r)
        _run_to_end(s)
        assert r.num_cached_tokens == (12 if rid == "b" else 0), rid


def test_eviction_lru_and_tail_before_head() -> None:
    kv = KVCacheManager(6, 2, model_identity="m")
    s = Scheduler(SchedulerConfig(), kv)
    a = _req("a", [1, 2, 3, 4, 5], max_tokens=1)  # blocks [1,2] [3,4] [5]: two full, cached
    s.add_request(a)
    _run_to_end(s)
    assert kv.pool.num_cached_free_blocks == 2
    # An unrelated request needing 5 of the 6 blocks takes the 4 uncached ones first, then evicts one
    # cached block: the chain's tail before its head.
    c = _req("c", [7] * 9, max_tokens=1)
    s.add_request(c)
    s.update(s.schedule(), ModelRunnerOutput())
    assert kv.pool.lookup(a.block_hashes[0]) is not None, "the chain's head must outlive its tail"
    assert kv.pool.lookup(a.block_hashes[1]) is None


def test_second_tier_brings_evicted_blocks_back() -> None:
    kv = KVCacheManager(6, 2, model_identity="m", offload_blocks=4)
    s = Scheduler(SchedulerConfig(), kv)
    fake = FakeKV(6, 2, 4)
    reqs = [_req("a", [1, 2, 3, 4, 5], max_tokens=1), _req("b", [7] * 11, max_tokens=1),
            _req("a2", [1, 2, 3, 4, 5], max_tokens=1)]
    for r in reqs:  # b needs all 6 blocks: a's two cached blocks are evicted, spilling to the tier
        s.add_request(r)
        while s.has_unfinished():
            sched = s.schedule()
            s.update(sched, fake.run(sched, 9))
            fake.check(kv, reqs)
    assert kv.offload is not None and kv.offload.stores >= 2  # a's two, then some of b's
    assert reqs[2].num_cached_tokens == 4 and kv.offload.hits == 2


def test_a_prefix_being_computed_is_waited_for_not_computed_twice() -> None:
    kv = KVCacheManager(64, 4, model_identity="m")
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100), kv)
    shared = list(range(1, 41))  # 10 full blocks
    a, b = _req("a", shared + [50, 51]), _req("b", shared + [60])
    s.add_request(a)
    s.add_request(b)
    first = s.schedule()
    assert [x.request.request_id for x in first.seqs] == ["a"]  # b waits: its prefix is in flight
    s.update(first, ModelRunnerOutput(sampled={"a": SampledToken(9, 0.0)}))
    second = s.schedule()
    assert b.num_cached_tokens == 40 and [x.num_new_tokens for x in second.seqs if x.request is b] == [1]


def test_slot_usage_counts_shared_blocks_once() -> None:
    """KV slot usage (bench throughput --kv-usage): a shared prefix block counts once; only the
    last block of each request is partly filled."""
    kv = KVCacheManager(32, 4, model_identity="m")
    s = Scheduler(SchedulerConfig(), kv)
    a, b = _req("a", list(range(1, 11)), max_tokens=5), _req("b", list(range(100, 113)), max_tokens=5)
    s.add_request(a)
    s.schedule()  # a computes its 10 prompt tokens: blocks of 4 + 4 + 2
    a.num_computed_tokens = 10
    assert kv.slot_usage({"a": 10}) == (10, 12)
    s.add_request(b)
    s.schedule()  # b: 13 prompt tokens in 4 blocks of its own
    kv.cache_full_blocks(a)
    c = _req("c", list(range(1, 11)) + [60], max_tokens=5)
    s.add_request(c)
    s.schedule()
    shared = kv.block_table("c")[:2]
    assert shared == kv.block_table("a")[:2]  # c's first 8 tokens are a's blocks
    filled, held = kv.slot_usage({"a": 10, "b": 13, "c": 11})
    # a: 4 + 4 + 2, b: 4 + 4 + 4 + 1 in its own blocks, c: the shared 8 + its own 3
    assert (filled, held) == (10 + 13 + 3, 4 * (3 + 4 + 1))
    assert kv.slot_usage({}) == (0, held)  # held blocks count even when nothing is in them yet
    assert kv.slot_usage({"a": 10, "b": 13, "c": 0}) == (10 + 13, held)  # the shared blocks are a's
