"""The `pagoda` CLI, run in-process on a tiny model (and kv-calc on the default one)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pagoda.entrypoints.cli import main
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("cli-tiny"), "qwen2")


def test_generate_json_in_input_order(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "from file"}\nplain line\n')
    rc = main(["generate", "--model", str(model_dir), "--prompt", "hello", "--prompts-file", str(f),
               "--max-tokens", "5", "--temperature", "0", "--json", "--kv-cache-memory", "2MiB"])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["prompt"] for x in lines] == ["hello", "from file", "plain line"]
    for x in lines:
        assert set(x) >= {"prompt", "text", "token_ids", "finish_reason", "num_prompt_tokens", "num_cached_tokens"}
        assert len(x["token_ids"]) <= 5 and x["num_prompt_tokens"] == len(x["prompt"].encode())


def test_kv_cache_prefault_generates_the_same_tokens(model_dir: Path, capsys: pytest.CaptureFixture,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    def generate(*flags: str) -> tuple[list[int], bool]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pagoda.engine.llm_engine"):
            assert main(["generate", "--model", str(model_dir), "--prompt", "hello", "--max-tokens", "6",
                         "--temperature", "0", "--json", "--kv-cache-memory", "2MiB", *flags]) == 0
        backed = any("KV cache pages backed" in r.getMessage() for r in caplog.records)
        return json.loads(capsys.readouterr().out.splitlines()[0])["token_ids"], backed

    (prefaulted, backed), (lazy, not_backed) = generate("--kv-cache-prefault"), generate()
    assert prefaulted == lazy and backed and not not_backed  # the flag reached the engine, and only when given


def test_generate_bad_flag_value_is_an_error_not_a_crash(model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["generate", "--model", str(model_dir), "--prompt", "x", "--top-p", "2"])
    assert rc == 2 and "top_p" in capsys.readouterr().err


def test_unknown_model_is_an_error(capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--model", "nope/nothing", "--prompt", "x"]) == 2
    assert "not a known alias" in capsys.readouterr().err


def test_kv_calc_uses_kv_heads(capsys: pytest.CaptureFixture) -> None:
    assert main(["kv-calc", "--kv-cache-memory", "512MiB", "--context-len", "2048", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # SmolLM2-135M: 30 layers x 2 x 3 kv heads (not 9 query heads) x 64 x 4 bytes
    assert out["bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    assert out["num_blocks"] == 512 * 2**20 // (out["bytes_per_token"] * 16)
    assert out["max_concurrency"]["2048"] == out["num_blocks"] // (2048 // 16)


@pytest.mark.parametrize(("flags", "storage", "element_bytes"), [
    (["--quantization", "q4_1"], "float16", 2),  # auto under a weight quantization: float16, as the engine
    (["--quantization", "q8_0", "--kv-cache-dtype", "float32"], "float32", 4),
    ([], "float32", 4),
])
def test_kv_calc_follows_the_quantization(capsys: pytest.CaptureFixture, flags: list[str], storage: str,
                                         element_bytes: int) -> None:
    assert main(["kv-calc", "--kv-cache-memory", "512MiB", "--json", *flags]) == 0
    out = json.loads(capsys.readouterr().out)
    assert storage in out["kv_cache_storage"] and out["bytes_per_element"] == element_bytes
    assert out["bytes_per_token"] == 30 * 2 * 3 * 64 * element_bytes
