"""Decode steps in one C++ call (`one_stream.cpp`): the eager forward's kernels, without its Python.

A bfloat16 step of one token is bound by reading the weights (~12 ms for the default model's 269 MB), yet
eager PyTorch spent ~10 ms more on the ~300 Python-level calls of its 30 layers (module dispatch, ctypes
calls, output allocations). `OneStreamForward` hands the same C++ kernels (the GEMV or packed linear, the fused
elementwise ops, the cpp backend's cache write and decode attention) to a loop in C++, with the weights, caches and
scratch buffers, so a step is one call. Its output is the eager forward's, bit for bit: same kernels, same order,
same arguments.

Which steps: those that are decodes alone, as many as the eager path gives to the kernels the loop calls: where
every linear runs one packed kernel (`--quantization q4_1` or `q8_0`, whose kernel takes any number of rows), or a
float32 or bfloat16 model's linears run on their tiles (f32_tiles.cpp, the default; bfloat16 in AVX-512 builds),
any number; a model's linears without tiles (--no-prepack-weights) take the GEMV for 1-GEMV_MAX_ROWS (4) rows and
oneDNN's matmuls beyond, so up to 4 sequences. A 128-sequence q4_1 decode step spent ~19% of its main thread in Python,
while the other OpenMP thread waited (BENCHMARKS.md, "Batched decode steps in one call").

Built at start-up (`build`) when every kernel it needs is in use by the eager path: a bfloat16 or float32 model
whose linears have the GEMV (or all run the same packed kernel, with `--quantization` Q4_1 or Q8_0, or the
tiles, each with the GEMV's signature), the fused elementwise ops, the cpp attention backend's kernel for a
cache of the model's dtype (or, under a float32 model, of bfloat16 or float16; or, under either, int8 with a scale
per token: K and V are rounded or quantized as the eager path's write does it; not fp8, not per-block scales).
Qwen3's per-head q and k norms run in it as in the eager path (pagoda_head_rms_norm, in place on the projection's
rows). Otherwise the model keeps its eager forward (logged).
`--compile-model` has its own one-stream graph instead.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from pagoda.layers.attention import PagedKVCache
from pagoda.layers.attention.backend import AttentionMetadata
from pagoda.layers.attention.cpp import CppAttentionBackend, span_cut, writes_in_kernel
from pagoda.layers.attention.cpp import _library_for as _attention_library
from pagoda.layers.attention.cpp import supports as cpp_supports
from pagoda.layers.cpp_build import load_library
from pagoda.layers.linear import (
    GEMV_DTYPES,
    GEMV_MAX_ROWS,
    _gemv_library,
    gemv_function,
    tiles_function,
    tiles_library,
    tiles_of,
)
from pagoda.layers.q4_linear import Q8Linear, packed_of
from pagoda.layers.tied_embedding import ROWS, TILES, TiedEmbedding

if TYPE_CHECKING:
    from pagoda.model.llama import DecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("one_stream.cpp")
_LAYER_PTRS = 14  # as in one_stream.cpp
# The kinds of call the forward can time (one_stream.cpp's OneStreamOp, in its order): `--profile` reports each
# as forward/one_call/<kind>; where a packed model's MLP is one call, gate_up_proj times all of it.
OPS = ("norm", "qkv_proj", "rotary", "write_kv", "attention", "o_proj", "gate_up_proj", "silu_mul", "down_proj",
       "lm_head")
_ELEM = {torch.float32: 0, torch.bfloat16: 1}  # one_stream.cpp's PAGODA_ELEM
_BUFFERS = 13  # one_stream.cpp's bufs


def _address(fn: Any) -> int:
    """A ctypes function's address, or an array.array's first item's."""
    if isinstance(fn, array):
        return fn.buffer_info()[0]
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


class OneStreamForward:
    """forward(input_ids, positions, meta) -> (final hidden (B, hidden), logits (B, vocab)) for a step this forward
    takes (`applies`), else None. The lm_head runs in the same call (its Python call, after the weights have
    streamed through the caches, cost ~0.25 ms a one-stream step; BENCHMARKS.md, "The lm_head in the one-call
    forward"), where it takes the GEMV, the tiles or a packed Q8_0 or Q4_1 kernel; otherwise logits is None
    and the caller runs the lm_head."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[PagedKVCache], lib: Any) -> None:
        cfg = model.config
        layers = _layers(model)
        first_attn = layers[0].self_attn
        elementwise = model.ops.lib
        attention = _attention_library(kv_caches[0], cfg.num_heads)
        dtype = self._dtype = model.model.embed_tokens.weight.dtype
        quantized = packed_of(first_attn.qkv_proj)  # if it runs a packed kernel, all run that one (_unsupported)
        # A float32 or bfloat16 model whose linears have their weights packed in tiles (linear.py's prepack_linears;
        # all of them or none, _unsupported) runs f32_tiles.cpp's kernel at every row count, as the eager path does
        tiles = tiles_of(first_attn.qkv_proj) is not None
        # The most decodes a step may have to be taken: the packed kernels and the tiles take any number of rows,
        # and are what the eager path runs; the GEMV is the eager path's kernel for 1-GEMV_MAX_ROWS rows (oneDNN's
        # beyond).
        self.max_rows = sys.maxsize if quantized is not None or tiles else GEMV_MAX_ROWS
        linear_fn = (quantized.kernel if quantized is not None else tiles_function(tiles_library(), dtype) if tiles
                     else gemv_function(_gemv_library(), dtype))
        lm_head = _lm_head(model)
        self._lm_w = lm_head[1] if lm_head is not None else None
        # Steps of more rows than the lm_head's kernel takes leave its logits to the caller (a quantized model whose
        # lm_head could not be packed, its vocabulary not whole tiles, has the GEMV there; in the call, rows past the
        # GEMV's were left unwritten)
        self._lm_rows = lm_head[3] if lm_head is not None else 0
        self._logits_dtype = lm_head[2] if lm_head is not None else dtype
        self._vocab = model.lm_head.out_features
        # the eager path's cache write (cpp.write_kv): rows in the cache's dtype copied, float32 ones rounded (or
        # quantized)
        write = attention.pagoda_write_kv_rows if kv_caches[0].k.dtype == dtype else attention.pagoda_write_kv_f32
        # A packed model's MLP in one call (PackedLinear.mlp: the same bits as its three calls) for steps the AMX
        # tiles take: there the gate_up pass hands the down pass its output in bfloat16; 1.25-1.29x the three calls
        # at 20-256 rows (BENCHMARKS.md, "Weight tiles past L1"). Fewer rows keep the three calls, and so does a CPU
        # without the tiles, where the fused gate_up and SiLU had made one stream's steps slower.
        mlps = [(packed_of(layer.mlp.gate_up_proj), packed_of(layer.mlp.down_proj)) for layer in layers]
        mlp_rows = quantized.amx_rows if quantized is not None else 0
        if not mlp_rows or not all(gu is not None and gu.fuses_mlp_with(down) for gu, down in mlps):
            mlp_rows = 0
        # Each norm in one call with the linear after it, the qkv projection, the gate_up projection or the MLP where
        # that is one call (DecoderLayer's norm_qkv and norm_mlp: the same bits again): the norm's pass writes the
        # rows the kernel reads (int8 blocks, or the AMX tiles' bfloat16) instead of float32 rows that the kernel's
        # own pass reads back (PackedLinear.takes_norm has the figures).
        norms = quantized is not None and hasattr(quantized.lib, "pagoda_norm_linear") and all(
            packed_of(layer.self_attn.qkv_proj) is not None for layer in layers)
        fns = [linear_fn, elementwise.pagoda_add_rms_norm, elementwise.pagoda_rotary,
               elementwise.pagoda_silu_mul, write, attention.pagoda_paged_decode_rows,
               lm_head[0] if lm_head is not None else linear_fn,
               quantized.lib.pagoda_packed_mlp if mlp_rows and quantized is not None else None,
               quantized.lib.pagoda_norm_linear if norms and quantized is not None else None,
               quantized.lib.pagoda_norm_mlp if norms and quantized is not None else None,
               elementwise.pagoda_head_rms_norm]
        self._fns = (ctypes.c_void_p * len(fns))(*[_address(f) for f in fns])

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        def weight(linear: nn.Linear) -> int | None:  # packed weights (quantized), or tiles
            packed = packed_of(linear)
            return ptr(packed.w if packed is not None else tiles_of(linear) if tiles else linear.weight)

        def bias(linear: nn.Linear) -> int | None:  # the bias the layer's forward adds
            packed = packed_of(linear)
            return ptr(packed.bias if packed is not None else linear.bias)

        ptrs: list[int | None] = []
        for layer, cache in zip(layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            ptrs += [ptr(layer.input_layernorm.weight), weight(attn.qkv_proj), bias(attn.qkv_proj),
                     weight(attn.o_proj), bias(attn.o_proj), ptr(layer.post_attention_layernorm.weight),
                     weight(mlp.gate_up_proj), weight(mlp.down_proj), ptr(cache.k), ptr(cache.v), ptr(cache.k_scale),
                     ptr(cache.v_scale), ptr(attn.q_norm.weight if attn.q_norm is not None else None),
                     ptr(attn.k_norm.weight if attn.k_norm is not None else None)]
        assert len(ptrs) == _LAYER_PTRS * len(layers)
        self._layers = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self._num_layers = len(layers)
        self._cfg = cfg
        kv_as_f32 = dtype == torch.bfloat16 and kv_caches[0].spec.quantized  # an int8 cache's write takes float32
        embed = model.model.embed_tokens  # its rows, or a tied lm_head's packed weight that it reads them from
        self._embed = embed.packed if isinstance(embed, TiedEmbedding) else embed.weight
        embed_layout = embed.layout if isinstance(embed, TiedEmbedding) else ROWS
        embed_panel = self._embed.shape[2] if embed_layout == TILES else 0
        self._dims = torch.tensor([cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   cfg.intermediate_size, int(kv_as_f32), mlp_rows,
                                   int(isinstance(quantized, Q8Linear)), embed_layout, embed_panel],
                                  dtype=torch.int64)
        self.mlp_min_rows = mlp_rows  # the fewest decodes a step has for its MLP to be one call (0: never)
        self.fused_norms = norms  # whether steps run each norm in one call with the linear after it
        self._rows = self._work_floats = 0  # what the scratch buffers hold (_scratch)
        self._bufs_tensors: list[torch.Tensor] = []
        self._bufs = (ctypes.c_void_p * _BUFFERS)()
        self._eps = ctypes.c_float(layers[0].input_layernorm.eps)
        self._scale = ctypes.c_float(first_attn.scale)
        self._final_norm = model.model.norm.weight
        rotary = model.model.rotary
        self._cos, self._sin = rotary.cos, rotary.sin
        assert self._cos.stride() == self._sin.stride() and self._cos.stride(1) == 1
        self._fn = lib.pagoda_one_stream_forward
        self._hidden = cfg.hidden_size

    @property
    def steps_rows(self) -> int:
        """The most rows decode_steps and verify take: their lm_head in the call (0: never). Its logits are float32,
        or a bfloat16 model's bfloat16, which the sampler takes converted to float32 (exactly: as the engine's
        runner converts a step's), so the tokens are those of steps one by one either way."""
        return min(self.max_rows, self._lm_rows) if self._logits_dtype in (torch.float32, torch.bfloat16) else 0

    def _logits(self, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where the call writes `rows` rows of logits (the lm_head's dtype), and, where that is not float32, a
        float32 buffer for them (_as_float32)."""
        logits = torch.empty((rows, self._vocab), dtype=self._logits_dtype)
        return logits, None if logits.dtype == torch.float32 else torch.empty((rows, self._vocab))

    def applies(self, meta: AttentionMetadata) -> bool:
        """Whether the step is decodes alone, in one group in batch order, at most max_rows of them."""
        groups = meta.decode_groups
        return len(groups) == 1 and groups[0].whole_step and groups[0].rows.shape[0] <= self.max_rows

    def _scratch(self, rows: int, work_floats: int) -> None:
        """Scratch buffers for at least rows rows and a decode work area of work_floats floats, grown (to twice
        what is asked, so that a growing batch reallocates a few times) where they hold less."""
        if rows <= self._rows and work_floats <= self._work_floats:
            return
        self._rows, self._work_floats = max(rows, 2 * self._rows), max(work_floats, 2 * self._work_floats)
        cfg, dtype, n = self._cfg, self._dtype, self._rows
        h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
            cfg.intermediate_size
        f32 = torch.float32
        self._bufs_tensors = [torch.empty(n, h, dtype=dtype), torch.empty(n, h, dtype=dtype),
                              torch.empty(n, q + 2 * kv, dtype=dtype), torch.empty(n, max(q, 2 * kv), dtype=f32),
                              torch.empty(n, q, dtype=f32), torch.empty(n, q, dtype=dtype),
                              torch.empty(n, h, dtype=dtype), torch.empty(n, 2 * inter, dtype=dtype),
                              torch.empty(n, inter, dtype=dtype), torch.empty(n, h, dtype=dtype),
                              torch.empty(self._work_floats, dtype=f32),
                              torch.empty(n, cfg.head_dim, dtype=dtype), torch.empty(n, cfg.head_dim, dtype=dtype)]
        assert len(self._bufs_tensors) == _BUFFERS
        self._bufs = (ctypes.c_void_p * _BUFFERS)(*[t.data_ptr() for t in self._bufs_tensors])

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 op_seconds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The step's final hidden states and logits (None where the lm_head is not in the call), or None if it
        is not a step this forward takes, or a position is past the rotary tables: the eager forward then runs
        it (and raises the index error). op_seconds: float64 (len(OPS),), to which each kind of call adds its
        wall time."""
        if not self.applies(meta):
            return None
        group = meta.decode_groups[0]
        table, seq_lens = group.block_tables.contiguous(), group.seq_lens.contiguous()
        slots, ids, pos = meta.slot_mapping.contiguous(), input_ids.contiguous(), positions.contiguous()
        assert ids.dtype == pos.dtype == table.dtype == seq_lens.dtype == slots.dtype == torch.int64
        b, width = table.shape
        assert ids.shape == pos.shape == slots.shape == seq_lens.shape == (b,)
        out = torch.empty((b, self._hidden), dtype=self._dtype)
        lm_in_call = b <= self._lm_rows  # 0 where the lm_head is never in the call
        logits = torch.empty((b, self._vocab), dtype=self._logits_dtype) if lm_in_call else None
        failed = self._step(b, ids.data_ptr(), pos.data_ptr(), slots.data_ptr(), table.data_ptr(), width,
                            seq_lens.data_ptr(), group.span_width, out, logits, op_seconds)
        return None if failed else (out, logits)

    def _step(self, b: int, ids: int, positions: int, slots: int, table: int, table_width: int, seq_lens: int,
              span_width: int, out: torch.Tensor, logits: torch.Tensor | None, op_seconds: torch.Tensor | None,
              cut_rows: int = 0) -> int:
        """One decode step of b rows from the addresses of its int64 inputs (ids, positions, slots, seq_lens: b
        each; the block tables b x table_width), cutting each sequence's context into spans as a step of cut_rows
        rows (0: b) whose tables are span_width blocks wide is cut (cpp.span_cut, as the eager path's kernel call);
        1 where a position is past the rotary tables (nothing computed)."""
        span_blocks, spans = span_cut(cut_rows or b, table_width, span_width)
        cfg = self._cfg
        self._scratch(b, b * spans * cfg.num_heads * (cfg.head_dim + 2))
        return int(self._fn(self._fns, self._layers, self._num_layers, self._dims.data_ptr(), self._eps, self._scale,
                            self._bufs, b, ids, self._embed.data_ptr(), self._final_norm.data_ptr(),
                            self._cos.data_ptr(), self._sin.data_ptr(), self._cos.stride(0), self._cos.shape[0],
                            positions, slots, table, seq_lens, table_width, span_blocks, out.data_ptr(),
                            self._lm_w if logits is not None else None,
                            None if logits is None else logits.data_ptr(), self._vocab,
                            None if op_seconds is None else _seconds_buffer(op_seconds)))

    def decode_steps(self, tables: list[list[int]], positions: list[int], ids: list[int], block_size: int,
                     steps: int, sample: Callable[[int, torch.Tensor, int], bool],
                     op_seconds: torch.Tensor | None = None) -> tuple[array, int] | None:
        """Up to `steps` decode steps of b sequences in a row, each step's inputs its sampled tokens: sequence r's
        first step takes token ids[r] at position positions[r], its block table tables[r] holding every block the
        steps write. After step s's forward, sample(s, logits, address) writes the step's b token ids (int64) at
        address: the ids the next step takes; it returns True where no row needs more steps (each has stopped), and
        the call then ends there. Each step is the one-call step the engine would run alone (the same
        span cut: its sequences' blocks so far, as the table of a step of its own is wide), so the tokens are the
        same as from steps taken one by one. Returns ((steps + 1) x b token ids, row 0 the inputs; and the steps
        run: fewer than asked where every row stopped or a position is past the rotary tables), or None where the
        forward does not take these steps (more rows than steps_rows; no step was run). sample gets float32 logits
        (steps_rows says how a bfloat16 model's are converted)."""
        b = len(ids)
        if not 0 < b <= self.steps_rows:
            return None
        width = max(len(t) for t in tables)
        lens = [[p + s + 1 for p in positions] for s in range(steps)]
        slots = [[_slot(t, p + s, block_size) for t, p in zip(tables, positions, strict=True)] for s in range(steps)]
        blob, (base, slot0, len0, pos0) = _blob(tables, width, [x for row in slots for x in row],  # read by the calls
                                                [x for row in lens for x in row],
                                                [p + s for s in range(steps) for p in positions])
        stride = b * 8  # a step's row of each column
        tokens = array("q", ids + [0] * (steps * b))
        out = torch.empty((b, self._hidden), dtype=self._dtype)
        logits, buffer = self._logits(b)
        done = 0
        for s in range(steps):
            blocks = -(-max(lens[s]) // block_size)  # the table's width in a step of its own
            if self._step(b, _address(tokens) + s * stride, pos0 + s * stride, slot0 + s * stride, base, width,
                          len0 + s * stride, blocks, out, logits, op_seconds):
                break
            done += 1
            if sample(s, _as_float32(logits, buffer), _address(tokens) + (s + 1) * stride):
                break
        return tokens, done

    def verify(self, tables: list[list[int]], positions: list[int], inputs: list[list[int]], block_size: int,
               op_seconds: torch.Tensor | None = None) -> tuple[torch.Tensor, int] | None:
        """Logits for draft tokens in one call (speculative decoding): sequence s takes inputs[s] (its last token,
        then its drafts) at positions[s], positions[s] + 1, ..., each as a row of its own over the sequence's
        table, the row of position p seeing the first p + 1 tokens (the rows' K and V are all written before any
        row attends: causal attention within the drafts). Each row is computed as the decode step at its position
        would compute it (the same span cut: B sequences' tables as wide as the blocks their contexts take there),
        so for one sequence the logits are that step's, bit for bit (up to 17 rows: the decode kernel changes its
        blocks a softmax update only from 32 rows, cpp_kernel.cpp's DECODE_BATCH_MIN); drafts past the first
        position whose step would cut spans otherwise (every 4 blocks or so) are not verified. Returns (logits
        (rows, vocab) float32, sequence s's rows first, each 1 + min(len(inputs[s]) - 1, kept); kept), or None
        where the forward does not take the rows (too many, the lm_head outside the call, or a position past the
        rotary tables)."""
        b = len(inputs)
        longest = max(len(x) for x in inputs)

        def cut(i: int) -> int:  # the span cut of the B sequences' decode step at draft index i
            return span_cut(b, 1, -(-max(p + i + 1 for p in positions) // block_size))[0]

        kept = 0
        while kept + 1 < longest and cut(kept + 1) == cut(0):
            kept += 1
        rows = [(t, p + i, x) for t, p, xs in zip(tables, positions, inputs, strict=True)
                for i, x in enumerate(xs[:kept + 1])]
        r = len(rows)
        if not 0 < r <= self.steps_rows:
            return None
        width = max(len(t) for t in tables)
        blob, (base, slots, lens, pos, ids) = _blob([t for t, _, _ in rows], width,  # read by the call
                                                    [_slot(t, p, block_size) for t, p, _ in rows],
                                                    [p + 1 for _, p, _ in rows], [p for _, p, _ in rows],
                                                    [x for _, _, x in rows])
        out = torch.empty((r, self._hidden), dtype=self._dtype)
        logits, buffer = self._logits(r)
        if self._step(r, ids, pos, slots, base, width, lens, -(-max(p + kept + 1 for p in positions) // block_size),
                      out, logits, op_seconds, cut_rows=b):
            return None
        return _as_float32(logits, buffer), kept


def _as_float32(logits: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    """The call's logits as float32 (OneStreamForward._logits): themselves, or converted into buffer."""
    return logits if buffer is None else buffer.copy_(logits)


def _slot(table: list[int], position: int, block_size: int) -> int:
    """The cache slot of a sequence's token at position (its block table's block, and the offset in it)."""
    return table[position // block_size] * block_size + position % block_size


def _blob(tables: list[list[int]], width: int, *columns: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The block tables as one (len(tables), width) array, each padded with block 0 (never read: past its length),
    then each column, in one int64 tensor (one list to convert): the tensor (keep it while the call runs) and the
    addresses of the tables and of each column."""
    flat = [x for t in tables for x in t + [0] * (width - len(t))]
    data = torch.tensor(flat + [x for c in columns for x in c], dtype=torch.int64)
    addresses = [data.data_ptr()]
    at = addresses[0] + len(flat) * 8
    for c in columns:
        addresses.append(at)
        at += len(c) * 8
    return data, addresses


def _seconds_buffer(op_seconds: torch.Tensor) -> int:
    if op_seconds.dtype != torch.float64 or op_seconds.shape != (len(OPS),) or not op_seconds.is_contiguous():
        raise ValueError(f"op_seconds must be a contiguous float64 tensor of shape ({len(OPS)},)")
    return op_seconds.data_ptr()


def _lm_head(model: LlamaForCausalLM) -> tuple[Any, int, torch.dtype, int] | None:
    """The lm_head's kernel, weight address, output dtype (what its own forward returns) and the most rows the kernel
    takes, where its forward on the final norm's rows (of the model's dtype) is a call the loop can make: the GEMV
    (installed by enable_gemv; 1-GEMV_MAX_ROWS rows), a packed Q8_0/Q4_1 kernel (any number; without a bias) or a
    float32 or bfloat16 model's tiles (any number); else None."""
    lm, dtype = model.lm_head, model.model.embed_tokens.weight.dtype
    if lm.bias is not None:
        return None
    packed = packed_of(lm)
    if packed is not None:  # it takes float32 rows and writes float32
        ok = packed.bias is None and dtype == torch.float32
        return (packed.kernel, packed.w.data_ptr(), torch.float32, sys.maxsize) if ok else None
    tiles = tiles_of(lm)
    if tiles is not None:  # a float32 or bfloat16 model's
        ok = tiles.dtype == dtype
        return (tiles_function(tiles_library(), dtype), tiles.data_ptr(), dtype, sys.maxsize) if ok else None
    if getattr(lm, "_pagoda_gemv", None) is None or not lm.weight.is_contiguous() or lm.weight.dtype != dtype:
        return None
    return gemv_function(_gemv_library(), dtype), lm.weight.data_ptr(), dtype, GEMV_MAX_ROWS


def _layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    return cast("list[DecoderLayer]", list(model.model.layers))


def _cache_written(dtype: torch.dtype, cache: PagedKVCache) -> bool:
    """Whether the loop writes a model of dtype's K and V to the cache as the eager path does: the cache is of the
    model's dtype, or a float32 model's is bfloat16 or float16 (rounded by the kernel), or it is int8 with a scale per
    token (quantized by the kernel from float32 rows; a bfloat16 model's converted first, as `cpp.write_kv` does)."""
    if cache.spec.quantized:
        return writes_in_kernel(cache)
    return cache.k.dtype == dtype or (dtype == torch.float32 and cache.k.dtype in (torch.bfloat16, torch.float16))


def _unsupported(model: LlamaForCausalLM, kv_caches: list[PagedKVCache]) -> str | None:
    """Why the model's one-stream steps cannot run in one call, or None."""
    cfg = model.config
    layers = _layers(model)
    linears = [m for m in model.model.modules() if isinstance(m, nn.Linear)]
    dtype = model.model.embed_tokens.weight.dtype
    if dtype not in GEMV_DTYPES:
        return "the model is not bfloat16 or float32"
    if model.ops.lib is None or model.ops.dtype != dtype:
        return "the fused elementwise ops are off"
    kinds = {(type(packed_of(m)), tiles_of(m) is not None) for m in linears}
    if len(kinds) > 1:
        return "the linears do not all run the same kernel (Q4_1, Q8_0, the tiles or the GEMV)"
    packed = [packed_of(m) is not None or tiles_of(m) is not None for m in linears]
    if not linears or (not all(packed) and any(getattr(m, "_pagoda_gemv", None) is None for m in linears)):
        return "the linears have no GEMV"
    backend = model.backend
    if not isinstance(backend, CppAttentionBackend) or not backend.kernel_ready or backend.fallback:
        return "the attention backend is not the cpp kernel"
    cache = kv_caches[0]
    if not _cache_written(dtype, cache) or not cpp_supports(cache, dtype):
        # fp8 has no arithmetic of its own on CPUs: int8 per token stores as many tokens, rounds less and, in the
        # one-call decode, ran 128 q4_1 requests 1.29x as fast (BENCHMARKS.md), so the log says so.
        hint = ("; int8 per token (--kv-cache-dtype int8) is the faster and more accurate one-byte cache on a CPU"
                if cache.k.dtype == torch.float8_e4m3fn else "")
        return ("the KV cache is not one the cpp kernel reads and the loop writes: the model's dtype, a float32 "
                "model's bfloat16 or float16, or int8 with a scale per token" + hint)
    tensors = [model.model.embed_tokens.weight, model.model.norm.weight, model.model.rotary.cos,
               model.model.rotary.sin] + [p for layer in layers for p in layer.parameters()]
    if any(not t.is_contiguous() or t.dtype != dtype for t in tensors):
        return "a weight is not a contiguous tensor of the model's dtype"
    if cfg.num_heads % cfg.num_kv_heads:
        return "query heads are not a multiple of KV heads"
    return None


def build(model: LlamaForCausalLM, kv_caches: list[PagedKVCache]) -> tuple[OneStreamForward | None, float]:
    """The one-call forward for the model's one-stream steps, if it applies (else None, logged), and the
    seconds its build took."""
    reason = _unsupported(model, kv_caches)
    if reason is not None:
        logger.info("one-stream decode steps run the eager forward: %s", reason)
        return None, 0.0
    start = time.perf_counter()
    try:
        lib = load_library(_SOURCE, {"ELEM": _ELEM[model.model.embed_tokens.weight.dtype]})
    except Exception as e:  # no C++ compiler, ...
        logger.warning("could not compile the one-call decode forward (%s); those steps run eagerly", e)
        return None, time.perf_counter() - start
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pagoda_one_stream_forward.argtypes = [ptr, ptr, i64, ptr, ctypes.c_float, ctypes.c_float, ptr, i64] + \
        [ptr] * 5 + [i64, i64] + [ptr] * 4 + [i64, i64, ptr, ptr, ptr, i64, ptr]
    lib.pagoda_one_stream_forward.restype = ctypes.c_int
    forward = OneStreamForward(model, kv_caches, lib)
    seconds = time.perf_counter() - start
    logger.info("decode steps of up to %s sequences in one C++ call, ready in %.1f s",
                "any number of" if forward.max_rows == sys.maxsize else forward.max_rows, seconds)
    return forward, seconds
