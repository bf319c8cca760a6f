"""Prefix caching end to end on a tiny model (float64): same outputs on and off, far fewer prompt
tokens computed, salts isolate tenants, n > 1 samples share the prompt's blocks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from tests.conftest import make_tiny_model

SYSTEM_LEN = 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-prefix"), "qwen3")


def make_llm(model_dir: Path, caching: bool, **kw: object) -> LLM:
    options: dict[str, object] = {"kv_cache_memory": "64MiB", **kw}
    return LLM(str(model_dir), dtype="float64", max_model_len=1200, enable_prefix_caching=caching, **options)


def shared_prefix_prompts() -> list[list[int]]:
    rng = random.Random(5)
    system = [rng.randrange(256) for _ in range(SYSTEM_LEN)]
    return [system + [rng.randrange(256) for _ in range(rng.randint(5, 40))] for _ in range(32)]


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_shared_prefix_same_outputs_and_90pct_fewer_prompt_tokens(model_dir: Path) -> None:
    prompts = shared_prefix_prompts()
    results = {}
    # off; on; on with a main cache that holds about one request (1,100 tokens), backed by a second tier
    configs = {"off": (False, {}), "on": (True, {}),
               "tier": (True, {"kv_cache_memory": 512 * 1100, "kv_offload_memory": "4MiB"})}
    for name, (caching, extra) in configs.items():
        llm = make_llm(model_dir, caching, **extra)
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # the system prompt's first run (warm)
        before = llm.get_metrics()["num_prompt_tokens_computed"]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        computed = llm.get_metrics()["num_prompt_tokens_computed"] - before
        results[name] = ([o.token_ids for o in outs], computed, [o.num_cached_tokens for o in outs])
        assert llm.get_metrics()["kv_blocks_in_use"] == 0
    assert results["on"][0] == results["off"][0] == results["tier"][0]
    assert results["off"][1] == sum(len(p) for p in prompts)
    assert results["on"][1] <= 0.1 * results["off"][1]
    assert all(c >= SYSTEM_LEN - 16 for c in results["on"][2])
    assert all(c == 0 for c in results["off"][2])
    assert results["tier"][1] < results["off"][1]


def test_multi_turn_chat_hits_earlier_turns(model_dir: Path) -> None:
    rng = random.Random(9)
    outs = {}
    for caching in (False, True):
        llm = make_llm(model_dir, caching)
        history: list[int] = []
        turns = []
        for _ in range(4):
            history = history + [rng.randrange(256) for _ in range(30)]
            out = llm.generate([history], GREEDY, use_tqdm=False)[0]
            turns.append((out.token_ids, out.num_cached_tokens))
            history = history + out.token_ids
        outs[caching] = turns
        rng = random.Random(9)
    assert [t for t, _ in outs[True]] == [t for t, _ in outs[False]]
    # Each later turn finds the earlier turns (prompt and answers) in the cache.
    assert all(c > 0 for _, c in outs[True][1:])


def test_salt_isolation(model_dir: Path) -> None:
    llm = make_llm(model_dir, True)
    prompt = [[7] * 100]
    llm.generate(prompt, GREEDY, cache_salt="tenant-a", use_tqdm=False)
    assert llm.generate(prompt, GREEDY, cache_salt="tenant-a", use_tqdm=False)[0].num_cached_tokens == 96
    assert llm.generate(prompt, GREEDY, cache_salt="tenant-b", use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    # and the unsalted run is cached for unsalted requests only
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 96
    assert llm.reset_prefix_cache()
    assert llm.generate(prompt, GREEDY, cache_salt="tenant-a", use_tqdm=False)[0].num_cached_tokens == 0


@pytest.mark.parametrize("caching", [True, False])
def test_n_samples_share_the_prompt_blocks(model_dir: Path, caching: bool) -> None:
    llm = make_llm(model_dir, caching)
    engine = llm.engine
    prompt = [3] * 200  # 12 full blocks + 8 tokens
    engine.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.get_metrics()["kv_blocks_in_use"])
    # One copy of the 12 full prompt blocks, plus each sample's own last block: 12 + 4, not 4 x 13.
    assert peak <= 12 + 4
    assert engine.get_metrics()["kv_blocks_in_use"] == 0


def test_second_tier_gives_identical_outputs_and_hits(model_dir: Path) -> None:
    """A main cache too small for the conversation history: with the tier, evicted turns come back
    from it instead of being recomputed; outputs are identical either way."""
    rng = random.Random(3)
    convs = [[rng.randrange(256) for _ in range(150)] for _ in range(4)]
    results = {}
    for tier in (None, "2MiB"):
        # qwen3 tiny, float64: 2 layers x 2 x 1 kv head x 16 x 8 bytes = 512 B/token -> 256 tokens here
        llm = LLM(str(model_dir), dtype="float64", kv_cache_memory=512 * 256, kv_offload_memory=tier)
        outs = []
        for _turn in range(2):
            for c in range(4):  # round-robin over conversations evicts each one's blocks between turns
                out = llm.generate([convs[c]], GREEDY, use_tqdm=False)[0]
                convs[c] = convs[c] + out.token_ids + [rng.randrange(256) for _ in range(10)]
                outs.append((out.token_ids, out.num_cached_tokens))
        results[tier] = (outs, llm.get_metrics())
        rng = random.Random(3)
        convs = [[rng.randrange(256) for _ in range(150)] for _ in range(4)]
    assert [t for t, _ in results[None][0]] == [t for t, _ in results["2MiB"][0]]
    metrics = results["2MiB"][1]
    assert metrics["kv_offload_hits"] > 0 and metrics["kv_offload_stores"] > 0
    # turn 2 found each conversation's earlier turn: in the tier (the main cache holds one at most)
    assert all(c >= 144 for _, c in results["2MiB"][0][4:])
    assert sum(c for _, c in results[None][0][4:]) < sum(c for _, c in results["2MiB"][0][4:])


def test_kv_demand_counts_cached_prefix_and_shared_samples(model_dir: Path) -> None:
    llm = make_llm(model_dir, True)
    engine = llm.engine
    prompt = [4] * 100  # 6 full blocks of 16 (the last token is never a hit), then 4 tokens
    cold = engine.kv_demand_blocks(prompt, 28)  # 128 tokens: 8 blocks
    assert cold == 8
    assert engine.kv_demand_blocks(prompt, 28, n=4) == 6 + 4 * 2  # prompt's full blocks shared by the samples
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert engine.kv_demand_blocks(prompt, 28) == 8 - 6
    assert engine.kv_demand_blocks(prompt, 28, cache_salt="other") == 8
