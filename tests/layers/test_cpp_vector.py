"""pagoda/layers/cpp_vector.h at every vector width the kernels are built for: 16 lanes (AVX-512), 8 (AVX2) and 4
(neither). Each width has its own shuffles, and the kernel tests only build the width this CPU's compiler targets;
the narrower ones are built here by undefining the wider ISAs' macros."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from pagoda.layers.cpp_build import load_library

SHIM = """
extern "C" int64_t lanes() { return L; }
// per vector of x (n of them): fold_max, hmax, fold_sum, hsum
extern "C" void reductions(const float* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    vf v;
    std::memcpy(&v, x + i * L, sizeof(v));
    out[4 * i] = fold_max(v);
    out[4 * i + 1] = hmax(v);
    out[4 * i + 2] = fold_sum(v);
    out[4 * i + 3] = hsum(v);
  }
}
// per L vectors of x (n / L groups): fold_each's maxima, then its sums, one float per vector each
extern "C" void folds_each(const float* x, int64_t n, float* maxima, float* sums) {
  for (int64_t i = 0; i < n; i += L) {
    vf v[L];
    std::memcpy(v, x + i * L, sizeof(v));
    const vf mx = fold_each(v, [](vf a, vf b) { return a > b ? a : b; });
    const vf sm = fold_each(v, [](vf a, vf b) { return a + b; });
    std::memcpy(maxima + i, &mx, sizeof(mx));
    std::memcpy(sums + i, &sm, sizeof(sm));
  }
}
// exp2_neg to degree 7 and 4 of n values (n a multiple of L)
extern "C" void exp2s(const float* x, int64_t n, float* out7, float* out4) {
  for (int64_t i = 0; i < n; i += L) {
    vf v;
    std::memcpy(&v, x + i, sizeof(v));
    const vf a = exp2_neg<7>(v), b = exp2_neg<4>(v);
    std::memcpy(out7 + i, &a, sizeof(a));
    std::memcpy(out4 + i, &b, sizeof(b));
  }
}
"""
NARROWER = {8: ("-U__AVX512F__",), 4: ("-U__AVX512F__", "-U__AVX__", "-U__AVX2__", "-U__F16C__", "-U__FMA__")}


@pytest.mark.parametrize("width", [None, 8, 4])
def test_fold_max_and_sum_at_every_width(width: int | None, tmp_path: Path) -> None:
    """fold_max is hmax exactly and fold_sum is hsum up to the order of the sum, at each lane of the maximum (a
    halving step that skipped or repeated a lane would miss it), with -inf lanes as a masked softmax has them;
    fold_each, L vectors' folds at once, gives vector i's in lane i (a butterfly that put them in another order,
    or mixed two vectors' lanes, would not)."""
    source = tmp_path / "shim.cpp"
    source.write_text(SHIM)
    lib = load_library(source, {}, NARROWER.get(width, ()))  # type: ignore[arg-type]
    lib.lanes.restype = ctypes.c_int64
    lanes = lib.lanes()
    assert width is None or lanes == width
    g = torch.Generator().manual_seed(lanes)
    x = torch.randn(3 * lanes, lanes, generator=g)
    x[torch.arange(lanes), torch.arange(lanes)] = 10.0  # row i's maximum in lane i
    x[lanes:2 * lanes, : lanes // 2] = float("-inf")
    out = torch.empty(x.shape[0], 4)
    lib.reductions(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]), ctypes.c_void_p(out.data_ptr()))
    assert torch.equal(out[:, 0], out[:, 1]) and torch.equal(out[:, 0], x.max(dim=1).values)
    finite = torch.isfinite(out[:, 3])
    torch.testing.assert_close(out[finite, 2], out[finite, 3], rtol=1e-6, atol=1e-5)
    assert torch.equal(out[~finite, 2], out[~finite, 3])  # -inf either way
    maxima, sums = torch.empty(x.shape[0]), torch.empty(x.shape[0])
    lib.folds_each(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]), ctypes.c_void_p(maxima.data_ptr()),
                   ctypes.c_void_p(sums.data_ptr()))
    assert torch.equal(maxima, out[:, 1])
    torch.testing.assert_close(sums[finite], out[finite, 3], rtol=1e-6, atol=1e-5)
    assert torch.equal(sums[~finite], out[~finite, 3])


BUFFER_SHIM = """
// For each size asked in turn: the address's offset from a 64-byte boundary, and whether the address changed; every
// element written (a buffer smaller than asked would show under a sanitizer, and here as a crash at worst).
extern "C" void reserve_in_turn(const int64_t* sizes, int64_t n, int64_t* offsets, int64_t* moved) {
  LineAlignedBuffer<uint16_t> buffer;
  const uint16_t* last = nullptr;
  for (int64_t i = 0; i < n; ++i) {
    uint16_t* p = buffer.reserve(sizes[i]);
    for (int64_t j = 0; j < sizes[i]; ++j) p[j] = uint16_t(j);
    offsets[i] = int64_t(reinterpret_cast<uintptr_t>(p) % 64);
    moved[i] = p != last;
    last = p;
  }
}
"""


def test_line_aligned_buffer_starts_on_a_line_and_grows_only_when_asked_for_more(tmp_path: Path) -> None:
    """The q4amx tiles' scratch (LineAlignedBuffer) starts on a 64-byte boundary at every size, the sizes that are
    not a multiple of the line included (std::vector's 16-byte-aligned memory is what it replaced), and keeps its
    memory when asked for no more than it has."""
    source = tmp_path / "buffer_shim.cpp"
    source.write_text(BUFFER_SHIM)
    lib = load_library(source, {})
    sizes = torch.tensor([1, 7, 33, 5000, 100, 5000, 5001, 3, 1 << 20], dtype=torch.int64)
    offsets, moved = torch.full_like(sizes, -1), torch.full_like(sizes, -1)
    lib.reserve_in_turn(ctypes.c_void_p(sizes.data_ptr()), ctypes.c_int64(len(sizes)),
                        ctypes.c_void_p(offsets.data_ptr()), ctypes.c_void_p(moved.data_ptr()))
    assert offsets.tolist() == [0] * len(sizes)
    # asked for no more than the largest size so far: the same memory (a grown buffer may land at the same address)
    kept = [i for i in range(1, len(sizes)) if sizes[i] <= sizes[:i].max()]
    assert kept == [4, 5, 7] and moved[kept].tolist() == [0, 0, 0]


def test_exp2_neg_is_the_same_bits_at_every_width(tmp_path: Path) -> None:
    """exp2_neg has its own AVX-512 form (round to an integer and `vscalefps`, four vector instructions fewer than the
    exponent-field arithmetic the narrower widths run); it gives AVX2's bits for every x <= 0, the clamp at -126
    and the results below float32's normal range included, NaN stays NaN, and stays within 2^-20 (degree 7)
    of 2^x."""
    source = tmp_path / "shim.cpp"
    source.write_text(SHIM)
    x = torch.cat([-torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 140.0,
                   torch.tensor([0.0, -0.5, -1.5, -2.5, -125.5, -126.0, -126.5, -127.0, -149.0, -200.0, -1e30,
                                 -float("inf")])])
    x = torch.cat([x, torch.zeros((-len(x)) % 16)])
    def exp2s(lib: ctypes.CDLL, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out7, out4 = torch.empty_like(v), torch.empty_like(v)
        lib.exp2s(ctypes.c_void_p(v.data_ptr()), ctypes.c_int64(len(v)), ctypes.c_void_p(out7.data_ptr()),
                  ctypes.c_void_p(out4.data_ptr()))
        return out7, out4

    widths = (None, 8, 4)
    libs = {width: load_library(source, {}, NARROWER.get(width, ())) for width in widths}  # type: ignore[arg-type]
    results = {width: exp2s(lib, x) for width, lib in libs.items()}
    # AVX2's 8 lanes have the same fused multiply-adds; the 4-lane build (no FMA) rounds each product apart
    assert torch.equal(results[None][0], results[8][0]) and torch.equal(results[None][1], results[8][1])
    for lib in libs.values():  # a NaN (a broken score) stays NaN, not a weight of 2^-126
        assert all(out.isnan().all() for out in exp2s(lib, torch.full((16,), float("nan"))))
    exact = torch.exp2(x.double().clamp(min=-126.0))
    for width in (None, 4):
        assert ((results[width][0].double() - exact).abs() <= exact * 2**-20).all()
