"""Linear layers on packed weights for batched steps (`--prepack-weights`; by default for float32 and bfloat16
models whose packing adds at most PREPACK_AUTO_MAX_BYTES), and a GEMV for steps of a few rows.

Float32: weights packed in panels for a tile kernel of our own (`f32_tiles.cpp`), which takes every step of a
float32 layer, one stream's included. Against oneDNN's matmul on its own packed weights (what these layers ran
before, 2026-12-06): a decode step's linears 1.03-1.49x faster at 8-256 rows, the decoder's shapes 1.00-1.06x at
2,048 (`python -m pagoda.bench.f32_tiles`); at 1-4 rows it streams the weights as fast as a read of them, 1.03-1.7x
the GEMV below (ad hoc). And, a plain C function, it lets a float32 model's decode steps of any batch run in one C++
call (pagoda/model/one_stream.py). The float32 128-request workload ran 1.023-1.045x faster end to end
(`bench.alternate`, Zen 4; BENCHMARKS.md, "Float32 linears on tiles of our own"). Where the kernel cannot be built
(logged), float32 weights are packed for oneDNN as bfloat16 ones are.

bfloat16, where the build has AVX-512: the same tiles over weights packed in pairs of k, one `vdpbf16ps` for both
products of a pair where the CPU has AVX-512 BF16, two float32 multiply-adds elsewhere (`pagoda_bf16_tiles_linear`),
every step, one stream's included. On the Zen 4 machine (`python -m pagoda.bench.f32_tiles --dtype bfloat16`;
BENCHMARKS.md, "The tiles replace the plain weights; bfloat16 linears on the tiles"): a decode step's linears 1.02x
the GEMV at 1 row, 1.16-1.47x the best of the GEMV and oneDNN at 4-256 rows, the decoder's shapes 1.02-1.04x
oneDNN's packed weight at 2,048 rows (443-456 GFLOP/s, ~97% of `vdpbf16ps`'s rate there); the bfloat16 128-request
workload 1.10-1.15x faster end to end. The widening path of an AVX-512 build: 1.7-4.0x F.linear at 4-2,048 rows,
faster than the GEMV at 1 row (f32_tiles.cpp has the figures). Not AVX2 builds, where the tiles lost to the GEMV at
1-4 rows (pagoda_bf16_tiles_enabled), nor where the kernels cannot be built: there bfloat16 weights get oneDNN's
packing where oneDNN packs bfloat16 (AVX-512 CPUs; on AVX2 ones they stay plain, the GEMV and F.linear), its
weights reordered once into its blocked layout, against F.linear on the plain weight (`python -m
pagoda.bench.linear_stream --dtype bfloat16`, one step's matmuls, BENCHMARKS.md): 1.08-1.73x at 1-1,024 rows, but
0.61x at 2,048 (a full prompt-chunk step, Xeon); so the packed weight serves PACKED_ROWS[dtype], the plain one the
rest. (Float32 on oneDNN's packing, for the fallback: 1.30-1.56x F.linear at 4-32 rows, 0.90x at 1-2.)

Memory: a layer's tiles replace its plain weight, which is freed (an empty tensor stays, for code that looks at
dtypes, as with --quantization). A tied lm_head's weight is the embedding's rows: the embedding is then replaced by
a TiedEmbedding (tied_embedding.py), which reads its rows from the lm_head's tiles (row n is the lm_head's output
n), so that weight is freed too (the default model: 108 MiB in float32, 54 in bfloat16); a weight that anything
else shares stays. A layer on oneDNN's packing keeps its plain weight next to it, for the GEMV and for steps beyond
PACKED_ROWS: twice the weight memory. Results differ from F.linear by float rounding only.
Not combined with --compile-model, whose graph would have to branch on the token count.

For one stream (1-GEMV_MAX_ROWS rows) of a bfloat16 model, oneDNN packed or not reads the weights at about
a third of the memory's speed; a GEMV of our own (`gemv.cpp`, enabled with the fused ops) streams them
instead, and takes those steps before the packed weight (and a float32 layer's where it has no tiles:
--no-prepack-weights). Beyond the GEMV's rows, a float32 layer without tiles goes to oneDNN on its plain weight
(ONEDNN_FLOAT32).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.cpp_build import load_library
from pagoda.layers.q4_linear import is_quantized
from pagoda.layers.tied_embedding import TILES, tie_to_packed, tied_embeddings

logger = logging.getLogger(__name__)

# rows (tokens in the step) that use oneDNN's packed weight, per weight dtype; measured, see above. Float32 (where the
# tiles cannot be built) from 3 rows up: on the Zen 4 machine it was 1.16-1.17x the plain weight at 128 rows,
# 1.04-1.13x at 192-512, 1.045x on the decoder's linears at 2,048 (BENCHMARKS.md).
PACKED_ROWS: dict[torch.dtype, range] = {torch.float32: range(3, 1 << 62), torch.bfloat16: range(1, 1025)}
# Rows a layer's tiles take (f32_tiles.cpp): every step, before the GEMV, whose rows they stream as fast as a read of
# the weights and, in float32, 1.03-1.7x faster than the GEMV at 1-4 rows (ad hoc, one step's 120 linears in turn,
# Zen 4); in bfloat16 1.02x at 1 row, 1.47x at 4 (`bench.f32_tiles --dtype bfloat16 --step`)
TILE_ROWS = range(1, 1 << 62)
TILE_DTYPES = (torch.float32, torch.bfloat16)


# Rows (tokens in the step) that bfloat16 and float32 linears give to the C++ GEMV (gemv.cpp) once enable_gemv
# built it: in bfloat16 one step's matmuls 1.51-1.74x faster than oneDNN's packed weights at 1-4 rows
# (`bench.linear_stream`, BENCHMARKS.md); in float32 0.93-1.04x F.linear at 1-2 rows, 1.12-1.41x the better of
# F.linear and the packed weights at 3-4. A variant for 5-8 rows (two weight rows at a time) was no better than
# the packed weights there (ad hoc), so the GEMV stops at 4.
GEMV_MAX_ROWS = 4
GEMV_DTYPES = (torch.bfloat16, torch.float32)

# Float32 linears beyond the GEMV's rows that have no packed weight go to oneDNN's matmul on the plain weight, not
# F.linear (MKL's sgemm): on the AVX2 machine (an AMD CPU, where MKL's sgemm ran at 20-90 GFLOP/s on these
# shapes) oneDNN was 1.22-1.63x faster on the fused gate/up projection at 8-2,048 rows and 1.65-1.99x on the
# lm_head (576 -> 49,152) at 8-512 rows, within 0.9-1.3x on the others; float32 decode steps of 16 and 64
# requests ran 1.19x and 1.16x faster (alternated in one process, ad hoc; BENCHMARKS.md). Its sums run in
# another order: results differ from F.linear's by float32 rounding (~1e-4 on outputs of ~20).
ONEDNN_FLOAT32 = True


def _forward(layer: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """The forward of a linear with the paths this module adds, each taken where it applies: its tiles
    (layer._pagoda_tiles, set by prepack_linears) for any rows, the C++ GEMV (layer._pagoda_gemv, set by
    enable_gemv) for 1-GEMV_MAX_ROWS rows, the oneDNN-packed weight (layer._pagoda_packed, set by prepack_linears)
    for PACKED_ROWS, oneDNN on the plain weight for other float32 steps (ONEDNN_FLOAT32), F.linear otherwise."""
    linear_pointwise = torch.ops.mkldnn._linear_pointwise

    def forward(x: torch.Tensor) -> torch.Tensor:
        tiles = layer._pagoda_tiles
        if tiles is not None:  # every input: the plain weight may be gone (prepack_linears)
            tiles_call: Any = layer._pagoda_tiles_call
            return tiles_call(x, tiles, layer.bias)
        rows = x.shape[0] if x.dim() == 2 else 0
        gemv: Any = layer._pagoda_gemv
        if gemv is not None and 1 <= rows <= GEMV_MAX_ROWS and x.dtype == layer.weight.dtype and x.is_contiguous():
            return gemv(x, layer.weight, layer.bias)
        packed = layer._pagoda_packed
        if packed is not None and rows in PACKED_ROWS[layer.weight.dtype]:
            return linear_pointwise(x, packed, layer.bias, "none", [], "")
        if rows and ONEDNN_FLOAT32 and layer.weight.dtype == x.dtype == torch.float32 and x.is_contiguous():
            return linear_pointwise(x, layer.weight, layer.bias, "none", [], "")
        return F.linear(x, layer.weight, layer.bias)

    return forward


def _install(layer: nn.Linear) -> None:
    if "forward" not in vars(layer):
        # plain attributes, found without nn.Module.__getattr__
        layer._pagoda_gemv = layer._pagoda_packed = None  # type: ignore[assignment]
        layer._pagoda_tiles = layer._pagoda_tiles_call = None  # type: ignore[assignment]
        layer.forward = _forward(layer)  # type: ignore[method-assign,assignment]


def is_packed(layer: nn.Module) -> bool:
    """Whether prepack_linears gave the layer a packed copy: tiles or oneDNN's."""
    return tiles_of(layer) is not None or getattr(layer, "_pagoda_packed", None) is not None


def tiles_of(layer: nn.Module) -> torch.Tensor | None:
    """A float32 or bfloat16 layer's weight packed for f32_tiles.cpp (prepack_linears), or None."""
    return getattr(layer, "_pagoda_tiles", None)


def _tiles_or_raise(layer: nn.Module) -> torch.Tensor:
    tiles = tiles_of(layer)
    if tiles is None:
        raise RuntimeError("a tied embedding's linear has lost its tiles")
    return tiles


_GEMV_SOURCE = Path(__file__).with_name("gemv.cpp")


@functools.cache
def _gemv_library(portable: bool = False) -> Any:
    lib = load_library(_GEMV_SOURCE, {"PORTABLE": 1} if portable else {})
    for fn in (lib.pagoda_gemv_bf16, lib.pagoda_gemv_f32):
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        fn.restype = None
    return lib


def gemv_function(lib: Any, dtype: torch.dtype) -> Any:
    """The library's GEMV for weights of dtype (one of GEMV_DTYPES)."""
    return lib.pagoda_gemv_bf16 if dtype == torch.bfloat16 else lib.pagoda_gemv_f32


def _gemv_for(lib: Any) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
    def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
        gemv_function(lib, weight.dtype)(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                         y.data_ptr(), x.shape[0], weight.shape[0], weight.shape[1])
        return y

    return gemv


def enable_gemv(model: nn.Module, portable: bool = False) -> float:
    """Give the model's bfloat16 and float32 linears (contiguous weight and bias of the weight's dtype) the C++
    GEMV for steps of 1-GEMV_MAX_ROWS rows; returns the seconds its build took. If the build fails (logged), they
    keep their other paths."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear) and not is_quantized(m)
              and m.weight.dtype in GEMV_DTYPES and m.weight.is_contiguous()
              and (m.bias is None or (m.bias.dtype == m.weight.dtype and m.bias.is_contiguous()))]
    if not layers:
        return 0.0
    start = time.perf_counter()
    try:
        gemv = _gemv_for(_gemv_library(portable))
    except Exception as e:  # no C++ compiler, ...
        logger.warning("could not compile the GEMV (%s); small steps' linears use oneDNN or F.linear", e)
        return time.perf_counter() - start
    for layer in layers:
        _install(layer)
        layer._pagoda_gemv = gemv  # type: ignore[assignment]
    seconds = time.perf_counter() - start
    logger.info("GEMV for %d-%d-row steps ready in %.1f s", 1, GEMV_MAX_ROWS, seconds)
    return seconds


# `prepack_weights` left to the engine (None) packs float32 and bfloat16 models whose packing adds at most this much
# memory (on the tiles only a tied lm_head's copy: the other plain weights are freed), while larger copies cost more
# memory for a share of the step that was not measured (BENCHMARKS.md). With the default model:
# bfloat16's 128-request workload ran 1.23x and 1.31x faster end to end (+270 MB, Xeon); float32 decode steps of 16
# and 64 requests 1.13x and 1.11x faster than oneDNN on the plain weights (+540 MB; AVX2, `bench.decode_step
# --versus packed-weights`), the packed weights 1.15-1.36x at 8-64 rows (`bench.linear_stream`).
PREPACK_AUTO_MAX_BYTES = 1 << 30


def packable_rows(dtype: torch.dtype) -> range | None:
    """The rows a packed weight of this dtype serves, or None where oneDNN cannot pack it on this CPU (its
    bfloat16 reorder needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT and raises without them)."""
    if not torch.backends.mkldnn.is_available():
        return None
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return PACKED_ROWS.get(dtype)


def should_prepack(model: nn.Module, dtype: torch.dtype, asked: bool | None, compile_model: bool) -> bool:
    """Whether the engine packs the model's linears: as asked, or by default (asked is None) for float32 and
    bfloat16 models whose packing adds at most PREPACK_AUTO_MAX_BYTES of memory, except with compile_model (whose
    graph cannot branch on the token count) and where no layer would be packed (all quantized: q4_1). On the tiles,
    packing adds only the copies of weights that modules other than embeddings share (prepack_linears frees the
    others)."""
    if asked is not None:
        return asked
    if compile_model or dtype not in TILE_DTYPES:  # float64 neither
        return False
    layers = [m for m in model.modules() if _packable(m)]
    lib = _tiles_library_or_none(layers)
    tiled = [m for m in layers if _tiles_fit(m, lib)]
    onednn = [m for m in layers if not _tiles_fit(m, lib) and packable_rows(m.weight.dtype) is not None]
    copies = onednn + [m for m in tiled if tied_embeddings(model, m) is None]
    copy = sum(m.weight.numel() * m.weight.element_size() for m in copies)
    return bool(tiled or onednn) and copy <= PREPACK_AUTO_MAX_BYTES


_TILES_SOURCE = Path(__file__).with_name("f32_tiles.cpp")


@functools.cache
def tiles_library(portable: bool = False) -> Any:
    """f32_tiles.cpp built (raises where it cannot be: no C++ compiler, ...)."""
    lib = load_library(_TILES_SOURCE, {"PORTABLE": 1} if portable else {})
    for fn in (lib.pagoda_f32_tiles_linear, lib.pagoda_bf16_tiles_linear):
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        fn.restype = None
    lib.pagoda_f32_tiles_panel.restype = lib.pagoda_bf16_tiles_enabled.restype = ctypes.c_int64
    return lib


def tiles_function(lib: Any, dtype: torch.dtype) -> Any:
    """The library's tile kernel for weights (and x, y) of dtype: float32 or bfloat16."""
    return lib.pagoda_f32_tiles_linear if dtype == torch.float32 else lib.pagoda_bf16_tiles_linear


def pack_tiles(w: torch.Tensor, panel: int) -> torch.Tensor:
    """w (N, K) as f32_tiles.cpp reads it: float32 as (ceil(N / panel), K, panel), each panel's columns side by side
    for every k; bfloat16 as (ceil(N / panel), ceil(K / 2), panel, 2), each column's pair of k side by side; zeros
    past N (and past K)."""
    n, k = w.shape
    padded = -(-n // panel) * panel
    if w.dtype != torch.float32:  # in pairs of k
        w = F.pad(w, (0, k % 2, 0, padded - n))
        return w.reshape(padded // panel, panel, -1, 2).transpose(1, 2).contiguous()
    if padded != n:
        w = torch.cat([w, w.new_zeros(padded - n, k)])
    return w.reshape(padded // panel, panel, k).transpose(1, 2).contiguous()


def _tiles_call(lib: Any, out_features: int, in_features: int, dtype: torch.dtype = torch.float32
                ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """The packed forward of a float32 or bfloat16 layer on tiles: x (..., K) -> (..., out_features), as F.linear."""
    fn, k = tiles_function(lib, dtype), in_features

    def call(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != dtype or x.shape[-1] != k:
            raise ValueError(f"a {dtype} linear of {k} inputs takes {dtype} x of shape (..., {k}); got {x.dtype} "
                             f"{tuple(x.shape)}")
        lead = x.shape[:-1]
        x = x.reshape(-1, k).contiguous()
        y = torch.empty((x.shape[0], out_features), dtype=dtype)
        if len(x):
            fn(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), len(x),
               out_features, k)
        return y.view(*lead, out_features)

    return call


def _packable(module: nn.Module) -> TypeGuard[nn.Linear]:
    """A float32 or bfloat16 linear that neither --quantization nor an earlier prepack_linears took."""
    return (isinstance(module, nn.Linear) and not is_quantized(module) and not is_packed(module)
            and module.weight.dtype in TILE_DTYPES)


def tiles_take(lib: Any, dtype: torch.dtype) -> bool:
    """Whether the engine runs weights of dtype on lib's tile kernels (None: not built): float32, and bfloat16 where
    the build has 512-bit vectors (pagoda_bf16_tiles_enabled: on AVX2 they lost to the GEMV)."""
    return lib is not None and (dtype == torch.float32 or (dtype == torch.bfloat16
                                                           and bool(lib.pagoda_bf16_tiles_enabled())))


def _tiles_fit(layer: nn.Linear, lib: Any) -> bool:
    """Whether lib's tile kernels take the layer: its weight's dtype (tiles_take) and a bias of that dtype if any."""
    w, bias = layer.weight, layer.bias
    return tiles_take(lib, w.dtype) and (bias is None or (bias.dtype == w.dtype and bias.is_contiguous()))


def tile_rows(tiles: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows ids of the (N, k) weight that pack_tiles packed into tiles, as weight[ids] gives them: (*ids.shape, k);
    ids must be in [0, N) (TiedEmbedding checks)."""
    panel = tiles.shape[2]
    grouped = tiles.view(tiles.shape[0], tiles.shape[1], panel, -1)  # float32 one k a column, bfloat16 a pair
    rows = grouped[ids // panel, :, ids % panel]  # (*ids.shape, k or its pairs, 1 or 2)
    return rows.flatten(-2)[..., :k]


def _tiles_library_or_none(layers: list[nn.Linear]) -> Any:
    """tiles_library() if there are layers to pack (_packable) and it can be built (else logged), or None."""
    if not layers:
        return None
    try:
        return tiles_library()
    except Exception as e:  # no C++ compiler, ...
        logger.warning("could not compile the tile kernels (%s); float32 and bfloat16 linears pack for oneDNN", e)
        return None


def prepack_linears(model: nn.Module, tiles: bool = True, keep_plain: bool = False,
                    freed: Callable[[int], None] | None = None, only: str | None = None) -> tuple[int, range | None]:
    """Gives every float32 or bfloat16 nn.Linear of the model a packed copy of its weight; returns the bytes this
    adds to the model's memory (the packed copies less the plain weights freed) and the rows the packed weights
    serve ((0, None) if none was packed). The weights the tile kernels take (_tiles_fit: float32, and bfloat16 in
    AVX-512 builds) are packed in panels for them, which then take every step (TILE_ROWS), and their plain weights
    are freed (an empty tensor of their dtype stays), a tied embedding then reading its rows from the tiles
    (TiedEmbedding), unless a module other than an embedding shares them or keep_plain (for benchmarks that time
    both sides). The others, and all where the kernels cannot be built (logged) or with tiles=False, are packed for
    oneDNN where it packs their dtype on this CPU (packable_rows: for PACKED_ROWS[dtype]), next to the plain weight,
    else left alone. freed, if given, is told the bytes of each plain weight freed (the engine hands the heap back as
    they add up). only: the name of the one module to pack (the engine's load_model hook, as each layer's weights
    are loaded); layers packed already are left alone."""
    added, used = 0, None
    layers = [m for m in ([model.get_submodule(only)] if only is not None else model.modules()) if _packable(m)]
    lib: Any = _tiles_library_or_none(layers) if tiles else None
    for module in layers:
        w = module.weight.detach()
        on_tiles, onednn_rows = _tiles_fit(module, lib), packable_rows(w.dtype)
        if not on_tiles and onednn_rows is None:
            continue  # neither kernel takes it here
        _install(module)
        if on_tiles:
            packed = module._pagoda_tiles = pack_tiles(w, lib.pagoda_f32_tiles_panel())  # type: ignore[assignment]
            module._pagoda_tiles_call = _tiles_call(  # type: ignore[assignment]
                lib, module.out_features, module.in_features, w.dtype)
            used = TILE_ROWS
            embeddings = None if keep_plain else tied_embeddings(model, module)
            if embeddings is not None:
                nbytes = tie_to_packed(module, embeddings, functools.partial(_tiles_or_raise, module), tile_rows,
                                       TILES)
                added -= nbytes
                if freed is not None:
                    freed(nbytes)
        else:
            packed = module._pagoda_packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)  # type: ignore[assignment]
            used = onednn_rows
        added += packed.numel() * packed.element_size()
    return added, used
