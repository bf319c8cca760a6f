"""`--quantization q4_1`: linear layers with 4-bit weights in Q4_1 blocks (the lm_head 8-bit, Q8_0) and
activations quantized to int8 per block of 32 as each layer runs, in C++ (pagoda/layers/q4_gemm.cpp, which
explains the arithmetic). It is what llama.cpp computes for a Q4_1 GGUF file on a CPU. Where the CPU has AMX
tiles, steps of 20 rows or more (amx_min_rows: prompts, large decode batches) widen the weights to bfloat16 and
round the rows to bfloat16 instead, a more accurate arithmetic (99.1% top-1 agreement with float32 on the default
model against 92.8%) and 1.35-3.0x faster there (BENCHMARKS.md, "AMX tiles for Q4_1"). `--quantization q8_0`:
every linear layer 8-bit Q8_0 weights against the same int8 activations (llama.cpp's arithmetic for a Q8_0 file):
the default model's Q4_1 weights re-quantized to 8 bits, which keeps them close (a Q4_1 block's 16 levels on
Q8_0's 255), so the error is mostly the activations' rounding: 96.3% top-1 agreement with float32 against q4_1's
92.8%, for weights 1.7x q4_1's bytes and 0.27x float32's (BENCHMARKS.md).

The weights: each block of 32 consecutive weights of an output row becomes d * q + m (q in 0..15, d and m
float16), as GGUF's Q4_1 stores them: m is the block's minimum and d its range / 15, both rounded to float16.
A Q4_1 GGUF file's weights, loaded as float32, come back exactly (each such block holds a q = 0 and a q = 15:
llama.cpp quantizes a block's minimum to 0 and its maximum to 15), so for the default model the 4-bit weights
are the file's own; other models' weights are rounded to 4 bits here.

Which layers: every nn.Linear of the decoder layers whose input width is a multiple of 32 and output width a
multiple of 16, float32 models only. The output projection (lm_head) gets Q8_0 weights instead (8 bits, d per
block of 32), against the same int8 activations: in the default model it is the token embedding, stored as Q8_0
in the file (so again the file's own weights, bit for bit), and llama.cpp runs it so; 4 bits would add error
where the file has none. The float32 copies of the decoder layers' weights are freed (the default model: 405
MiB of float32 weights for 63 MiB packed), and the lm_head's: where it is the token embedding too, only if its
Q8_0 records hold it exactly (the default model's, Q8_0 in the file), the embedding then reading its rows from them
(tied_embedding.py: 108 MiB less); otherwise it stays, for the embedding (+29 MiB packed).

The packed weights keep the file's bytes a weight (0.625 for Q4_1, 1.0625 for Q8_0: d and m float16), in one
record per 16 output columns and block of 32 (q, then the scales): a thread's tiles are one contiguous stream.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from pagoda.layers.cpp_build import load_library
from pagoda.layers.tied_embedding import Q8_0, free_weight, tie_to_packed, tied_embeddings

logger = logging.getLogger(__name__)

QK = 32  # weights and activations are quantized in blocks of QK along the input dimension
NR = 16  # output columns per packed tile

_SOURCE = Path(__file__).with_name("q4_gemm.cpp")


@functools.cache
def q4_library(portable: bool = False, rev: str | None = None, no_vnni: bool = False, no_amx: bool = False,
               row_split_min_rows: int | None = None) -> Any:
    """The compiled kernels; portable: the plain C++ sums, without AVX2 intrinsics (tests compare the two); rev:
    the kernels as of that git revision (`bench.q4_linear --versus-rev`); no_vnni: the AVX2 instructions even
    where AVX-512 VNNI is (tests compare the two); no_amx: the VNNI tiles even where AMX is (the same);
    row_split_min_rows: from how many rows the AMX tiles' threads split a call's rows rather than its weight tiles
    (q4_gemm.cpp's ROW_SPLIT_MIN_ROWS, tests compare the two)."""
    defines = ({"PORTABLE": 1} if portable else {}) | ({"NO_VNNI": 1} if no_vnni else {}) | (
        {"NO_AMX": 1} if no_amx else {}) | (
        {} if row_split_min_rows is None else {"ROW_SPLIT_MIN_ROWS": row_split_min_rows})
    lib = load_library(_SOURCE, defines, rev=rev)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pagoda_q8_quantize.argtypes = [ptr] * 4 + [i64] * 2
    lib.pagoda_q8_quantize.restype = None
    lib.pagoda_q4_linear.argtypes = [ptr] * 4 + [i64] * 3
    lib.pagoda_q4_linear.restype = None
    for name in ("pagoda_q4_linear_silu_mul", "pagoda_q8_linear_silu_mul"):
        if rev is None or hasattr(lib, name):  # revisions before them lack them
            getattr(lib, name).argtypes = [ptr] * 4 + [i64] * 3
            getattr(lib, name).restype = None
    if rev is None or hasattr(lib, "pagoda_packed_mlp"):
        lib.pagoda_packed_mlp.argtypes = [ptr] * 4 + [i64] * 4
        lib.pagoda_packed_mlp.restype = None
    if rev is None or hasattr(lib, "pagoda_norm_linear"):
        lib.pagoda_norm_linear.argtypes = [ptr] * 3 + [ctypes.c_float] + [ptr] * 3 + [i64] * 4
        lib.pagoda_norm_linear.restype = None
        lib.pagoda_norm_mlp.argtypes = [ptr] * 3 + [ctypes.c_float] + [ptr] * 3 + [i64] * 4
        lib.pagoda_norm_mlp.restype = None
    lib.pagoda_q8_linear.argtypes = [ptr] * 4 + [i64] * 3
    lib.pagoda_q8_linear.restype = None
    lib.pagoda_q4_vectorized.restype = ctypes.c_int
    if hasattr(lib, "pagoda_q4_amx"):  # revisions before it lack it
        lib.pagoda_q4_amx.restype = ctypes.c_int
        lib.pagoda_q4_amx_min_rows.restype = ctypes.c_int64
    return lib


def amx_min_rows(lib: Any) -> int:
    """The fewest rows of a call that the library's Q4_1 kernel runs on AMX tiles in bfloat16 (q4_gemm.cpp, q4amx),
    or 0 where it never does (no AMX, a build without it, or the OS refusing the process its tile data)."""
    if not hasattr(lib, "pagoda_q4_amx") or not lib.pagoda_q4_amx():
        return 0
    return int(lib.pagoda_q4_amx_min_rows())


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) weights -> q (N, K) uint8 in 0..15, d and m (N, K / QK) float32 holding float16 values, with
    weight ~ d * q + m per block (exactly, for weights dequantized from Q4_1)."""
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"Q4_1 needs an input width that is a multiple of {QK}, got {k}")
    blocks = weight.detach().float().reshape(n, k // QK, QK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
        raise ValueError("Q4_1: a weight block's minimum or range does not fit float16")
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = ((blocks - m[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), d, m


def dequantize_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (d[..., None] * q.reshape(n, k // QK, QK).float() + m[..., None]).reshape(n, k)


def _scale_bytes(s: torch.Tensor, tiles: int, nb: int) -> torch.Tensor:
    """(N, K / QK) float32 scales holding float16 values -> (N / NR, K / QK, 2 NR) bytes: each tile's NR columns'
    float16 per block."""
    return s.reshape(tiles, NR, nb).transpose(1, 2).contiguous().half().view(torch.uint8)


def pack_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The layout pagoda_q4_linear reads (q4_gemm.cpp): (N / NR, K / QK, 320) bytes, per tile and block the 256
    bytes of q, then the tile's 16 d and 16 m as float16."""
    n, k = q.shape
    if n % NR:
        raise ValueError(f"the packed Q4_1 layout needs an output width that is a multiple of {NR}, got {n}")
    tiles, nb = n // NR, k // QK
    # q[n = 16 t + 8 h + c][k = 32 b + 16 nibble + 4 p + i] -> (t, b, p, h, c, i, nibble)
    g = q.reshape(tiles, NR // 8, 8, nb, 2, 4, 4).permute(0, 3, 5, 1, 2, 6, 4)
    packed = (g[..., 0] | (g[..., 1] << 4)).contiguous().reshape(tiles, nb, NR * QK // 2)
    return torch.cat([packed, _scale_bytes(d, tiles, nb), _scale_bytes(m, tiles, nb)], dim=-1)


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) weights -> q (N, K) int8 in -127..127 and d (N, K / QK) float32 holding float16 values, weight ~ d * q
    per block, d = max |w| / 127 as GGUF's Q8_0 (exactly, for weights dequantized from Q8_0: a block's largest
    |q| is 127 there)."""
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"Q8_0 needs an input width that is a multiple of {QK}, got {k}")
    blocks = weight.detach().float().reshape(n, k // QK, QK)
    d = (blocks.abs().amax(-1) / 127).half().float()
    if not torch.isfinite(d).all():
        raise ValueError("Q8_0: a weight block's scale does not fit float16")
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = (blocks * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k), d


def pack_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The layout pagoda_q8_linear reads (q4_gemm.cpp): (N / NR, K / QK, 544) bytes, per tile and block the 512
    bytes of q, then the tile's 16 d as float16."""
    n, k = q.shape
    if n % NR:
        raise ValueError(f"the packed Q8_0 layout needs an output width that is a multiple of {NR}, got {n}")
    tiles, nb = n // NR, k // QK
    # q[n = 16 t + 8 h + c][k = 32 b + 4 g + i] -> (t, b, g, h, c, i)
    packed = q.reshape(tiles, NR // 8, 8, nb, 8, 4).permute(0, 3, 4, 1, 2, 5).contiguous().view(torch.uint8)
    return torch.cat([packed.reshape(tiles, nb, NR * QK), _scale_bytes(d, tiles, nb)], dim=-1)


def q8_0_rows(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows ids (output columns) of the weight pack_q8_0 packed, as float32 d * q: (*ids.shape, k)."""
    tiles, nb, _ = packed.shape
    q = packed[..., :NR * QK].view(torch.int8).view(tiles, nb, QK // 4, NR // 8, 8, 4)  # (t, b, g, h, c, i)
    d = packed[..., NR * QK:].view(torch.float16)  # (t, b, column)
    col = ids % NR
    rows = q[ids // NR, :, :, col // 8, col % 8].flatten(-2)  # (*ids.shape, b, 32)
    return (d[ids // NR, :, col].float()[..., None] * rows.float()).flatten(-2)[..., :k]


# Steps of at least this many rows take a packed gate_up projection fused with SiLU-and-multiply (PackedLinear.silu_mul)
# in the eager MLP: it saves writing the (rows, 2I) projection and reading it back, which pays where that output
# leaves the caches (per call, at 512-2,048 rows of the default model 1.06-1.07x as fast as the projection and then
# the elementwise op; at 1-256 rows within the noise). Decode-sized steps keep the two calls: with the fused loop,
# which alternates between the gate's and the up's weights, one stream's decode steps ran 1.01-1.05x slower and 128
# sequences' 1.01x (an ad hoc `bench.decode_step --versus` switching it off, alternated in one process;
# BENCHMARKS.md, "What bounds the Q4_1 tile"), so the one-call forward does not take it either.
SILU_MUL_FUSED_MIN_ROWS = 256

# Rows of a weight quantized and packed at a time (PackedLinear): a multiple of NR.
PACK_ROWS = 1024


class PackedLinear:
    """A linear layer's packed weights (Q4Linear, Q8Linear) and the forward that rounds its input and multiplies,
    in one C++ call. Subclasses name how to pack (`_pack`: float weight -> bytes) and the kernel that reads the
    bytes (`_kernel`: both take x, w, bias, y, M, N, K)."""

    _kernel: str
    # the kernel fused with the SiLU-and-multiply of the output's halves (a gate_up projection's)
    _silu_mul_kernel: str | None = None

    @staticmethod
    def _pack(weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib: Any) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.w = self._pack_by_rows(weight)  # one byte tensor, as the kernel reads it
        self.kernel = getattr(lib, self._kernel)  # the ctypes function (one_stream.py calls it from C++)
        # the gate_up form, where the halves are whole tiles (and the library has it: a past revision's may not)
        fusable = self._silu_mul_kernel is not None and self.out_features % (2 * NR) == 0
        self.silu_mul_kernel = getattr(lib, self._silu_mul_kernel, None) if fusable else None  # type: ignore[arg-type]
        self.lib = lib
        self.amx_rows = amx_min_rows(lib)  # the fewest rows the AMX tiles take (0: none here)

    @classmethod
    def _pack_by_rows(cls, weight: torch.Tensor) -> torch.Tensor:
        """_pack(weight), PACK_ROWS rows at a time into one tensor (each row's blocks are its own, a tile NR rows), so
        that quantizing's float temporaries stay small: the default lm_head's at once had lifted the start-up's peak
        from 637 to 920 MiB (q4_1), 4,096 rows at a time into a list and then one tensor to 775 (ad hoc)."""
        n = weight.shape[0]
        first = cls._pack(weight[:PACK_ROWS])
        if n <= PACK_ROWS:
            return first
        out = torch.empty((n // NR, *first.shape[1:]), dtype=first.dtype)  # the chunks' _pack checks n % NR
        out[:len(first)] = first
        for s in range(PACK_ROWS, n, PACK_ROWS):
            out[s // NR:(s + PACK_ROWS) // NR] = cls._pack(weight[s:s + PACK_ROWS])
        return out

    def nbytes(self) -> int:
        return self.w.numel()  # bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(self.kernel, x, self.out_features)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this layer's output (..., out_features) cut in halves (gate, up), in one call: the same
        float32 bits as the layer's output through ElementwiseOps.silu_mul, without the full output in memory."""
        if self.silu_mul_kernel is None:
            raise ValueError(f"{type(self).__name__} of {self.out_features} outputs has no fused SiLU-and-multiply")
        return self._run(self.silu_mul_kernel, x, self.out_features // 2)

    def fuses_mlp_with(self, down: PackedLinear | None) -> bool:
        """Whether mlp(x, down) serves this gate_up layer and that down layer: the same packing, no biases, and a
        library that has the call."""
        return (down is not None and type(down) is type(self) and self.silu_mul_kernel is not None
                and self.bias is None and down.bias is None and down.in_features == self.out_features // 2
                and down.out_features == self.in_features and hasattr(self.lib, "pagoda_packed_mlp"))

    def mlp(self, x: torch.Tensor, down: PackedLinear) -> torch.Tensor:
        """down(silu(gate) * up) of this gate_up layer's output, in one call (pagoda_packed_mlp): the same float32
        bits as down(self.silu_mul(x)); where the AMX tiles take the step, the intermediate never leaves bfloat16,
        elsewhere it goes to the down pass as the int8 blocks its SiLU's pass rounds (1.01-1.09x the two calls at
        16-2,048 rows on the Zen 4 machine, `bench.q4_linear --fused`)."""
        if not self.fuses_mlp_with(down):
            raise ValueError(f"{type(self).__name__} cannot run an MLP with {type(down).__name__}")
        x2, y = self._input(x, self.in_features)
        if x2.shape[0]:
            self.lib.pagoda_packed_mlp(x2.data_ptr(), self.w.data_ptr(), down.w.data_ptr(), y.data_ptr(),
                                       x2.shape[0], self.in_features, down.in_features, int(isinstance(self, Q8Linear)))
        return y.reshape(*x.shape[:-1], self.in_features)

    def takes_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                   down: PackedLinear | None = None) -> bool:
        """Whether after_norm serves this norm's input (with down: ahead of this gate_up layer's MLP): float32 rows
        (T, in_features) contiguous, a residual alike or None, a float32 norm weight; with down, steps that take the
        MLP in one call anyway (the AMX tiles', or from SILU_MUL_FUSED_MIN_ROWS rows). In one call the norm's pass
        writes the rows the kernel reads (the AMX tiles' bfloat16 ones, elsewhere the int8 blocks) rather than float32
        rows that the kernel's own pass reads back and rounds: on the Zen 4 machine, against the norm's call and then
        the layer's (`bench.q4_linear --fused`), qkv 1.41x at 16 rows, 1.07x at 128, 1.00-1.02x at 512-2,048; the
        MLP 1.01-1.12x (BENCHMARKS.md, "The norm's and the SiLU's passes round the int8 rows")."""
        k, rows = self.in_features, x.shape[0]
        if down is not None and not (rows >= SILU_MUL_FUSED_MIN_ROWS or 0 < self.amx_rows <= rows):
            return False
        return (hasattr(self.lib, "pagoda_norm_linear") and x.dim() == 2 and x.shape[1] == k
                and x.dtype == torch.float32 and x.is_contiguous()
                and weight.dtype == torch.float32 and weight.is_contiguous() and weight.shape == (k,)
                and (residual is None or (residual.dtype == torch.float32 and residual.is_contiguous()
                                          and residual.shape == x.shape)))

    def after_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                   down: PackedLinear | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(weight * rms_norm(h)), h), h = residual + x (residual updated in place) or x when residual is None,
        in one call (pagoda_norm_linear): the same float32 bits as ElementwiseOps.add_rms_norm (its C++ path) and
        then this layer. With down: this gate_up layer's MLP, (self.mlp(normed, down), h) (pagoda_norm_mlp).
        takes_norm(x, residual, weight) must hold."""
        y = torch.empty((x.shape[0], self.in_features if down is not None else self.out_features),
                        dtype=torch.float32)
        res = None if residual is None else residual.data_ptr()
        q8 = int(isinstance(self, Q8Linear))
        if down is not None:
            if not self.fuses_mlp_with(down):
                raise ValueError(f"{type(self).__name__} cannot run an MLP with {type(down).__name__}")
            self.lib.pagoda_norm_mlp(x.data_ptr(), res, weight.data_ptr(), eps, self.w.data_ptr(), down.w.data_ptr(),
                                     y.data_ptr(), x.shape[0], self.in_features, down.in_features, q8)
        else:
            self.lib.pagoda_norm_linear(x.data_ptr(), res, weight.data_ptr(), eps, self.w.data_ptr(),
                                        None if self.bias is None else self.bias.data_ptr(), y.data_ptr(), x.shape[0],
                                        self.out_features, self.in_features, q8)
        return y, x if residual is None else residual

    def _input(self, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x as (rows, in_features) contiguous float32, and an empty float32 output of (rows, width)."""
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        return x2, torch.empty((x2.shape[0], width), dtype=torch.float32)

    def _run(self, kernel: Any, x: torch.Tensor, width: int) -> torch.Tensor:
        x2, y = self._input(x, width)
        if x2.shape[0]:
            kernel(x2.data_ptr(), self.w.data_ptr(), None if self.bias is None else self.bias.data_ptr(),
                   y.data_ptr(), x2.shape[0], self.out_features, self.in_features)
        return y.reshape(*x.shape[:-1], width)


class Q8Linear(PackedLinear):
    """Q8_0 weights (the lm_head's, and with `--quantization q8_0` every linear's) against int8 activations."""

    _kernel = "pagoda_q8_linear"
    _silu_mul_kernel = "pagoda_q8_linear_silu_mul"

    @staticmethod
    def _pack(weight: torch.Tensor) -> torch.Tensor:
        return pack_q8_0(*quantize_q8_0(weight))


class Q4Linear(PackedLinear):
    """Q4_1 weights against int8 activations."""

    _kernel = "pagoda_q4_linear"
    _silu_mul_kernel = "pagoda_q4_linear_silu_mul"

    @staticmethod
    def _pack(weight: torch.Tensor) -> torch.Tensor:
        return pack_q4_1(*quantize_q4_1(weight))


def quantizable(layer: nn.Linear) -> bool:
    return layer.weight.dtype == torch.float32 and layer.in_features % QK == 0 and layer.out_features % NR == 0


# ModelConfig.quantization's schemes (config.QUANTIZATIONS less "none") -> the decoder layers' packed form
SCHEMES: dict[str, type[PackedLinear]] = {"q4_1": Q4Linear, "q8_0": Q8Linear}


def quantize_linears(model: nn.Module, scheme: str = "q4_1", portable: bool = False,
                     freed: Callable[[int], None] | None = None, only: str | None = None) -> tuple[int, int, float]:
    """Give the decoder layers' float32 linears (quantizable) packed weights of the scheme, Q4_1 (4 bits) or Q8_0
    (8 bits), and the lm_head Q8_0 weights in both, and free their float copies, except one that another module
    shares: a tied lm_head's stays for the token embedding unless its Q8_0 records hold it exactly (then the
    embedding reads its rows from them, tied_embedding.py); returns (layers quantized, bytes of their packed
    weights, seconds taken, compile included); freed, if given, is told the bytes of each float weight freed (the
    engine hands the heap back as they add up). only: the name of the one module to quantize (the engine's
    load_model hook, as each layer's weights are loaded); layers already quantized are left alone. Raises if the
    kernels cannot be compiled: the user asked for this format, and a silent float32 fallback would report the
    wrong numbers."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization scheme must be one of {', '.join(SCHEMES)}; got {scheme!r}")
    start = time.perf_counter()
    lib = q4_library(portable)
    if only is None and not lib.pagoda_q4_vectorized():
        logger.warning("quantization %s: this CPU has no AVX2 and F16C (or the portable build was asked for); "
                       "the kernels run as plain C++, far slower than float32 matmuls", scheme)
    count, total = 0, 0
    layers = [(only, model.get_submodule(only))] if only is not None else list(model.named_modules())
    for name, layer in layers:
        if not isinstance(layer, nn.Linear) or is_quantized(layer) or not quantizable(layer):
            continue
        lm_head = name.endswith("lm_head")
        packed = (Q8Linear if lm_head else SCHEMES[scheme])(layer.weight, layer.bias, lib)
        layer._pagoda_packed_linear = packed  # type: ignore[assignment]
        layer.forward = packed  # type: ignore[method-assign,assignment]
        total += packed.nbytes()
        embeddings, nbytes = tied_embeddings(model, layer), 0  # nbytes: the float weight's, where freed
        if embeddings == []:  # nothing else holds it: the float copy is not read again
            nbytes = free_weight(layer)
        elif embeddings and lm_head and _holds_exactly(packed.w, layer.weight):
            # a tied lm_head whose weight was Q8_0 already (the default model's, from its file): the embedding reads
            # its rows from the records
            nbytes = tie_to_packed(layer, embeddings, functools.partial(_records, packed), q8_0_rows, Q8_0)
        if freed is not None:
            freed(nbytes)
        count += 1
    return count, total, time.perf_counter() - start


def _holds_exactly(records: torch.Tensor, weight: torch.Tensor, rows: int = 4096) -> bool:
    """Whether Q8_0 records (pack_q8_0) give the weight's values exactly; read rows at a time (the whole default
    lm_head at once had quantize_linears's phase peak at 1,303-1,412 MiB against 1,114-1,221 without it, ad hoc)."""
    n, k = weight.shape
    return all(torch.equal(q8_0_rows(records, torch.arange(s, min(n, s + rows)), k), weight[s:s + rows])
               for s in range(0, n, rows))


def _records(packed: PackedLinear) -> torch.Tensor:
    return packed.w  # at the call: move_weights_to_huge_pages replaces it


def packed_of(layer: nn.Module) -> PackedLinear | None:
    """The layer's packed form (Q4Linear or Q8Linear), if quantize_linears gave it one."""
    packed: PackedLinear | None = getattr(layer, "_pagoda_packed_linear", None)
    return packed


def is_quantized(layer: nn.Module) -> bool:
    """The layer runs packed Q4_1 or Q8_0 weights (quantize_linears)."""
    return packed_of(layer) is not None


def weight_bytes(layer: nn.Linear) -> int:
    """The bytes a step reads for the layer's weights: packed Q4_1 or Q8_0 (with scales), or in_features x
    out_features of the weight's dtype (whose plain tensor prepack_linears may have freed)."""
    packed = packed_of(layer)
    if packed is not None:
        return packed.nbytes()
    return layer.in_features * layer.out_features * layer.weight.element_size()
