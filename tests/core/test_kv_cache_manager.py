"""KVCacheManager's block tables, without a model."""

from __future__ import annotations

import pytest

from pagoda.core import kv_cache_manager
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams


def _request(name: str, prompt_len: int, max_tokens: int | None) -> Request:
    return Request(name, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), frozenset(),
                   max_total_tokens=64)


def _grow(kv: KVCacheManager, req: Request, n: int) -> None:
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n


def test_tables_stay_consecutive_while_requests_grow_in_turn() -> None:
    """Two requests admitted back to back, then decoding a token each in turn: each table is one run of
    consecutive block ids (with the pool's front alone, their decode blocks interleaved: [0, 1, 4, 6])."""
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=False)
    reqs = [_request("a", 8, 8), _request("b", 8, None)]  # b: no max_tokens, room up to max_total_tokens
    for r in reqs:
        _grow(kv, r, 8)
    for _ in range(8):
        for r in reqs:
            _grow(kv, r, 1)
    for r in reqs:
        table = kv.block_table(r.request_id)
        assert len(table) == 4 and table == list(range(table[0], table[0] + 4)), table
    kv.check_invariants()


def test_room_behind_a_table_is_used_by_others_when_nothing_else_is_free() -> None:
    """The room kept behind a table is still free: a request that needs every other block gets it too."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    a, b = _request("a", 4, 28), _request("b", 24, 4)
    _grow(kv, a, 4)  # one block, seven kept behind it
    _grow(kv, b, 24)  # six blocks: all of them from a's room
    assert kv.pool.num_free_blocks == 1
    kv.check_invariants()


def test_a_request_longer_than_its_room_keeps_room_ahead_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The room is renewed at each allocation: a request that outgrows its first room (here the next request's blocks
    follow it) continues from the free queue's front and keeps room after that, so its table is two runs of blocks,
    not a block here and there between the other request's (with the room of the first allocation only: five runs)."""
    monkeypatch.setattr(kv_cache_manager, "ROOM_BLOCKS", 2)
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=False)
    a, b = _request("a", 4, 40), _request("b", 4, 40)
    _grow(kv, a, 4)
    _grow(kv, b, 4)
    for _ in range(24):
        _grow(kv, a, 1)
        _grow(kv, b, 1)
    for name in ("a", "b"):
        table = kv.block_table(name)
        runs = 1 + sum(1 for x, y in zip(table, table[1:], strict=False) if y != x + 1)
        assert len(table) == 7 and runs <= 2, table
    kv.check_invariants()
