"""`python -m pagoda.bench.random_model`: a published model's shape with random weights, which the engine loads and
runs (its decode steps in the one-call forward)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.bench import random_model


def test_a_shrunk_qwen3_shape_loads_and_decodes_in_one_call(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    random_model.main([str(tmp_path), "--shape", "qwen3-0.6b", "--num-layers", "1", "--vocab-size", "512"])
    report = json.loads(capsys.readouterr().out)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["head_dim"]) == ("qwen3", 1, 512, 128)
    assert cfg["num_attention_heads"] == 16 and cfg["num_key_value_heads"] == 8 and report["parameters"] > 10**7
    llm = LLM(str(tmp_path), dtype="float32", attention_backend="cpp")
    assert llm.engine.model.one_stream_forward is not None  # Qwen3's q/k norms in the call
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
