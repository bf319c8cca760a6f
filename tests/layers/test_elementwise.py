"""The fused C++ elementwise ops against the torch code they replace (pagoda/layers/elementwise.py)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from pagoda.layers import elementwise
from pagoda.layers.elementwise import ElementwiseOps
from pagoda.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def fused(dtype: torch.dtype) -> ElementwiseOps:
    ops = ElementwiseOps()
    ops.enable_cpp(dtype)
    assert ops.lib is not None
    return ops


def portable(dtype: torch.dtype) -> ElementwiseOps:
    """The build for CPUs without AVX-512 (SiLU's plain division instead of its reciprocal estimate)."""
    ops = fused(dtype)
    ops.lib = elementwise._library(elementwise._ELEM[dtype], portable=True)
    return ops


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Within two units in the last place of the dtype: the C++ sum of squares and exp differ from torch's
    in float32 rounding, which a 16-bit result sometimes rounds the other way (silu(g) one unit off, times
    up, can be two units of the product)."""
    tol = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 64), (37, 72), (300, 576)])  # 72: a tail after 16-lane vectors
def test_add_rms_norm(dtype: torch.dtype, rows: int, dim: int) -> None:
    torch.manual_seed(rows)
    x, residual = torch.randn(rows, dim).to(dtype), (torch.randn(rows, dim) * 3).to(dtype)
    weight = (torch.rand(dim) + 0.5).to(dtype)
    ops, ref = fused(dtype), ElementwiseOps()
    out, h = ops.add_rms_norm(x, residual.clone(), weight, 1e-5)
    ref_out, ref_h = ref.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(h, ref_h)  # the residual add rounds exactly as torch's
    close(out, ref_out, dtype)
    out, h = ops.add_rms_norm(x, None, weight, 1e-6)  # the first layer: no residual yet
    assert h is x
    close(out, ref.add_rms_norm(x, None, weight, 1e-6)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64, 96])  # half of 16 is below one vector; 96: a vector and a tail
def test_rotary_in_place_on_a_fused_projection(dtype: torch.dtype, head_dim: int) -> None:
    """q and k as views of one (T, (Hq + 2 Hkv) D) projection output: rotated in place, bit for bit as torch."""
    torch.manual_seed(head_dim)
    t, hq, hkv = 29, 6, 2
    rope = RotaryEmbedding(head_dim, 1024, 10000.0, None, dtype)
    cos, sin = rope.cos_sin(torch.randint(0, 1024, (t,)))
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim).to(dtype)
    q = qkv[:, : hq * head_dim].view(t, hq, head_dim)
    k = qkv[:, hq * head_dim: (hq + hkv) * head_dim].view(t, hkv, head_dim)
    v_before = qkv[:, (hq + hkv) * head_dim:].clone()
    ref_q, ref_k = ElementwiseOps().rotary(q.clone(), k.clone(), cos, sin)
    out_q, out_k = fused(dtype).rotary(q, k, cos, sin)
    assert out_q.data_ptr() == qkv.data_ptr()  # in place
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert torch.equal(qkv[:, (hq + hkv) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 72, 128])  # 72: a vector and a tail
def test_head_rms_norm_in_place_on_a_fused_projection(dtype: torch.dtype, head_dim: int) -> None:
    """Qwen3's q and k norms on views of one (T, (Hq + 2 Hkv) D) projection output: each head normalized as torch's
    rms_norm (the add_rms_norm's row arithmetic, so within its rounding), in place, v untouched; each head alone
    (a head's values scaled leave the others as they were)."""
    torch.manual_seed(head_dim)
    t, hq, hkv = 29, 6, 2
    qkv = (torch.randn(t, (hq + 2 * hkv) * head_dim) * 3).to(dtype)
    qkv[:, :head_dim] *= 50  # the first head of every token larger than the rest
    weights = [(torch.rand(head_dim) + 0.5).to(dtype) for _ in range(2)]
    views = [qkv[:, : hq * head_dim].view(t, hq, head_dim),
             qkv[:, hq * head_dim: (hq + hkv) * head_dim].view(t, hkv, head_dim)]
    v_before = qkv[:, (hq + hkv) * head_dim:].clone()
    ops, ref = fused(dtype), ElementwiseOps()
    for x, w in zip(views, weights, strict=True):
        want = ref.head_rms_norm(x.clone(), w, 1e-6)
        got = ops.head_rms_norm(x, w, 1e-6)
        assert got.data_ptr() == x.data_ptr()  # in place
        close(got, want, dtype)
    assert torch.equal(qkv[:, (hq + hkv) * head_dim:], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [128, 100])
@pytest.mark.parametrize("build", [fused, portable])
def test_silu_mul_on_both_halves_of_one_tensor(dtype: torch.dtype, n: int, build: Any) -> None:
    torch.manual_seed(n)
    gate_up = (torch.randn(33, 2 * n) * 4).to(dtype)  # large and negative values: exp's range
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0]).to(dtype)
    gate, up = gate_up[:, :n], gate_up[:, n:]
    close(build(dtype).silu_mul(gate, up), ElementwiseOps().silu_mul(gate, up), dtype)


def test_other_dtypes_and_layouts_run_as_torch() -> None:
    """float64 builds nothing; a tensor the C++ loops do not take (transposed rows) goes to torch's code."""
    ops = ElementwiseOps()
    assert ops.enable_cpp(torch.float64) == 0.0 and ops.lib is None
    f32 = fused(torch.float32)
    x = torch.randn(64, 48).t()  # (48, 64), columns contiguous
    weight = torch.rand(64)
    torch.testing.assert_close(f32.add_rms_norm(x, None, weight, 1e-6)[0], ops.add_rms_norm(x, None, weight, 1e-6)[0])


def test_a_failed_build_is_logged_and_ops_stay_torch(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    def broken(elem: int, portable: bool = False) -> None:
        raise RuntimeError("no compiler")

    monkeypatch.setattr(elementwise, "_library", broken)
    ops = ElementwiseOps()
    with caplog.at_level(logging.WARNING):
        ops.enable_cpp(torch.float32)
    assert ops.lib is None and "could not compile the fused elementwise ops" in caplog.text
    x = torch.randn(3, 16)
    assert torch.equal(ops.silu_mul(x, x), torch.nn.functional.silu(x) * x)
