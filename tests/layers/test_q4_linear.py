"""`--quantization q4_1` and `q8_0` (pagoda/layers/q4_linear.py, q4_gemm.cpp): the weight formats, the activation
rounding, the kernels against a float64 reference of the same arithmetic, and the default model's Q4_1 weights
coming back exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pagoda.layers import linear, q4_linear
from pagoda.layers.q4_linear import QK, Q4Linear, Q8Linear, dequantize_q4_1, quantize_q4_1, quantize_q8_0


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (d[..., None] * q.reshape(n, k // QK, QK).float()).reshape(n, k)


def q8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The activation rounding of q4_gemm.cpp in torch ops: per block of 32, xq = round(x * (127 / max |x|)) with
    ties to even, dx = max |x| / 127, sx = the block's sum. 127 / max |x| is one float32 division, as the kernel's:
    torch computes `127.0 / tensor` as a reciprocal times 127, rounded twice, which can put x * inv one ulp off a
    tie and round it the other way (test_activation_rounding_matches_torch has such a block)."""
    blocks = x.reshape(x.shape[0], -1, QK)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (blocks * inv[..., None]).round().to(torch.int8).reshape(x.shape), amax / 127.0, blocks.sum(-1)


def reference_linear(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """sum over blocks of d * dx * sum(q xq) + m * sx, in float64 (the integer sums are exact)."""
    xq, dx, sx = q8_reference(x)
    n, k = q.shape
    isum = torch.einsum("mbk,nbk->mnb", xq.reshape(x.shape[0], -1, QK).double(), q.reshape(n, -1, QK).double())
    y = (isum * d.double()[None] * dx.double()[:, None] + m.double()[None] * sx.double()[:, None]).sum(-1)
    return y if bias is None else y + bias.double()


def reference_bf16_linear(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """The AMX tiles' arithmetic (steps of amx_min_rows rows or more where the CPU has AMX): x and the weights, Q4_1's
    d * q + m or Q8_0's d * q (m None), rounded to bfloat16, their products summed in float64."""
    w = (dequantize_q4_1(q, d, m) if m is not None else dequantize_q8_0(q, d)).bfloat16().double()
    y = x.bfloat16().double() @ w.T
    return y if bias is None else y + bias.double()


def reference_q8_linear(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Q8_0 weights: sum over blocks of d * dx * sum(q xq), in float64."""
    xq, dx, _ = q8_reference(x)
    n, k = q.shape
    isum = torch.einsum("mbk,nbk->mnb", xq.reshape(x.shape[0], -1, QK).double(), q.reshape(n, -1, QK).double())
    y = (isum * d.double()[None] * dx.double()[:, None]).sum(-1)
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("portable", [False, True])
def test_activation_rounding_matches_torch(portable: bool) -> None:
    """xq bit for bit (ties included: some values sit exactly on .5 after scaling), dx exactly, sx within float32
    rounding of the sum (another order); an all-zero block gives zeros."""
    lib = q4_linear.q4_library(portable)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 4 * QK, generator=g)
    x[0, :QK] = 0.0
    x[1, :QK] = torch.arange(QK) - 15.5  # max 16.5: 127 / 16.5 * 0.5 ... puts values near ties
    x[2, :QK] = (torch.arange(QK) - 16) * (127.0 / 254.0)  # x * 127 / max lands on k + 0.5 for odd k
    # x * (127 / max) is -51.5 exactly (-52, ties to even); with 127 / max as reciprocal times 127, -51.499996
    x[3, :QK] = 0.0
    x[3, 0], x[3, 1] = float.fromhex("0x1.2432120000000p+1"), float.fromhex("-0x1.d9f47e0000000p-1")
    xq = torch.empty(x.shape, dtype=torch.int8)
    dx = torch.empty(x.shape[0], x.shape[1] // QK)
    sx = torch.empty_like(dx)
    lib.pagoda_q8_quantize(x.data_ptr(), xq.data_ptr(), dx.data_ptr(), sx.data_ptr(), x.shape[0], x.shape[1])
    want_q, want_d, want_s = q8_reference(x)
    assert torch.equal(xq, want_q)
    assert torch.equal(dx, want_d)
    torch.testing.assert_close(sx, want_s, rtol=1e-6, atol=1e-5)
    assert not xq[0, :QK].any() and (dx[0, 0] == 0)
    assert xq[3, 1] == -52


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (48, 1536), (960, 64), (16, 32)])
def test_kernel_matches_float64_reference(portable: bool, n: int, k: int) -> None:
    """1-7 and 40 rows (full groups of 3 or 4 rows, by the build, and each tail), with and without bias, the
    vectorized build (AVX2, or AVX-512 VNNI where the CPU has it; without the AMX tiles, which have a test and a
    reference of their own) and the plain C++ one: within float32 rounding of the reference's sums."""
    lib = q4_linear.q4_library(portable, no_amx=True)
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.05
    q, d, m = quantize_q4_1(w)
    for bias in (None, torch.randn(n, generator=g)):
        layer = Q4Linear(w, bias, lib)
        for rows in (*range(1, 8), 40):
            x = torch.randn(rows, k, generator=g)
            got = layer(x)
            want = reference_linear(x, q, d, m, bias)
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # the plain float product is close too: only the rounding of x to int8 separates them
    x = torch.randn(3, k, generator=g)
    torch.testing.assert_close(Q4Linear(w, None, lib)(x), x @ dequantize_q4_1(q, d, m).T, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (48, 1536), (16, 32)])
def test_q8_kernel_matches_float64_reference(portable: bool, n: int, k: int) -> None:
    """The Q8_0 layer (the lm_head's format), as the Q4_1 one above; weights up to |q| = 127 on both signs."""
    lib = q4_linear.q4_library(portable, no_amx=True)
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * 0.05
    q, d = quantize_q8_0(w)
    assert int(q.abs().max()) == 127 and q.dtype == torch.int8
    for bias in (None, torch.randn(n, generator=g)):
        layer = Q8Linear(w, bias, lib)
        for rows in (*range(1, 6), 40):
            x = torch.randn(rows, k, generator=g)
            want = reference_q8_linear(x, q, d, bias)
            torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("layer_type", [Q4Linear, Q8Linear])
def test_vnni_and_avx2_kernels_give_the_same_outputs(layer_type: type) -> None:
    """Where the CPU has AVX-512 VNNI, the kernels take `vpdpbusd`; their integer sums are the AVX2 ones', so the
    outputs are identical, bit for bit, at every group of rows and tail."""
    vnni, avx2 = q4_linear.q4_library(no_amx=True), q4_linear.q4_library(no_vnni=True)
    if vnni.pagoda_q4_vectorized() != 2:
        pytest.skip("this CPU (or compiler target) has no AVX-512 VNNI: only the AVX2 kernels are built")
    assert avx2.pagoda_q4_vectorized() == 1
    g = torch.Generator().manual_seed(5)
    w, bias = torch.randn(64, 576, generator=g) * 0.05, torch.randn(64, generator=g)
    a, b = layer_type(w, bias, vnni), layer_type(w, bias, avx2)
    for rows in (*range(1, 8), 40):
        x = torch.randn(rows, 576, generator=g) * 4  # some blocks' |x| max rounds to 127
        assert torch.equal(a(x), b(x))


@pytest.mark.parametrize("layer_type", [Q4Linear, Q8Linear])
def test_amx_tiles_against_the_bfloat16_reference(layer_type: type) -> None:
    """Where the CPU has AMX, Q4_1 and Q8_0 steps of amx_min_rows rows or more run on bfloat16 tiles: against the
    float64 reference of that arithmetic within float32 summation (every shape class: an odd number of 16-column
    tiles, K of one and of many blocks, rows padded to 32, a bias or none), and more accurate than the int8
    activations against the exact product; fewer rows are the VNNI kernel's, bit for bit; a build without AMX never
    takes the tiles."""
    lib, plain = q4_linear.q4_library(), q4_linear.q4_library(no_amx=True)
    assert q4_linear.amx_min_rows(plain) == 0
    least = q4_linear.amx_min_rows(lib)
    if not least:
        pytest.skip("no AMX tiles here (CPU, compiler target or OS): the VNNI or AVX2 kernels take every step")
    g = torch.Generator().manual_seed(11)
    for n, k in ((48, 64), (960, 576), (576, 1536)):
        w = torch.randn(n, k, generator=g) * 0.05
        q, d, m = quantize_q4_1(w) if layer_type is Q4Linear else (*quantize_q8_0(w), None)
        exact_w = (dequantize_q4_1(q, d, m) if m is not None else dequantize_q8_0(q, d)).double()
        for bias in (None, torch.randn(n, generator=g)):
            tiles, vnni = layer_type(w, bias, lib), layer_type(w, bias, plain)
            for rows in (least - 1, least, least + 1, 100, 300, 417):
                x = torch.randn(rows, k, generator=g) * 4
                y = tiles(x)
                if rows < least:
                    assert torch.equal(y, vnni(x))
                    continue
                want = reference_bf16_linear(x, q, d, m, bias)
                torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
                exact = x.double() @ exact_w.T + (0 if bias is None else bias.double())
                assert (y.double() - exact).abs().mean() < (vnni(x).double() - exact).abs().mean()


@pytest.mark.parametrize("layer_type", [Q4Linear, Q8Linear])
def test_amx_threads_split_rows_or_tiles_to_the_same_bits(layer_type: type) -> None:
    """Where the CPU has AMX, a call's threads split its rows between them from ROW_SPLIT_MIN_ROWS rows (each widening
    every weight) and its pairs of weight tiles below: the layer, its fused SiLU-and-multiply, the MLP in one call and
    the norm ahead of either give the same bits either way, at row counts whose passes of 32 split evenly and not,
    and with one thread."""
    if not q4_linear.amx_min_rows(q4_linear.q4_library()):
        pytest.skip("no AMX tiles here (CPU, compiler target or OS)")
    by_rows, by_tiles = (q4_linear.q4_library(row_split_min_rows=n) for n in (32, 1 << 30))
    g = torch.Generator().manual_seed(12)
    h, i = 576, 1536
    weights = [torch.randn(2 * i, h, generator=g) * 0.1, torch.randn(h, i, generator=g) * 0.1,
               torch.randn(3 * 64, h, generator=g) * 0.1]
    bias = torch.randn(3 * 64, generator=g)
    (gu_r, down_r, qkv_r), (gu_t, down_t, qkv_t) = (
        [layer_type(w, bias if w.shape[0] == 3 * 64 else None, lib) for w in weights] for lib in (by_rows, by_tiles))
    norm_weight = torch.rand(h, generator=g) + 0.5
    threads = torch.get_num_threads()
    try:
        for n_threads in {threads, 1}:
            torch.set_num_threads(n_threads)
            for rows in (20, 32, 33, 64, 95, 100, 417):
                x, residual = torch.randn(rows, h, generator=g) * 3, torch.randn(rows, h, generator=g)
                assert torch.equal(qkv_r(x), qkv_t(x)), rows
                assert torch.equal(gu_r.silu_mul(x), gu_t.silu_mul(x)), rows
                assert torch.equal(gu_r.mlp(x, down_r), gu_t.mlp(x, down_t)), rows
                for layer_r, layer_t, down in ((qkv_r, qkv_t, (None, None)), (gu_r, gu_t, (down_r, down_t))):
                    y_r, h_r = layer_r.after_norm(x, residual.clone(), norm_weight, 1e-5, down[0])
                    y_t, h_t = layer_t.after_norm(x, residual.clone(), norm_weight, 1e-5, down[1])
                    assert torch.equal(y_r, y_t) and torch.equal(h_r, h_t), rows
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("layer_type", [Q4Linear, Q8Linear])
@pytest.mark.parametrize("build", ["vnni", "avx2", "portable"])
def test_gate_up_fused_with_silu_mul_gives_the_same_bits(build: str, layer_type: type) -> None:
    """pagoda_q4_linear_silu_mul and the Q8_0 one: the layer's output halves (gate, up) through the fused elementwise
    ops' SiLU-and-multiply of the same build, bit for bit, at every group of rows and tail, with and without a bias;
    a layer whose halves are not whole tiles has no fused form."""
    from pagoda.layers.elementwise import ElementwiseOps, _library

    lib = q4_linear.q4_library(portable=build == "portable", no_vnni=build == "avx2")
    ops = ElementwiseOps()
    ops.lib, ops.dtype = _library(0, portable=build == "portable"), torch.float32
    g = torch.Generator().manual_seed(9)
    for k, i in ((576, 1536), (64, 48)):
        w = torch.randn(2 * i, k, generator=g) * 0.1
        for bias in (None, torch.randn(2 * i, generator=g)):
            layer = layer_type(w, bias, lib)
            for rows in (*range(1, 10), 64, 100):  # 64 and 100: AMX tiles where the CPU has them
                x = torch.randn(rows, k, generator=g) * 3  # SiLU on both sides of 0, some saturating
                full = layer(x)
                assert torch.equal(layer.silu_mul(x), ops.silu_mul(full[:, :i], full[:, i:]))
    assert layer.silu_mul(torch.randn(2, 3, 64)).shape == (2, 3, 48)
    odd = layer_type(torch.randn(48, 64), None, lib)  # halves of 24 columns: not whole tiles of 16
    assert odd.silu_mul_kernel is None
    with pytest.raises(ValueError, match="no fused SiLU-and-multiply"):
        odd.silu_mul(torch.randn(1, 64))


@pytest.mark.parametrize("layer_type", [Q4Linear, Q8Linear])
@pytest.mark.parametrize("build", ["vnni", "avx2", "portable"])
def test_mlp_in_one_call_gives_the_same_bits(build: str, layer_type: type) -> None:
    """pagoda_packed_mlp: down(silu(gate) * up) in one call, bit for bit the fused gate_up and then the down layer,
    at row counts on both sides of the AMX tiles' threshold and of their passes of 32 rows (where the CPU has AMX, the
    intermediate goes to the down pass in bfloat16, padding rows included); only layers packed alike and without
    biases fuse."""
    lib = q4_linear.q4_library(portable=build == "portable", no_vnni=build == "avx2")
    g = torch.Generator().manual_seed(10)
    for h, i in ((576, 1536), (64, 96)):
        gate_up = layer_type(torch.randn(2 * i, h, generator=g) * 0.1, None, lib)
        down = layer_type(torch.randn(h, i, generator=g) * 0.1, None, lib)
        assert gate_up.fuses_mlp_with(down)
        for rows in (1, 5, 31, 32, 33, 64, 100, 257):
            x = torch.randn(rows, h, generator=g) * 3
            assert torch.equal(gate_up.mlp(x, down), down(gate_up.silu_mul(x))), (h, rows)
    assert gate_up.mlp(torch.randn(2, 3, 64), down).shape == (2, 3, 64)
    assert gate_up.mlp(torch.randn(0, 64), down).shape == (0, 64)
    other = Q8Linear if layer_type is Q4Linear else Q4Linear
    biased = layer_type(torch.randn(64, 96), torch.randn(64), lib)
    for wrong in (None, other(torch.randn(64, 96), None, lib), biased, layer_type(torch.randn(64, 64), None, lib)):
        assert not gate_up.fuses_mlp_with(wrong)
    with pytest.raises(ValueError, match="cannot run an MLP"):
        gate_up.mlp(torch.randn(1, 64), biased)


@pytest.mark.parametrize("layer_type", [Q4Linear, Q8Linear])
@pytest.mark.parametrize("build", ["vnni", "avx2", "portable"])
def test_norm_in_one_call_with_the_linear_gives_the_same_bits(build: str, layer_type: type) -> None:
    """pagoda_norm_linear and pagoda_norm_mlp (PackedLinear.after_norm): the fused elementwise ops' residual add and
    RMSNorm (float32, the same build's) and then the layer, or the MLP, bit for bit, the residual updated alike, with
    and without a residual and a bias, at row counts on both sides of the AMX tiles' threshold and passes (where the
    CPU has AMX the norm writes the tiles' bfloat16 rows, padding rows included; elsewhere it rounds the int8 rows);
    takes_norm at every row count ahead of a linear, ahead of an MLP only in steps that take the MLP in one call (the
    tiles', or from SILU_MUL_FUSED_MIN_ROWS rows)."""
    from pagoda.layers.elementwise import ElementwiseOps, _library

    lib = q4_linear.q4_library(portable=build == "portable", no_vnni=build == "avx2")
    ops = ElementwiseOps()
    ops.lib, ops.dtype = _library(0, portable=build == "portable"), torch.float32
    g = torch.Generator().manual_seed(11)
    for h, i in ((576, 1536), (64, 96)):
        gate_up = layer_type(torch.randn(2 * i, h, generator=g) * 0.1, None, lib)
        down = layer_type(torch.randn(h, i, generator=g) * 0.1, None, lib)
        qkv = layer_type(torch.randn(3 * 64, h, generator=g) * 0.1, torch.randn(3 * 64, generator=g), lib)
        weight = torch.rand(h, generator=g) + 0.5
        for rows in (1, 5, 19, 20, 31, 32, 33, 100, q4_linear.SILU_MUL_FUSED_MIN_ROWS + 1):
            for with_residual in (True, False):
                x = torch.randn(rows, h, generator=g) * 3
                residual = torch.randn(rows, h, generator=g) if with_residual else None
                expected_residual = None if residual is None else residual.clone()
                normed, h_expected = ops.add_rms_norm(x, expected_residual, weight, 1e-5)
                for layer, d, want in ((qkv, None, qkv(normed)), (gate_up, down, gate_up.mlp(normed, down))):
                    res = None if residual is None else residual.clone()
                    mlp_in_one_call = (rows >= q4_linear.SILU_MUL_FUSED_MIN_ROWS
                                       or 0 < q4_linear.amx_min_rows(lib) <= rows)
                    assert layer.takes_norm(x, res, weight, d) == (d is None or mlp_in_one_call)
                    y, h_out = layer.after_norm(x, res, weight, 1e-5, d)
                    assert torch.equal(y, want), (h, rows, with_residual, layer is qkv)
                    assert torch.equal(h_out, h_expected) and (res is None or h_out is res)
    assert not qkv.takes_norm(torch.randn(64, 64).t(), None, weight)  # not contiguous
    assert not qkv.takes_norm(torch.randn(64, 64, dtype=torch.float64), None, weight)
    with pytest.raises(ValueError, match="cannot run an MLP"):
        gate_up.after_norm(torch.randn(1, 64), None, weight, 1e-5, qkv)


def test_leading_dimensions_and_empty_input() -> None:
    layer = Q4Linear(torch.randn(32, 64), None, q4_linear.q4_library())
    x = torch.randn(2, 3, 64)
    assert torch.equal(layer(x), layer(x.reshape(6, 64)).reshape(2, 3, 32))
    assert layer(torch.randn(0, 64)).shape == (0, 32)


def test_weight_format_is_q4_1() -> None:
    """q in 0..15, d and m float16 values; a block's minimum and maximum are exact (q = 0 and 15), every weight
    within half a step of its block's grid; a constant block is d = 0."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 96, generator=g)
    w[3, :QK] = 0.25
    q, d, m = quantize_q4_1(w)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert torch.equal(d, d.half().float()) and torch.equal(m, m.half().float())
    assert d[3, 0] == 0 and m[3, 0] == 0.25
    back = dequantize_q4_1(q, d, m)
    step = d.repeat_interleave(QK, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-3 * step + 2e-3).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q4_1(torch.randn(4, 40))


def test_default_model_q4_1_weights_come_back_exactly() -> None:
    """The default model's layers are Q4_1 in its GGUF file and its embedding (the lm_head) Q8_0: re-quantizing the
    float32 weights the loader gives recovers q, d (and m), bit for bit."""
    from pagoda.model.gguf_loader import load_gguf
    from pagoda.model.loader import resolve_model_path

    gguf = load_gguf(resolve_model_path("smollm2-135m-instruct"))
    checked = 0
    for name, tensor in gguf.tensors():
        if name == "model.embed_tokens.weight":  # Q8_0 in the file; the lm_head (tied)
            q8, d8 = quantize_q8_0(tensor)
            assert torch.equal((d8[..., None] * q8.reshape(*d8.shape, QK).float()).reshape(tensor.shape), tensor)
        if name.startswith("model.layers.") and tensor.dim() == 2:
            q, d, m = quantize_q4_1(tensor)
            assert torch.equal(dequantize_q4_1(q, d, m), tensor), name
            checked += 1
        if checked == 14:  # two layers' seven projections: every kind, rope-permuted q and k included
            break
    assert checked == 14


def test_quantize_linears_frees_the_float_weights_and_other_paths_leave_them_alone() -> None:
    """Widths that do not tile stay float; the lm_head gets Q8_0 and (untied) its float weight is freed too; the
    quantized ones keep their forward after enable_gemv and prepack_linears."""
    model = nn.Module()
    model.block = nn.Sequential(nn.Linear(64, 32), nn.Linear(64, 20))
    model.lm_head = nn.Linear(64, 48, bias=False)
    x = torch.randn(5, 64)
    count, nbytes, _ = q4_linear.quantize_linears(model)
    assert count == 2 and nbytes > 0
    assert isinstance(q4_linear.packed_of(model.block[0]), Q4Linear) and model.block[0].weight.numel() == 0
    assert not q4_linear.is_quantized(model.block[1])
    assert q4_linear.is_quantized(model.lm_head) and not isinstance(q4_linear.packed_of(model.lm_head), Q4Linear)
    assert model.lm_head.weight.numel() == 0
    before = [model.block[0](x), model.lm_head(x)]
    assert linear.should_prepack(model, torch.float32, None, compile_model=False)  # block[1] is still float
    assert not linear.should_prepack(nn.Sequential(model.block[0], model.lm_head), torch.float32, None,
                                     compile_model=False)  # all quantized: nothing the default would pack
    linear.enable_gemv(model)
    linear.prepack_linears(model)
    for layer, out in zip((model.block[0], model.lm_head), before, strict=True):
        assert not linear.is_packed(layer) and getattr(layer, "_pagoda_gemv", None) is None
        assert torch.equal(layer(x), out)


def test_q8_0_rows_are_the_weights_rows() -> None:
    """q8_0_rows reads rows of a Q8_0 weight (the lm_head's: its output columns) from pack_q8_0's records: d * q, the
    dequantized weight's rows, bit for bit."""
    g = torch.Generator().manual_seed(4)
    q, d = quantize_q8_0(torch.randn(48, 96, generator=g))
    w = (d[..., None] * q.reshape(48, 3, QK).float()).reshape(48, 96)
    ids = torch.tensor([[0, 47, 16], [15, 8, 8]])
    rows = q4_linear.q8_0_rows(q4_linear.pack_q8_0(q, d), ids, 96)
    assert rows.dtype == torch.float32 and torch.equal(rows, w[ids])


@pytest.mark.parametrize("exact", [True, False])
def test_a_tied_lm_head_frees_the_embedding_where_its_q8_0_records_hold_it(exact: bool) -> None:
    """A tied lm_head's float weight (the embedding's) is freed where its Q8_0 records hold it exactly (a weight that
    was Q8_0 already, as the default model's): the embedding then reads its rows from the records, the same values;
    otherwise it stays. The decoder layers' weights are freed either way."""
    from pagoda.layers.tied_embedding import Q8_0, TiedEmbedding

    g = torch.Generator().manual_seed(5)
    model = nn.Module()
    model.embed = nn.Embedding(48, 64)
    model.block = nn.Linear(64, 32)
    model.lm_head = nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        w = torch.randn(48, 64, generator=g)
        if exact:
            q, d = quantize_q8_0(w)
            w = (d[..., None] * q.reshape(48, 2, QK).float()).reshape(48, 64)
        model.embed.weight.copy_(w)
    model.lm_head.weight = model.embed.weight
    ids = torch.tensor([3, 47, 0, 16])
    freed: list[int] = []
    q4_linear.quantize_linears(model, freed=freed.append)
    assert sorted(freed) == sorted([32 * 64 * 4, 48 * 64 * 4 if exact else 0])  # the float weights freed, as it goes
    assert model.block.weight.numel() == 0 and isinstance(model.embed, TiedEmbedding) == exact
    assert model.lm_head.weight is model.embed.weight and model.lm_head.weight.numel() == (0 if exact else 48 * 64)
    assert torch.equal(model.embed(ids), w[ids])
    if exact:
        assert model.embed.layout == Q8_0 and model.embed.packed is q4_linear.packed_of(model.lm_head).w


def test_q8_0_gives_every_quantizable_linear_8_bit_weights() -> None:
    """quantize_linears(model, "q8_0"): the decoder's layers run Q8_0 like the lm_head, their float weights freed,
    each computing the Q8_0 reference of its own weights; an unknown scheme is refused by name."""
    g = torch.Generator().manual_seed(3)
    model = nn.Module()
    model.block = nn.Sequential(nn.Linear(64, 32), nn.Linear(64, 20))
    model.lm_head = nn.Linear(64, 48, bias=False)
    weights = {name: (m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
               for name, m in (("block", model.block[0]), ("lm_head", model.lm_head))}
    count, nbytes, _ = q4_linear.quantize_linears(model, "q8_0")
    assert count == 2 and nbytes == (32 + 48) * 64 // QK * (QK + 2)  # a byte a weight, a float16 d per 32
    for name, layer in (("block", model.block[0]), ("lm_head", model.lm_head)):
        assert type(q4_linear.packed_of(layer)) is Q8Linear, name
        w, bias = weights[name]
        x = torch.randn(5, 64, generator=g)
        want = reference_q8_linear(x, *quantize_q8_0(w), bias)
        torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert model.block[0].weight.numel() == 0 and model.lm_head.weight.numel() == 0  # untied: freed
    assert not q4_linear.is_quantized(model.block[1])
    with pytest.raises(ValueError, match="quantization scheme must be one of q4_1, q8_0; got 'q2'"):
        q4_linear.quantize_linears(nn.Sequential(nn.Linear(64, 32)), "q2")
    from pagoda.config import QUANTIZATIONS

    assert QUANTIZATIONS == ("none", *q4_linear.SCHEMES)  # every scheme the flag offers is one the engine runs


def test_the_build_says_which_kernels_it_runs(caplog: pytest.LogCaptureFixture) -> None:
    """The portable build runs the plain C++ sums and quantize_linears warns about it; on a CPU with AVX2 and
    F16C the default build runs the vector kernels (the tests above compare the two): 2 where it also has AVX-512
    VNNI and VL."""
    assert q4_library_flag(portable=True) == 0
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    if "avx2" in flags and "f16c" in flags:
        vnni = "avx512_vnni" in flags and "avx512vl" in flags
        assert q4_library_flag(portable=False) == (2 if vnni else 1)
    model = nn.Sequential(nn.Linear(64, 32))
    with caplog.at_level("WARNING", logger="pagoda.layers.q4_linear"):
        q4_linear.quantize_linears(model, portable=True)
    assert any("plain C++" in r.getMessage() for r in caplog.records)


def q4_library_flag(portable: bool) -> int:
    return int(q4_linear.q4_library(portable).pagoda_q4_vectorized())


def test_amx_tiles_compile_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Q4_1/Q8_0 kernels' AMX variant (q4amx), built for AMX on any x86-64 CPU (`-mamx-*`; only run where the
    CPU has the tiles, the tests above): it compiles and takes the tiles only where the CPU has them. So a machine
    without AMX still catches an AMX-only build error (the VNNI and AVX2 builds do not compile that code)."""
    import platform

    if platform.machine() != "x86_64" or "avx512_bf16" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("the AMX variant is built for x86-64 CPUs with AVX-512 BF16")
    monkeypatch.setattr(q4_linear, "load_library", lambda src, defines, flags=(), rev=None,
                        load=q4_linear.load_library: load(src, defines, (*flags, "-mamx-tile", "-mamx-bf16",
                                                                         "-mamx-int8"), rev=rev))
    lib = q4_linear.q4_library.__wrapped__()
    assert hasattr(lib, "pagoda_q4_amx_min_rows")
    assert bool(lib.pagoda_q4_amx()) == ("amx_bf16" in Path("/proc/cpuinfo").read_text())


@pytest.mark.parametrize("cls", [q4_linear.Q4Linear, q4_linear.Q8Linear])
def test_packing_rows_at_a_time_gives_the_whole_weights_bytes(cls: type[q4_linear.PackedLinear],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """PackedLinear packs PACK_ROWS rows at a time into one tensor (the lm_head's quantizing temporaries stay small):
    the same bytes as packing the whole weight, a last part shorter than the others included; an output width that
    is not whole tiles is refused by the part that holds its end."""
    monkeypatch.setattr(q4_linear, "PACK_ROWS", 32)
    w = torch.randn(80, 64, generator=torch.Generator().manual_seed(6))
    assert torch.equal(cls._pack_by_rows(w), cls._pack(w))
    assert torch.equal(cls._pack_by_rows(w[:32]), cls._pack(w[:32]))
    with pytest.raises(ValueError, match="multiple of 16"):
        cls._pack_by_rows(w[:72])
