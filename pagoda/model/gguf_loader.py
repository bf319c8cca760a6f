"""Read GGUF checkpoints (llama.cpp's format) into Hugging Face terms.

`load_gguf` returns the config a HF `config.json` would hold, a `Tokenizer` built from the file's
metadata, and a lazy iterator over the weights under HF parameter names, dequantized to float and in
HF orientation (out_features, in_features). Model code can then treat a GGUF file like a HF checkpoint.

Two llama.cpp conventions are undone here:
  * ggml lists dimensions innermost-first (`ne = [in, out]`); numpy views of the data are (out, in).
  * convert_hf_to_gguf.py permutes the rows of the Q and K projections of llama-family models so that
    rope can rotate adjacent pairs (x0, x1), (x2, x3)... ("interleaved"). HF rotates the two halves
    of each head instead (rotate-half), so the permutation is reversed on load. Qwen2/Qwen3 files are
    written without it.
"""

from __future__ import annotations

import math
import mmap
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import gguf
import numpy as np
import torch

from pagoda.tokenizer import Tokenizer

# general.architecture -> HF model_type. llama.cpp writes Mistral (v0.1-v0.3) as "llama"; some tools
# write "mistral". Both are the llama architecture.
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Architectures whose Q/K rows llama.cpp permutes for interleaved rope.
_PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral"})

_Q = gguf.GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = frozenset({
    _Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1,
    _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Per-block GGUF suffix -> HF suffix under model.layers.{i}.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    **{f"attn_{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")},
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
# Tensors with no HF parameter: rope_freqs is folded into hf_config["rope_scaling"] instead.
_IGNORED_TENSORS = frozenset({"rope_freqs.weight"})


class _GGUFReader(gguf.GGUFReader):
    """GGUFReader that parses metadata from a plain ndarray view of the file instead of the np.memmap.

    Parsing metadata slices the file ~10^6 times for a 50k-token vocabulary, and every memmap slice pays
    for memmap.__array_finalize__; a plain view of the same mapped bytes makes opening ~3x faster.
    Tensors are still built from (and stay backed by) the memmap.
    """

    def _build_fields(self, offs: int, count: int) -> int:
        mapped = self.data
        self.data = cast(Any, mapped.view(np.ndarray))
        try:
            return int(super()._build_fields(offs, count))
        finally:
            self.data = mapped


@dataclass
class GGUFModel:
    hf_config: dict[str, Any]
    tokenizer: Tokenizer
    path: Path
    architecture: str  # general.architecture as written in the file (decides the Q/K unpermute)
    _reader: gguf.GGUFReader = field(repr=False)
    _hf_names: dict[str, str] = field(repr=False)  # GGUF tensor name -> HF parameter name

    def tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) one at a time, dequantized; only one weight is materialized at once, and the caller
        holds the only reference to it (the generator keeps none while suspended: a consumer that drops its copy
        frees it, as load_model does before its on_loaded hook)."""
        for tensor in self._reader.tensors:
            hf_name = self._hf_names.get(tensor.name)
            if hf_name is None:
                continue
            yield hf_name, self._weights(tensor, dtype)
            _drop_pages(self._reader, tensor)  # read: the tensor yielded is a copy (_dequantize), never a view

    def _weights(self, tensor: Any, dtype: torch.dtype) -> torch.Tensor:
        weights = _dequantize(tensor)
        is_q, is_k = ".attn_q." in tensor.name, ".attn_k." in tensor.name
        if self.architecture in _PERMUTED_ARCHITECTURES and (is_q or is_k):
            heads = self.hf_config["num_attention_heads" if is_q else "num_key_value_heads"]
            weights = _unpermute_rope_rows(weights, heads)
        return weights.to(dtype)


def load_gguf(path: str | Path) -> GGUFModel:
    """Open a GGUF file (memory-mapped), check it is supported, and read its config and tokenizer."""
    path = Path(path)
    reader = _GGUFReader(path)
    meta = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    # parsed: the fields' ~10^6 small arrays (a 50k-token vocabulary's) had held ~38 MiB through the load
    reader.fields.clear()
    arch = str(meta.get("general.architecture", ""))
    if arch not in _MODEL_TYPES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: llama, qwen2, qwen3 (mistral as llama)"
        )
    tensors = {t.name: t for t in reader.tensors}
    hf_names = _hf_tensor_names(tensors)
    for tensor in tensors.values():
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which is not supported; "
                f"supported: {supported}"
            )
    rope_freqs = tensors.get("rope_freqs.weight")
    factors = _dequantize(rope_freqs).double().numpy() if rope_freqs is not None else None
    config = _hf_config(arch, meta, tensors, factors)
    return GGUFModel(hf_config=config, tokenizer=Tokenizer.from_gguf_metadata(meta), path=path,
                     architecture=arch, _reader=reader, _hf_names=hf_names)


def _hf_tensor_names(tensors: Mapping[str, Any]) -> dict[str, str]:
    """Map every GGUF tensor to its HF name; a tensor we cannot place is an error, not silently dropped."""
    names: dict[str, str] = {}
    for name in tensors:
        if name in _IGNORED_TENSORS:
            continue
        if name in _GLOBAL_NAMES:
            names[name] = _GLOBAL_NAMES[name]
            continue
        match = _BLOCK_RE.fullmatch(name)
        if match is None or match.group(2) not in _BLOCK_NAMES:
            raise ValueError(f"GGUF tensor {name!r} has no Hugging Face equivalent")
        names[name] = f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
    return names


# Rows of a quantized tensor dequantized at a time: gguf's dequantize makes several temporaries the size of its
# output (a process dequantizing only the default model's whole (49,152, 576) embedding peaked at 722 MiB, ad hoc);
# in chunks the load's peak went from 1,241 to 1,164 MiB (BENCHMARKS.md, "the start-up's peak memory")
_DEQUANTIZE_ROWS = 4096


def _dequantize(tensor: Any) -> torch.Tensor:
    """Float32 tensor in HF orientation: ggml's ne is innermost-first, so HF's shape is ne reversed. In memory torch
    allocated (64-byte aligned, writable, not the file's), which load_model then keeps as the parameter where the
    tensor is a whole one (no second copy of the embedding: 108 MiB at the load's peak, q4_1)."""
    # A plain view of the mapped bytes: slicing an np.memmap costs ~25% extra in dequantize's block loop.
    data = tensor.data.view(np.ndarray)
    out = torch.empty(tuple(int(n) for n in reversed(tensor.shape.tolist())), dtype=torch.float32)
    if data.ndim == 2:  # rows (of values, or of quantized blocks' bytes)
        rows = out.numpy().reshape(len(data), -1)
        for start in range(0, len(data), _DEQUANTIZE_ROWS):
            rows[start:start + _DEQUANTIZE_ROWS] = gguf.quants.dequantize(data[start:start + _DEQUANTIZE_ROWS],
                                                                          tensor.tensor_type)
    else:
        out.numpy()[...] = gguf.quants.dequantize(data, tensor.tensor_type).reshape(out.shape)
    return out


def _drop_pages(reader: gguf.GGUFReader, tensor: Any) -> None:
    """Take a tensor's pages of the memory-mapped file out of this process's memory (they stay in the OS's page
    cache; a later read maps them again): read once and copied, they had added the file's 94 MiB to the load's
    peak by its end."""
    mapping = getattr(reader.data, "_mmap", None)  # np.memmap's mmap.mmap
    if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
        return  # not a memory map, or a platform without madvise: the pages stay until the file is closed
    start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
    mapping.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start)


def _unpermute_rope_rows(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert convert_hf_to_gguf.py's `permute` on Q/K rows (weight or bias).

    llama.cpp:  w.reshape(n_head, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(w.shape)
    i.e. within each head, HF row (half h, index j) moved to row 2*j + h. The inverse views the rows
    as (n_head, head_dim // 2, 2) and swaps the last two axes back.
    """
    rows = weights.shape[0]
    if rows % (2 * n_head) != 0:
        raise ValueError(f"cannot unpermute {rows} rows over {n_head} heads")
    rest = tuple(weights.shape[1:])
    w = weights.reshape(n_head, rows // n_head // 2, 2, *rest)
    return w.transpose(1, 2).reshape(weights.shape).contiguous()


def _f32(value: Any) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.99999974e-06. Return the shortest decimal
    that rounds to the same float32, which is what the original config.json said."""
    return float(str(np.float32(value)))


def _hf_config(arch: str, meta: Mapping[str, Any], tensors: Mapping[str, Any],
               rope_factors: np.ndarray | None) -> dict[str, Any]:
    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    model_type = _MODEL_TYPES[arch]
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv = key("attention.head_count_kv", heads)
    kv_heads = int(max(kv)) if isinstance(kv, list) else int(kv)  # some files store one count per layer
    q_proj = tensors.get("blk.0.attn_q.weight")
    head_dim = key("attention.key_length")
    if head_dim is None:
        head_dim = int(q_proj.shape[1]) // heads if q_proj is not None else hidden // heads
    embed = tensors.get("token_embd.weight")
    vocab = int(embed.shape[1]) if embed is not None else key("vocab_size")
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens", []))
    theta = _f32(key("rope.freq_base", 10000.0))
    return {
        "model_type": model_type,
        "architectures": [_HF_ARCHITECTURES[model_type]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(arch, meta, rope_factors, int(head_dim), theta),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": model_type == "qwen2" or "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }


def _rope_scaling(arch: str, meta: Mapping[str, Any], rope_factors: np.ndarray | None,
                  head_dim: int, theta: float) -> dict[str, Any] | None:
    """HF `rope_scaling` from a rope_freqs tensor (llama3) or rope.scaling.* metadata (linear, yarn)."""
    if rope_factors is not None:
        return _llama3_scaling(rope_factors, head_dim, theta)
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind), "factor": _f32(factor)}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                             ("attn_factor", "attention_factor")):
        if (value := meta.get(f"{arch}.rope.scaling.{gguf_key}")) is not None:
            scaling[hf_key] = _f32(value)
    return scaling


def _llama3_scaling(rope_factors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any] | None:
    """Recover HF's llama3 rope_scaling from the per-frequency divisors llama.cpp stores.

    llama.cpp writes 1 for short wavelengths, `factor` for long ones and, in between,
    1 / ((1 - s) / factor + s) with s = (orig_ctx / wavelen - low) / (high - low), linear in 1 / wavelen.
    Fitting that line gives orig_ctx / (high - low) and low / (high - low); only those ratios matter,
    so choosing low_freq_factor = 1 (Llama 3's value) reproduces the same frequencies exactly.
    """
    factor = float(rope_factors.max())
    if factor <= 1.0:
        return None
    inv_wavelen = (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)) / (2 * math.pi)
    middle = (rope_factors > 1.0 + 1e-6) & (rope_factors < factor * (1.0 - 1e-6))
    low, high, original = 1.0, 4.0, 8192.0  # llama.cpp's defaults, used when too few points to fit
    if int(middle.sum()) >= 2:
        smooth = (1.0 / rope_factors[middle] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(inv_wavelen[middle], smooth, 1)
        if intercept < 0:
            high, original = 1.0 - 1.0 / intercept, -slope / intercept
    return {
        "rope_type": "llama3",
        "factor": _f32(factor),
        "low_freq_factor": low,
        "high_freq_factor": round(float(high), 4),
        "original_max_position_embeddings": int(round(original)),
    }
