"""Engine behaviour on a tiny random Llama: batching, seeds, stops, aborts, limits, errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.request import RequestStatus
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), max_num_batched_tokens=64, kv_cache_memory="4MiB", max_model_len=512)


def test_64_mixed_requests_finish_and_free_every_block(llm: LLM) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 200))] for _ in range(64)]
    params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), top_k=rng.choice([-1, 5]),
                             top_p=rng.choice([1.0, 0.9]), max_tokens=rng.randint(1, 24), seed=i)
              for i in range(64)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts  # input order
    for o, p in zip(outputs, params, strict=True):
        assert o.finished and 1 <= len(o.token_ids) <= (p.max_tokens or 0)
        m = o.metrics
        assert m is not None and m.first_token_time is not None and m.finished_time is not None
        assert m.arrival_time <= m.first_token_time <= m.finished_time
    metrics = llm.get_metrics()
    assert metrics["kv_blocks_in_use"] == 0
    assert metrics["num_requests_running"] == 0 and metrics["num_requests_waiting"] == 0
    llm.engine.kv.check_invariants()


def test_same_seed_same_text_whatever_the_batch(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, seed=42, max_tokens=20, ignore_eos=True)
    alone = llm.generate([[10, 20, 30]], p, use_tqdm=False)[0].token_ids
    others = [SamplingParams(temperature=0.7, seed=i, max_tokens=15) for i in range(5)]
    batch = llm.generate([[1, 2], [10, 20, 30], [5] * 50, [7] * 9, [8], [9, 9]], [others[0], p, *others[1:]],
                         use_tqdm=False)
    assert batch[1].token_ids == alone


def test_stop_string_across_tokens_is_cut_from_text(llm: LLM) -> None:
    base = llm.generate([[65, 66, 67]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0]
    text = base.text
    # Pick a stop string spanning two generated tokens (a single-byte vocabulary: one character per token).
    assert len(text) >= 8
    stop = text[4:6]
    out = llm.generate([[65, 66, 67]], SamplingParams(temperature=0, max_tokens=30, stop=[stop],
                                                      ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert out.text == text[: text.index(stop)]
    keep = llm.generate([[65, 66, 67]], SamplingParams(temperature=0, max_tokens=30, stop=[stop],
                                                       include_stop_str_in_output=True, ignore_eos=True),
                        use_tqdm=False)[0]
    assert keep.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_eos(llm: LLM) -> None:
    base = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0]
    stop_tok = base.token_ids[3]
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    # min_tokens holds off the stop token
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=10, min_tokens=10,
                                                   stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    assert len(out.token_ids) == 10 and stop_tok not in out.token_ids


def test_generation_stops_at_max_model_len(model_dir: Path) -> None:
    small = LLM(str(model_dir), max_model_len=40, kv_cache_memory="1MiB")
    out = small.generate([[3] * 30], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == 40


def test_bad_input_raises_clear_errors_and_queues_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 600], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[1\].*token ids"):
        llm.generate([[1, 2], [1, 99999]], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([[1]], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_prompt_that_can_never_fit_the_cache_is_refused(model_dir: Path) -> None:
    # 32 KiB / 512 bytes per token = 64 tokens of cache (float32: 2 layers x 2 x 2 kv heads x 16 x 4).
    small = LLM(str(model_dir), kv_cache_memory=32 * 1024, block_size=16)
    with pytest.raises(ValueError, match="KV cache holds 64 tokens"):
        small.generate([[1] * 100], SamplingParams(), use_tqdm=False)


def test_abort_at_any_time_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("a", [1] * 150, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", [2] * 10, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()  # a is mid-prefill (64-token budget)
    assert engine.get_metrics()["kv_blocks_in_use"] > 0
    out = engine.abort_request("a")
    assert out is not None and out.finish_reason == RequestStatus.FINISHED_ABORTED.value
    for _ in range(3):
        engine.step()
    engine.abort_request("b")  # mid-decode
    assert engine.get_metrics()["kv_blocks_in_use"] == 0
    assert not engine.has_unfinished_requests()
    assert engine.abort_request("unknown") is None


def test_n_samples_and_prompt_logprobs(llm: LLM) -> None:
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8,
                                                      ignore_eos=True, prompt_logprobs=2, logprobs=2),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3
    again = llm.generate([[5, 6, 7, 8]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8,
                                                        ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in again.outputs]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == 4
    for tok, entry in zip([6, 7, 8], out.prompt_logprobs[1:], strict=True):
        assert entry is not None and tok in entry and len(entry) <= 3
    for c in out.outputs:
        assert c.logprobs is not None and len(c.logprobs) == 8
        assert all(t in lp for t, lp in zip(c.token_ids, c.logprobs, strict=True))


def test_priority_runs_first_when_only_one_fits(model_dir: Path) -> None:
    one = LLM(str(model_dir), max_num_seqs=1)
    engine = one.engine
    engine.add_request("low", [1, 2], SamplingParams(max_tokens=3), priority=5)
    engine.add_request("high", [1, 2], SamplingParams(max_tokens=3), priority=-1)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["high", "low"]


def test_chat_applies_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "<|user|>hi\n<|assistant|>"


def test_profile_breaks_a_step_down_by_phase_and_module(model_dir: Path) -> None:
    prof_llm = LLM(str(model_dir), kv_cache_memory="2MiB")
    prof = prof_llm.engine.enable_profiling()
    prof_llm.generate([[1] * 40, [2] * 7], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    report = prof.report()
    for phase in ("step", "schedule", "execute", "prepare_inputs", "forward", "logits", "sampling", "update",
                  "output_processing", "forward/attention", "forward/mlp_linear"):
        assert report[phase]["ms_per_step"] > 0, phase
    assert "forward/lm_head" not in report  # the lm_head is the logits phase, outside the forward
    assert prof.counts["step"] == prof_llm.get_metrics()["num_steps"]
    parts = sum(report[p]["share"] for p in ("schedule", "execute", "update", "output_processing"))
    assert 0.5 < parts <= 1.0 + 1e-9  # the phases are inside the step and do not overlap
    inside = sum(report[p]["share"] for p in ("prepare_inputs", "forward", "logits", "sampling"))
    assert 0.5 * report["execute"]["share"] < inside <= report["execute"]["share"] + 1e-9


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_selectable_dtypes_run(model_dir: Path, dtype: str) -> None:
    llm16 = LLM(str(model_dir), dtype=dtype, kv_cache_memory="4MiB", max_num_batched_tokens=32)
    outs = llm16.generate([[1] * 70, [5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert str(llm16.engine.model.lm_head.weight.dtype) == f"torch.{dtype}"
    assert llm16.get_metrics()["kv_blocks_in_use"] == 0
