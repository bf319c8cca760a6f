"""`pagoda bench compare`: the runs it plans, the ratios it computes, and one small comparison end to end on a tiny
random model (what is run and reported, never how fast anything is)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagoda.bench import compare
from pagoda.entrypoints.cli import build_parser, main
from tests.conftest import make_tiny_model


def parse(*argv: str) -> Any:
    return build_parser().parse_args(["bench", "compare", *argv])


def test_plans_the_issues_workloads_and_peers_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compare.importlib.util, "find_spec", lambda name: object())  # llama-cpp-python present
    args = parse()
    assert compare.workload_args(args) == ["--dataset", "random", "--num-prompts", "128", "--input-len", "64:512",
                                           "--output-len", "128", "--seed", "0"]
    # --prefix-len only where the dataset reads it
    assert compare.workload_args(parse("--dataset", "prefix", "--prefix-len", "256"))[-2:] == ["--prefix-len", "256"]
    assert compare.workload_args(args, "stream") == ["--num-prompts", "1", "--input-len", "16:16", "--output-len",
                                                     "129", "--seed", "0"]
    runs = compare.planned_runs(args)
    single = ["--backend", "llamacpp", "--llamacpp-parallel", "1", "--llamacpp-batch", "512"]
    assert [(workload, argv) for workload, _, argv, _ in runs] == [
        ("offline", ["--backend", "hf", "--hf-batch-size", "32", "--dtype", "bfloat16"]),
        ("offline", ["--backend", "llamacpp", "--llamacpp-parallel", "16"]),
        ("offline", []), ("offline", ["--quantization", "q4_1"]),
        ("stream", single), ("stream", []), ("stream", ["--quantization", "q4_1"]),
        ("prompt", single), ("prompt", []), ("prompt", ["--quantization", "q4_1"])]
    args = parse("--peers", "", "--also", "", "--pagoda=--kv-cache-prefault", "--pagoda",
                 "--quantization q4_1 --kv-cache-dtype int8", "--model", "m.gguf")
    assert [argv for _, _, argv, _ in compare.planned_runs(args)] == [
        ["--kv-cache-prefault"], ["--quantization", "q4_1", "--kv-cache-dtype", "int8"]]
    assert compare.workload_args(args)[-2:] == ["--model", "m.gguf"]


def test_a_missing_peer_is_skipped_with_the_reason_and_an_unknown_one_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compare.importlib.util, "find_spec", lambda name: None)
    runs = compare.planned_runs(parse("--peers", "llamacpp", "--also", "prompt"))
    skipped = [(workload, name, reason) for workload, name, argv, reason in runs if argv is None]
    assert [(w, n) for w, n, _ in skipped] == [("offline", "llama.cpp, 16 parallel sequences"),
                                               ("prompt", "llama.cpp, one sequence")]
    assert all("llama-cpp-python is not installed" in str(reason) for *_, reason in skipped)
    with pytest.raises(ValueError, match="--peers takes hf and llamacpp; got vllm"):
        compare.planned_runs(parse("--peers", "hf,vllm"))
    with pytest.raises(ValueError, match="--also takes stream and prompt; got decode"):
        compare.planned_runs(parse("--also", "decode"))


def test_a_bad_workload_fails_once_before_any_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "compare", "--num-prompts", "0", "--peers", ""]) == 2
    captured = capsys.readouterr()
    assert "--num-prompts must be >= 1, got 0" in captured.err and "running" not in captured.err


def result(backend: str, tps: float, **extra: Any) -> dict[str, Any]:
    return {"backend": backend, "total_tokens_per_second": tps, "elapsed_s": 1.0,
            "ttft_s": {"mean": 0.5, "median": 0.5, "p90": 0.9, "p99": 1.0}, **extra}


def test_single_request_tables_compare_with_llamacpp() -> None:
    runs = [{"workload": "offline", "name": "hf", "result": result("hf", 100.0)},
            {"workload": "prompt", "name": "llama.cpp",
             "result": result("llamacpp", 1.0, prompt_tokens_per_second=300.0)},
            {"workload": "prompt", "name": "default", "result": result("pagoda", 2.0, prompt_tokens_per_second=750.0)},
            {"workload": "prompt", "name": "bad", "error": "exit status 1: x"}]
    assert compare.single_table(runs, "prompt") == [
        {"name": "llama.cpp", "prompt_tokens_per_second": 300.0},
        {"name": "default", "prompt_tokens_per_second": 750.0, "over_llamacpp": 2.5},
        {"name": "bad", "error": "exit status 1: x"}]
    assert [row["name"] for row in compare.table(runs)] == ["hf"]  # the offline table leaves them out


def test_table_gives_ratios_to_the_peers_that_ran() -> None:
    runs = [{"name": "hf", "result": result("hf", 100.0)},
            {"name": "llama.cpp", "skipped": "not installed"},
            {"name": "default", "result": result("pagoda", 550.0, compute_floor_fraction=0.71,
                                                 engine_options={"dtype": "auto", "quantization": "none"})},
            {"name": "q4_1", "result": result("pagoda", 800.0, compute_floor_fraction=1.4,
                                              engine_options={"dtype": "auto", "quantization": "q4_1"})},
            {"name": "bad", "error": "exit status 2: boom"}]
    rows = compare.table(runs)
    assert rows[0] == {"name": "hf", "elapsed_s": 1.0, "total_tokens_per_second": 100.0, "ttft_mean_s": 0.5,
                       "ttft_p99_s": 1.0}
    assert rows[1] == {"name": "llama.cpp", "skipped": "not installed"}
    assert rows[2]["over_hf"] == pytest.approx(5.5) and rows[2]["over_llamacpp"] is None
    assert rows[2]["floor_target_applies"] is True and rows[3]["floor_target_applies"] is False
    assert rows[3]["over_hf"] == pytest.approx(8.0)
    assert rows[4] == {"name": "bad", "error": "exit status 2: boom"}


def test_rounds_give_medians_and_ratios_taken_round_by_round(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """--rounds 3: the sequence runs three times over, in order; each row is the median of its rounds, each ratio the
    median of the ratios to the peer's run of the same round (not a ratio of medians), with their ranges; a round
    that failed is counted and left out."""
    figures = iter([100.0, 500.0, 300.0, 800.0,  # round 1: hf, pagoda, llama.cpp one stream, pagoda one stream
                    200.0, 800.0, 100.0, 300.0,  # round 2
                    None, 600.0, 200.0, 500.0])  # round 3: hf fails
    seen: list[list[str]] = []

    def fake_run(argv: list[str]) -> dict[str, Any]:
        seen.append(argv)
        tps = next(figures)
        if tps is None:
            return {"error": "exit status 1: boom"}
        backend = "hf" if "hf" in argv else "llamacpp" if "llamacpp" in argv else "pagoda"
        return result(backend, tps, decode_tokens_per_second=tps, compute_floor_fraction=tps / 1000,
                      engine_options={"dtype": "auto", "quantization": "none"})

    monkeypatch.setattr(compare, "run_one", fake_run)
    monkeypatch.setattr(compare.importlib.util, "find_spec", lambda name: object())
    out = compare.run_compare(parse("--peers", "hf", "--pagoda", "", "--also", "stream", "--rounds", "3"))
    assert len(seen) == 12 and [r["round"] for r in out["runs"]] == [0] * 4 + [1] * 4 + [2] * 4
    hf, pagoda = out["table"]
    assert hf["total_tokens_per_second"] == 150.0 and hf["total_tokens_per_second_range"] == [100.0, 200.0]
    assert hf["failed_rounds"] == 1
    assert pagoda["total_tokens_per_second"] == 600.0 and pagoda["total_tokens_per_second_range"] == [500.0, 800.0]
    # 500 / 100 and 800 / 200 (round 3 had no HF run): median 4.5, not 600 / 150
    assert pagoda["over_hf"] == pytest.approx(4.5) and pagoda["over_hf_range"] == pytest.approx([4.0, 5.0])
    assert pagoda["compute_floor_fraction"] == pytest.approx(0.6) and pagoda["floor_target_applies"] is True
    llama, one = out["stream_table"]
    assert llama["decode_tokens_per_second"] == 200.0
    assert one["over_llamacpp"] == pytest.approx(800 / 300) and one["over_llamacpp_range"] == pytest.approx([2.5, 3.0])
    compare.report(out, as_json=False)
    printed = capsys.readouterr().out
    assert "medians of 3 rounds" in printed and "4.50x (4.00-5.00x)" in printed and "(1 rounds failed)" in printed
    with pytest.raises(ValueError, match="--rounds must be >= 1, got 0"):
        compare.run_compare(parse("--rounds", "0"))


def test_compares_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """HF and two Pagoda runs in child processes on a tiny model, one of them with a bad flag: it fails alone."""
    model = make_tiny_model(tmp_path / "tiny", "llama")
    saved = tmp_path / "cmp.json"
    assert main(["bench", "compare", "--model", str(model), "--num-prompts", "3", "--input-len", "4:9",
                 "--output-len", "3", "--peers", "hf", "--hf-batch-size", "2", "--hf-dtype", "float32",
                 "--pagoda", "--kv-cache-memory 8MiB", "--pagoda", "--kv-cache-dtype nope", "--also", "prompt",
                 "--save-result", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "| HF transformers, float32, batches of 2 |" in out and "failed: exit status 2" in out
    assert "one 512-token prompt, tokens/s" in out
    data = json.loads(saved.read_text())
    hf, ok, bad, *prompt_runs = data["runs"]
    assert [r["workload"] for r in prompt_runs] == ["prompt"] * len(prompt_runs)
    prompt_ok = next(r for r in prompt_runs if "result" in r and r["result"]["backend"] == "pagoda")
    assert prompt_ok["result"]["prompt_tokens"] == 512 and prompt_ok["result"]["output_tokens"] == 1
    assert any(row.get("prompt_tokens_per_second") for row in data["prompt_table"])
    assert hf["result"]["backend"] == "hf" and ok["result"]["backend"] == "pagoda"
    assert hf["result"]["prompt_tokens"] == ok["result"]["prompt_tokens"]  # the same workload
    assert "invalid choice: 'nope'" in bad["error"]
    row = data["table"][1]
    assert row["over_hf"] == pytest.approx(ok["result"]["total_tokens_per_second"] /
                                           hf["result"]["total_tokens_per_second"])
    assert ok["command"][:3] == ["pagoda", "bench", "throughput"] and "--kv-cache-memory" in ok["command"]
