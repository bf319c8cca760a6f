"""`pagoda bench throughput --backend hf|pagoda` and `pagoda bench latency` on a tiny random model,
with small numbers: they check what is counted and reported, never how fast anything is."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pagoda.bench.hf_backend import generate_batch, left_pad, load_hf_model
from pagoda.entrypoints.cli import main
from tests.conftest import make_tiny_model

ENGINE = ["--kv-cache-memory", "8MiB", "--max-num-batched-tokens", "64"]
WORKLOAD = ["--num-prompts", "3", "--input-len", "4:9", "--output-len", "3", "--seed", "1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("bench-tiny-llama"), "llama")


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_hf_and_pagoda_backends_run_the_same_workload(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["bench", "throughput", "--model", str(model_dir), *WORKLOAD, "--json", *ENGINE]
    hf = run_json(capsys, *common, "--backend", "hf", "--hf-batch-size", "2")
    pagoda = run_json(capsys, *common)
    for result in (hf, pagoda):
        assert result["num_requests"] == 3 and result["output_tokens"] == 9
        for key in ("elapsed_s", "requests_per_second", "output_tokens_per_second", "total_tokens_per_second"):
            assert result[key] > 0
        assert set(result["ttft_s"]) == {"mean", "median", "p90", "p99"}
        rate = (result["prompt_tokens"] + result["output_tokens"]) / result["elapsed_s"]
        assert result["total_tokens_per_second"] == pytest.approx(rate)
    assert hf["backend"] == "hf" and hf["hf_batch_size"] == 2 and pagoda["backend"] == "pagoda"
    assert hf["prompt_tokens"] == pagoda["prompt_tokens"]  # the same prompts, token for token
    assert 12 <= hf["prompt_tokens"] <= 27
    assert pagoda["machine"]["torch"] == torch.__version__ and pagoda["machine"]["cpu_count"] >= 1
    memory = pagoda["memory"]  # this process's (Linux): the model's weights at least, the peak above the rest
    assert 0 < memory["rss_after_start_mib"] <= memory["peak_rss_mib"] and memory["rss_mib"] <= memory["peak_rss_mib"]


@pytest.mark.parametrize("quantization", ["none", "q4_1", "q8_0"])
def test_compute_floor_counts_the_linear_flops(model_dir: Path, capsys: pytest.CaptureFixture[str],
                                               quantization: str) -> None:
    """Also with q4_1 and q8_0, whose layers' float weights are freed: the FLOPs come from the layers' shapes."""
    from pagoda.model.llama import ArchConfig

    result = run_json(capsys, "bench", "throughput", "--model", str(model_dir), *WORKLOAD, "--json", *ENGINE,
                      "--quantization", quantization)
    a = ArchConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    attention = a.hidden_size * (2 * a.num_heads + 2 * a.num_kv_heads) * a.head_dim  # q, k, v, o
    per_token = (attention + 3 * a.hidden_size * a.intermediate_size) * a.num_layers
    expected = 2 * per_token * (result["prompt_tokens"] + 9) + 2 * a.hidden_size * a.vocab_size * 9
    assert result["matmul_gflop"] * 1e9 == pytest.approx(expected)
    assert result["achieved_gflops"] == pytest.approx(result["matmul_gflop"] / result["elapsed_s"])
    assert result["engine_options"]["quantization"] == quantization  # a saved result says what ran
    assert result["kv_cache_storage"] == ("float32" if quantization == "none" else "float16")  # auto resolved
    assert result["compute_floor_fraction"] == pytest.approx(result["achieved_gflops"] / result["matmul_peak_gflops"])
    # the peak is the best of F.linear and (the tiny model is float32) oneDNN's matmul on the plain and on the
    # packed weight and the engine's tile kernel, all measured, and of the measurements before and after the run
    assert result["matmul_peak_gflops"] == max(result["matmul_peak_gflops_f_linear"],
                                               result["matmul_peak_gflops_onednn"],
                                               result["matmul_peak_gflops_onednn_packed"],
                                               result["matmul_peak_gflops_tiles"])
    assert result["matmul_peak_gflops"] == max(result["matmul_peak_gflops_before_run"],
                                               result["matmul_peak_gflops_after_run"])


def test_one_stream_reports_prompt_and_decode_rates(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys, "bench", "throughput", "--model", str(model_dir), "--num-prompts", "1",
                      "--input-len", "20:20", "--output-len", "5", "--json", *ENGINE)
    ttft = result["ttft_s"]["mean"]
    assert result["prompt_tokens_per_second"] == pytest.approx(20 / ttft)
    assert result["decode_tokens_per_second"] == pytest.approx(4 / (result["elapsed_s"] - ttft))


def test_kv_usage_counts_filled_slots_of_held_blocks(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One 20-token prompt, 5 output tokens, blocks of 16: after steps 1-4 the request holds 2 blocks
    (32 slots) with 20, 21, 22, 23 tokens in them; after step 5 it has finished and holds none."""
    argv = ["bench", "throughput", "--model", str(model_dir), "--num-prompts", "1", "--input-len", "20:20",
            "--output-len", "5", "--json", *ENGINE]
    assert "kv_token_utilization" not in run_json(capsys, *argv)  # only measured when asked
    result = run_json(capsys, *argv, "--kv-usage")
    assert result["kv_token_utilization"] == pytest.approx((20 + 21 + 22 + 23) / (4 * 32))


def test_hf_static_batch_generates_exactly_output_len(model_dir: Path) -> None:
    hf = load_hf_model(str(model_dir), torch.float32)
    eos = 257
    # Make EOS the likeliest token everywhere: min_new_tokens must still hold every row to 6 tokens.
    with torch.no_grad():
        hf.lm_head.weight[eos] = hf.lm_head.weight.abs().max() * 50
    tokens, first = generate_batch(hf, [[1, 2, 3], [4, 5, 6, 7, 8]], 6, pad_id=eos, eos_id=eos, seed=0)
    assert tokens == 2 * 6 and first is not None


def test_left_pad() -> None:
    ids, mask = left_pad([[5, 6], [7, 8, 9]], pad_id=0)
    assert ids.tolist() == [[0, 5, 6], [7, 8, 9]] and mask.tolist() == [[0, 1, 1], [1, 1, 1]]


def test_latency_reports_every_timed_iteration(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys, "bench", "latency", "--model", str(model_dir), "--batch-size", "2", "--input-len", "6",
                      "--output-len", "3", "--num-iters", "3", "--num-iters-warmup", "1", "--json", *ENGINE)
    assert len(result["latencies_s"]) == 3 and all(t > 0 for t in result["latencies_s"])
    assert set(result["latency_s"]) == {"mean", "median", "p90", "p99"}
    assert result["avg_latency_s"] == pytest.approx(sum(result["latencies_s"]) / 3)
    assert (result["batch_size"], result["input_len"], result["output_len"]) == (2, 6, 3)
    assert result["engine_options"]["model"] == str(model_dir)
    assert main(["bench", "latency", "--model", str(model_dir), "--num-iters", "0", *ENGINE]) == 2


def test_sampling_flags_reach_the_pagoda_requests_and_no_peer(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """--temperature, --top-p and --repetition-penalty set the pagoda backend's requests; a peer, which samples at
    temperature 1 without a filter or penalty, refuses them."""
    from pagoda.entrypoints.llm import LLM

    seen: list[Any] = []
    generate = LLM.generate

    def spy(self: LLM, prompts: Any, params: Any, **kwargs: Any) -> Any:
        seen.extend(params)
        return generate(self, prompts, params, **kwargs)

    monkeypatch.setattr(LLM, "generate", spy)
    run_json(capsys, "bench", "throughput", "--model", str(model_dir), *WORKLOAD, "--json", *ENGINE,
             "--temperature", "0.5", "--top-p", "0.8", "--repetition-penalty", "1.1")
    assert len(seen) == 3 and {(p.temperature, p.top_p, p.repetition_penalty) for p in seen} == {(0.5, 0.8, 1.1)}
    for flag in (["--temperature", "0.5"], ["--top-p", "0.8"], ["--repetition-penalty", "1.1"]):
        assert main(["bench", "throughput", "--backend", "hf", "--model", str(model_dir), *WORKLOAD, *flag]) == 2
        assert "apply to the pagoda backend only" in capsys.readouterr().err


def test_llamacpp_backend_says_how_to_install(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed, whatever this machine has
    assert main(["bench", "throughput", "--backend", "llamacpp", "--model", str(model_dir), *WORKLOAD]) == 2
    assert "pip install llama-cpp-python==" in capsys.readouterr().err


def test_compute_floor_takes_the_best_rate_of_either_moment() -> None:
    """A slow moment before or after the run does not lower the floor's rate: the best matmul at either counts."""
    from types import SimpleNamespace

    from torch import nn

    from pagoda.bench.throughput import compute_floor

    model = SimpleNamespace(model=nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)), lm_head=nn.Linear(4, 10))
    before, after = {"f_linear": 1.0e11, "onednn": 0.5e11}, {"f_linear": 0.6e11, "onednn": 1.2e11}
    floor = compute_floor(model, prompt_tokens=30, output_tokens=10, elapsed=2.0, peaks=[before, after])
    flops = 2 * 64 * 40 + 2 * 40 * 10
    assert floor["matmul_gflop"] == pytest.approx(flops / 1e9)
    assert (floor["matmul_peak_gflops_f_linear"], floor["matmul_peak_gflops_onednn"]) == (100.0, 120.0)
    assert (floor["matmul_peak_gflops_before_run"], floor["matmul_peak_gflops_after_run"]) == (100.0, 120.0)
    assert floor["compute_floor_fraction"] == pytest.approx(flops / 2.0 / 1.2e11)
