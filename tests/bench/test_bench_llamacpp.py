"""The llamacpp backend's continuous-batching loop, driven by a fake `llama_cpp` module that checks
every batch the way llama.cpp would (positions contiguous per sequence, logits only where sampled,
no batch over n_batch, a reused sequence cleared first). The real library is an optional install
that compiles llama.cpp, so it is never needed here."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pagoda.bench.llamacpp import _run


class FakeLlama:
    def __init__(self) -> None:
        self.next_pos: dict[int, int] = {}  # per sequence: the position its next token must have
        self.tokens: dict[int, list[int]] = {}
        self.batches: list[int] = []
        self.outputs: set[int] = set()
        self.sampled = 0

    def llama_batch_init(self, n: int, embd: int, n_seq_max: int) -> Any:
        assert embd == 0 and n_seq_max == 1
        return SimpleNamespace(n_tokens=0, token=[0] * n, pos=[0] * n, n_seq_id=[0] * n,
                               seq_id=[[0] for _ in range(n)], logits=[0] * n, capacity=n)

    def llama_batch_free(self, batch: Any) -> None:
        pass

    def llama_decode(self, ctx: Any, batch: Any) -> int:
        assert 0 < batch.n_tokens <= batch.capacity
        self.batches.append(batch.n_tokens)
        self.outputs = set()
        for i in range(batch.n_tokens):
            seq = batch.seq_id[i][0]
            assert batch.n_seq_id[i] == 1 and batch.pos[i] == self.next_pos.get(seq, 0)
            self.next_pos[seq] = batch.pos[i] + 1
            self.tokens.setdefault(seq, []).append(batch.token[i])
            if batch.logits[i]:
                self.outputs.add(i)
        return 0

    def llama_sampler_sample(self, chain: Any, ctx: Any, row: int) -> int:
        assert row in self.outputs  # logits exist only where asked for
        self.sampled += 1
        return 1000 + self.sampled

    def llama_memory_seq_rm(self, memory: Any, seq: int, p0: int, p1: int) -> bool:
        assert (p0, p1) == (-1, -1)
        self.next_pos.pop(seq, None)
        self.tokens.pop(seq, None)
        return True

    def llama_get_memory(self, ctx: Any) -> str:
        return "memory"

    def llama_sampler_chain_init(self, params: Any) -> str:
        return "chain"

    def llama_sampler_chain_default_params(self) -> None:
        return None

    def llama_sampler_init_dist(self, seed: int) -> str:
        return "dist"

    def llama_sampler_chain_add(self, chain: Any, sampler: Any) -> None:
        pass

    def llama_sampler_free(self, chain: Any) -> None:
        pass


@pytest.mark.parametrize("n_parallel, n_batch", [(1, 4), (3, 8), (4, 64)])
def test_every_request_gets_exactly_its_output_len(n_parallel: int, n_batch: int) -> None:
    lib = FakeLlama()
    prompts = [list(range(10, 10 + n)) for n in (5, 17, 3, 9, 1, 12, 6)]
    output_lens = [4, 2, 7, 1, 5, 3, 2]
    elapsed, ttft, output_tokens = _run(lib, None, prompts, output_lens, n_parallel, n_batch, seed=0)
    assert output_tokens == sum(output_lens) and len(ttft) == len(prompts) and elapsed >= 0
    # Each sampled token is decoded afterwards except every request's last one.
    assert lib.sampled == sum(output_lens)
    assert sum(lib.batches) == sum(len(p) for p in prompts) + sum(output_lens) - len(prompts)
    assert max(lib.batches) <= n_batch
