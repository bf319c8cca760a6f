"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3), read top to bottom.

Differences are options, not branches per model: q/k/v biases (Qwen2), per-head q/k RMSNorm
(Qwen3), tied embeddings, llama3 rope scaling. Parameter names follow HF so loading is a name map, except
for two merged projections (as vLLM merges them): q, k and v are one linear, `qkv_proj`, and the MLP's gate
and up are one, `gate_up_proj`; the checkpoint's separate weights are rows of these (MERGED_PROJECTIONS).
One matmul in place of three (two) reads the input once and makes fewer, larger calls: a step's matmuls
alone 1.15x faster at 64 and 128 rows and 1.20x at 2,048 in bfloat16; whole bfloat16 steps 1.04x at
2,048 prompt tokens, 1.03x for one stream, and 0.91-1.06x (four runs) at 128 decodes, where attention
dominates (ad hoc, each alternated with the separate projections in one process).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda.layers import q4_linear
from pagoda.layers.attention import AttentionBackend, AttentionMetadata, PagedKVCache
from pagoda.layers.attention.compiled import paged_decode_attention
from pagoda.layers.elementwise import ElementwiseOps
from pagoda.layers.layernorm import RMSNorm
from pagoda.layers.q4_linear import PackedLinear, packed_of
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.model.compiled_forward import (
    OneStreamDecode,
    compile_forward,
    compile_one_stream_decode,
    one_stream_decode_inputs,
    paged_attention,
    step_context,
    write_kv,
)
from pagoda.model.one_stream import OneStreamForward
from pagoda.model.one_stream import build as build_one_stream_forward

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# merged module -> the checkpoint's modules whose weights are its rows, in order
MERGED_PROJECTIONS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                      "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


@dataclass(frozen=True)
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ArchConfig:
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        heads = int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or {}
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                                      else None),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """layers x 2 (K and V) x kv_heads x head_dim x bytes."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, layer_idx: int, ops: ElementwiseOps) -> None:
        super().__init__()
        self.ops = ops
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        # Qwen2 has biases on q/k/v only; Llama-style attention_bias covers o_proj too.
        o_bias = bias and cfg.model_type != "qwen2"
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.backend = backend

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: PagedKVCache | None,
                meta: AttentionMetadata | None, one_stream: OneStreamDecode | None = None,
                projected: bool = False) -> torch.Tensor:
        """kv_cache and meta are None inside the compiled forward: the attention op then finds them in
        the step context (pagoda/model/compiled_forward.py). one_stream: the compiled one-stream decode
        graph, whose attention is part of the graph (the caches are this module's buffers). projected: x is
        qkv_proj's output already (DecoderLayer's norm_qkv computed it with the norm)."""
        t = x.shape[0]
        qkv = x if projected else self.qkv_proj(x)  # q, k and v are column ranges of its rows: views, strided by row
        q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per head, in place in the C++ path
            q = self.ops.head_rms_norm(q, self.q_norm.weight, self.q_norm.eps)
            k = self.ops.head_rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        q, k = self.ops.rotary(q, k, cos, sin)
        if one_stream is not None:
            out = self._one_stream_attention(q, k, v, one_stream)
        elif kv_cache is None or meta is None:
            out = paged_attention(q, k, v, self.layer_idx, self.scale)
        else:
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def _one_stream_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              d: OneStreamDecode) -> torch.Tensor:
        k_cache, v_cache = self.get_buffer("k_cache"), self.get_buffer("v_cache")
        write_kv(k_cache, v_cache, d.slot, k, v)
        return paged_decode_attention(q, k_cache, v_cache, None, None, d.block_table, d.seq_len, self.scale)


class GateUpSiLU(nn.Module):
    """silu(gate) * up straight from packed gate_up weights (PackedLinear.silu_mul: one C++ call, the (T, 2I)
    projection never written out), and with down given the down projection of it in the same call
    (PackedLinear.mlp). A module of its own, without parameters, so that `--profile` times it as the MLP's linear
    (pagoda/profiler.py): SiLU's share moves from mlp_activation into mlp_linear."""

    def forward(self, x: torch.Tensor, packed: PackedLinear, down: PackedLinear | None = None) -> torch.Tensor:
        return packed.silu_mul(x) if down is None else packed.mlp(x, down)


class NormLinear(nn.Module):
    """An RMSNorm with its residual add and the packed linear after it (or, with down, the packed MLP) in one C++
    call (PackedLinear.after_norm: the same float32 bits as the norm's C++ call and then the layer's; on AMX tiles
    the norm writes its output straight into the linear's bfloat16 rows). A module of its own, without parameters,
    so that `--profile` times it (pagoda/profiler.py: forward/norm_qkv and forward/norm_mlp, which take the norm's
    share and the linear's, or the whole MLP's, out of the other lines)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, packed: PackedLinear,
                down: PackedLinear | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return packed.after_norm(x, residual, norm.weight, norm.eps, down)


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig, ops: ElementwiseOps) -> None:
        super().__init__()
        self.ops = ops
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_silu = GateUpSiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = packed_of(self.gate_up_proj)
        # Prompt-sized steps on packed Q4_1 or Q8_0 weights with the fused elementwise ops on (their SiLU is the one
        # the fused kernel runs): one call, the same float32 bits as the two below (SILU_MUL_FUSED_MIN_ROWS says
        # where it pays). Under torch ops (a compiled forward) the projection and torch's SiLU, as the model is
        # otherwise.
        # With the down projection packed alike, the two in one call (PackedLinear.mlp: the same bits again), and so
        # from the AMX tiles' fewest rows up, where the intermediate then stays in bfloat16: 1.25-1.29x the three
        # calls at 20-256 rows (BENCHMARKS.md, "Weight tiles past L1"; the one-call decode forward does the same).
        if packed is not None and packed.silu_mul_kernel is not None and self.ops.lib is not None:
            rows = x.shape[0]
            down = packed_of(self.down_proj)
            fused = rows >= q4_linear.SILU_MUL_FUSED_MIN_ROWS
            if packed.fuses_mlp_with(down) and (fused or 0 < packed.amx_rows <= rows):
                return self.gate_up_silu(x, packed, down)
            if fused:
                return self.down_proj(self.gate_up_silu(x, packed))
        gate_up = self.gate_up_proj(x)
        n = self.intermediate_size
        return self.down_proj(self.ops.silu_mul(gate_up[:, :n], gate_up[:, n:]))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, layer_idx: int, ops: ElementwiseOps) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, backend, layer_idx, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, ops)
        self.ops = ops
        self.norm_qkv = NormLinear()
        self.norm_mlp = NormLinear()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: PagedKVCache | None, meta: AttentionMetadata | None,
                one_stream: OneStreamDecode | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings, with residual None, for the first layer);
        residual: the residual stream before it. Returns the same two for the next layer: the residual
        adds are done by the norms (HF's x = x + attn(norm(x)); x = x + mlp(norm(x)), regrouped).

        On packed weights with the fused float32 elementwise ops, each norm goes into one call with the linear after
        it (NormLinear; the same bits): the qkv projection's in every step, the MLP's in steps that run the MLP in one
        call (PackedLinear.takes_norm). On AMX tiles, per call at 2,048 rows of the default model, qkv 1.22x and the
        MLP 1.04x the norm's call and then the layer's, at 32 rows 1.40x and 1.16x (BENCHMARKS.md, "RMSNorm into the
        tiles' rows"); without them the norm's pass rounds the int8 rows (takes_norm has the figures)."""
        fused = self.ops.lib is not None and self.ops.dtype == torch.float32
        qkv = packed_of(self.self_attn.qkv_proj) if fused else None
        if qkv is not None and qkv.takes_norm(x, residual, self.input_layernorm.weight):
            h, residual = self.norm_qkv(x, residual, self.input_layernorm, qkv)
            h = self.self_attn(h, cos, sin, kv_cache, meta, one_stream, projected=True)
        else:
            h, residual = self.input_layernorm(x, residual)
            h = self.self_attn(h, cos, sin, kv_cache, meta, one_stream)
        gate_up = packed_of(self.mlp.gate_up_proj) if fused else None
        down = packed_of(self.mlp.down_proj) if gate_up is not None else None
        if gate_up is not None and gate_up.fuses_mlp_with(down) and gate_up.takes_norm(
                h, residual, self.post_attention_layernorm.weight, down):
            return self.norm_mlp(h, residual, self.post_attention_layernorm, gate_up, down)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Holds `model.*` parameters (HF's inner model)."""

    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, max_positions: int,
                 dtype: torch.dtype, ops: ElementwiseOps) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, i, ops) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, max_positions: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.backend = backend
        self.ops = ElementwiseOps()  # shared by every module: torch ops until enable_fused_ops()
        self.model = LlamaModel(cfg, backend, max_positions, dtype, self.ops)
        self.compiled_forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.compiled_one_stream: Callable[..., torch.Tensor] | None = None
        self.one_stream_forward: OneStreamForward | None = None  # enable_one_stream_forward
        # the last one-call step's final hidden states and the logits that call computed for them (compute_logits)
        self._one_call_logits: tuple[torch.Tensor, torch.Tensor] | None = None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[PagedKVCache], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, hidden).

        Runs the compiled forward when `enable_compiled_forward()` made one, and decode steps (those the one-call
        forward takes: pagoda/model/one_stream.py) in one C++ call when `enable_one_stream_forward()` could build it.
        """
        self._one_call_logits = None
        if self.compiled_one_stream is not None and (inputs := one_stream_decode_inputs(meta)) is not None:
            return self.compiled_one_stream(input_ids, positions, *inputs)
        one_call = self.one_stream_forward
        if one_call is not None and (out := one_call(input_ids, positions, meta)) is not None:
            hidden, logits = out
            if logits is not None:
                self._one_call_logits = hidden, logits
            return hidden
        if self.compiled_forward is not None:
            with step_context(self.backend, kv_caches, meta):
                return self.compiled_forward(input_ids, positions)
        return self._forward(input_ids, positions, kv_caches, meta)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[PagedKVCache] | None = None, meta: AttentionMetadata | None = None,
                 one_stream: OneStreamDecode | None = None) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        residual = None
        cos, sin = self.model.rotary.cos_sin(positions)  # once per step, shared by every layer
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos, sin, kv_caches[i] if kv_caches is not None else None, meta,
                                one_stream)
        return self.model.norm(x, residual)[0]

    def _forward_one_stream(self, input_ids: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor,
                            block_table: torch.Tensor, seq_len: torch.Tensor) -> torch.Tensor:
        """One sequence's decode step with its attention inside the graph (compile_one_stream_decode)."""
        return self._forward(input_ids, positions, one_stream=OneStreamDecode(slot, block_table, seq_len))

    def enable_compiled_forward(self, kv_caches: list[PagedKVCache]) -> float:
        """Compiles the forward pass (pagoda/model/compiled_forward.py), and, for a cache stored in the
        model dtype, the one-stream decode step with its attention in the graph; returns the seconds.
        The elementwise ops go back to torch's: inductor fuses those itself."""
        self.ops.disable_cpp()
        self.compiled_forward, seconds = compile_forward(self._forward, self.config.hidden_size)
        if kv_caches[0].spec.rounds(self.model.embed_tokens.weight.dtype):
            return seconds
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            assert isinstance(layer, DecoderLayer)
            for name, tensor in (("k_cache", cache.k), ("v_cache", cache.v)):
                # as the compiled attention backend marks them (kernel_decode): a mark added later would
                # fail this graph's guards and recompile it in the middle of serving
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
                layer.self_attn.register_buffer(name, tensor, persistent=False)
        self.compiled_one_stream, more = compile_one_stream_decode(self._forward_one_stream, self.config.hidden_size)
        return seconds + more

    def enable_one_stream_forward(self, kv_caches: list[PagedKVCache]) -> float:
        """Decode steps in one C++ call (pagoda/model/one_stream.py: one sequence's, or up to 4 or, quantized, any
        number), where the eager path's kernels allow it (after enable_fused_ops and enable_gemv); returns the
        seconds its build took."""
        self.one_stream_forward, seconds = build_one_stream_forward(self, kv_caches)
        return seconds

    def enable_fused_ops(self, dtype: torch.dtype) -> float:
        """The elementwise steps in C++ (pagoda/layers/elementwise.py), for float32 and 16-bit models;
        returns the seconds spent building them."""
        return self.ops.enable_cpp(dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head on hidden states; for the hidden states a one-call step returned, the logits that call
        computed with the same kernel (pagoda/model/one_stream.py)."""
        done = self._one_call_logits
        if done is not None and hidden is done[0]:
            self._one_call_logits = None
            return done[1]
        return self.lm_head(hidden)

    def checkpoint_parameters(self) -> dict[str, tuple[str, slice]]:
        """The parameters a checkpoint holds for this model (HF names) -> (this model's parameter, the rows of
        it the checkpoint's tensor fills): all rows, except for the parts of a merged projection."""
        cfg = self.config
        kv = cfg.num_kv_heads * cfg.head_dim
        part_rows = {"self_attn.qkv_proj": (cfg.num_heads * cfg.head_dim, kv, kv),
                     "mlp.gate_up_proj": (cfg.intermediate_size, cfg.intermediate_size)}
        out: dict[str, tuple[str, slice]] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            module, _, kind = name.rpartition(".")
            merged = next((m for m in MERGED_PROJECTIONS if module.endswith("." + m)), None)
            if merged is None:
                out[name] = (name, slice(0, param.shape[0]))
                continue
            layer, start = module[: -len(merged)], 0
            for part, rows in zip(MERGED_PROJECTIONS[merged], part_rows[merged], strict=True):
                out[f"{layer}{part}.{kind}"] = (name, slice(start, start + rows))
                start += rows
        return out
