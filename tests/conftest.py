"""Shared fixtures: tiny random HF models saved to a temp folder, and a greedy HF reference."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest
import torch

from pagoda.bench.random_model import write_byte_tokenizer

TINY_VOCAB = 300  # 256 byte tokens + a few specials + spare ids


ARCHS: dict[str, dict[str, Any]] = {
    # GQA, untied, llama3 rope scaling
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # MHA with q/k/v biases, tied embeddings
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    # MQA with q/k RMSNorm and an explicit head_dim
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                  tie_word_embeddings=False),
}


def make_tiny_model(folder: Path, arch: str, seed: int = 0, vocab: int = TINY_VOCAB, q8_embedding: bool = False
                    ) -> Path:
    """A tiny random model of the arch saved to folder; q8_embedding: its embedding rounded to Q8_0 values, as the
    default model's is (Q8_0 in its GGUF file)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(ARCHS[arch])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                               bos_token_id=256, eos_token_id=257, initializer_range=0.2, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    if arch == "qwen2":  # biases start at zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.2)
    if q8_embedding:
        from pagoda.layers.q4_linear import QK, quantize_q8_0

        w = model.model.embed_tokens.weight
        q, d = quantize_q8_0(w)
        with torch.no_grad():
            w.copy_((d[..., None] * q.reshape(*d.shape, QK).float()).reshape(w.shape))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="session", params=sorted(ARCHS))
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch = request.param
    return arch, make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from a HF model, with its own KV cache."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, logprobs = [], []
    for _ in range(max_new_tokens):
        logp = torch.log_softmax(out.logits[0, -1].double(), dim=-1)
        tok = int(torch.argmax(out.logits[0, -1]))
        tokens.append(tok)
        logprobs.append(float(logp[tok]))
        out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs


def check_greedy_against_reference(outputs: list[Any], reference: list[tuple[list[int], list[float]]],
                                   prompt_lens: list[int], logprob_tol: float) -> None:
    """Token ids equal the reference exactly; chosen-token logprobs within logprob_tol."""
    for i, (out, (ref_tokens, ref_logprobs)) in enumerate(zip(outputs, reference, strict=True)):
        assert out.token_ids == ref_tokens, f"prompt {i} ({prompt_lens[i]} tokens)"
        got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
        assert got == pytest.approx(ref_logprobs, abs=logprob_tol), f"prompt {i} logprobs"


def resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, all) of the 4 KiB pages t's bytes lie in, as mincore reports them (Linux)."""
    page = 4096
    libc = ctypes.CDLL(None, use_errno=True)
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * -(-length // page))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), len(vec)
