"""The linear layers' extra paths (pagoda/layers/linear.py): the C++ GEMV (bfloat16 and float32) for steps of a
few rows, and the dispatch between it, oneDNN-packed weights and F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers import linear
from pagoda.layers.tied_embedding import TiedEmbedding

BF16_TILES = bool(linear.tiles_library().pagoda_bf16_tiles_enabled())  # builds with AVX-512


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (49, 1536), (7, 70), (130, 33)])
def test_gemv_matches_float32_linear_rounded_once(portable: bool, n: int, k: int) -> None:
    """Against F.linear in float32 on the same bfloat16 values: within one bfloat16 rounding of the float32
    result (the sums are float32 in another order). Shapes with a tail past the last 32 and 16 elements of
    K, and N not a multiple of the 4 rows taken together; with and without bias; 1-4 rows; the AVX-512 BF16
    build and the portable one (AVX-512 BF16 lets it use vdpbf16ps)."""
    gemv = linear._gemv_for(linear._gemv_library(portable))
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    for bias in (None, torch.randn(n, generator=g).bfloat16()):
        for m in range(1, linear.GEMV_MAX_ROWS + 1):
            x = torch.randn(m, k, generator=g).bfloat16()
            want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            got = gemv(x, w, bias)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-4)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (49, 1536), (7, 70), (130, 33)])
def test_float32_gemv_matches_float64_linear(portable: bool, n: int, k: int) -> None:
    """The float32 GEMV against F.linear in float64: within float32 rounding of the sums (another order);
    tails past the last 16 elements of K, N not a multiple of 4, with and without bias, 1-4 rows."""
    gemv = linear._gemv_for(linear._gemv_library(portable))
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    for bias in (None, torch.randn(n, generator=g)):
        for m in range(1, linear.GEMV_MAX_ROWS + 1):
            x = torch.randn(m, k, generator=g)
            want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            got = gemv(x, w, bias)
            assert got.dtype == torch.float32 and got.shape == (m, n)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tiles", [True, False])
def test_linear_dispatch_by_rows(monkeypatch: pytest.MonkeyPatch, tiles: bool) -> None:
    """enable_gemv: bfloat16 and float32 linears take the GEMV for 1-GEMV_MAX_ROWS rows; after prepack_linears
    float32 ones take their tiles at every row count, before the GEMV, and so do bfloat16 ones where the build has
    AVX-512 (BF16_TILES). Without the tile kernels (tiles=False, as where they cannot be built), and bfloat16 ones on
    AVX2, they keep the GEMV and take oneDNN's packed weight beyond it (bfloat16 where oneDNN packs it, within
    PACKED_ROWS); float64 ones are left alone."""
    packed_calls: list[int] = []
    pointwise = torch.ops.mkldnn._linear_pointwise  # looked up when a layer's forward is built: patch first
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *a: packed_calls.append(x.shape[0]) or pointwise(x, *a), raising=False)
    model = nn.Sequential(nn.Linear(64, 32).bfloat16(), nn.Linear(32, 16), nn.Linear(16, 8).double())
    f64 = model[2]
    assert linear.enable_gemv(model) >= 0 and "forward" not in vars(f64)
    cases = []
    for layer, k, dtype in ((model[0], 64, torch.bfloat16), (model[1], 32, torch.float32)):
        assert layer._pagoda_gemv is not None
        gemv_calls: list[int] = []
        gemv = layer._pagoda_gemv
        layer._pagoda_gemv = lambda x, w, b, gemv=gemv, calls=gemv_calls: calls.append(x.shape[0]) or gemv(x, w, b)
        cases.append((layer, k, dtype, layer.weight.detach().clone(), gemv_calls))
    linear.prepack_linears(model, tiles=tiles)
    top = linear.GEMV_MAX_ROWS
    bf16_packable = linear.packable_rows(torch.bfloat16) is not None  # not on AVX2 CPUs
    for layer, k, dtype, weight, gemv_calls in cases:
        on_tiles = tiles and (dtype == torch.float32 or BF16_TILES)
        assert (linear.tiles_of(layer) is not None) == on_tiles and (layer.weight.numel() == 0) == on_tiles
        tile_calls: list[int] = []
        if on_tiles:
            call, calls = layer._pagoda_tiles_call, tile_calls
            layer._pagoda_tiles_call = lambda x, w, b, call=call, calls=calls: calls.append(x.shape[0]) or call(x, w, b)
        packed_calls.clear()
        for rows in (1, top, top + 1, 2000):
            x = torch.randn(rows, k, dtype=dtype)
            tol = {"rtol": 2**-7, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
            torch.testing.assert_close(layer(x).float(), F.linear(x, weight, layer.bias).float(), **tol)
        if on_tiles:
            assert tile_calls == [1, top, top + 1, 2000] and gemv_calls == [] and packed_calls == []
        else:
            onednn = dtype == torch.float32 or bf16_packable
            beyond = [top + 1, 2000] if dtype == torch.float32 else [top + 1]  # bfloat16: F.linear past 1,024 rows
            assert gemv_calls == [1, top] and packed_calls == (beyond if onednn else [])
            assert linear.is_packed(layer) == onednn


def test_bfloat16_where_onednn_cannot_pack_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN has no bfloat16 (AVX2 CPUs; faked here), bfloat16 linears take the tiles where the build has
    AVX-512 (BF16_TILES), by default and when asked, and are left unpacked otherwise (oneDNN's reorder would raise),
    as they are without the tile kernels, while float32 ones pack for oneDNN."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    model = nn.Sequential(nn.Linear(64, 32).bfloat16(), nn.Linear(32, 16))
    assert linear.packable_rows(torch.bfloat16) is None and linear.packable_rows(torch.float32) is not None
    assert linear.should_prepack(model[:1], torch.bfloat16, None, compile_model=False) == BF16_TILES
    added, rows = linear.prepack_linears(model)
    tiles = [linear.tiles_of(m) for m in model]
    assert (tiles[0] is not None) == BF16_TILES and tiles[1] is not None and rows == linear.TILE_ROWS
    # the tiles (32 and 16 outputs in whole panels) less the plain weights they replace
    assert added == sum(t.numel() * t.element_size() for t in tiles if t is not None) - 16 * 32 * 4 - (
        32 * 64 * 2 if BF16_TILES else 0)
    plain = nn.Sequential(nn.Linear(64, 32).bfloat16(), nn.Linear(32, 16))
    linear.prepack_linears(plain, tiles=False)
    assert not linear.is_packed(plain[0]) and linear.is_packed(plain[1]) and linear.tiles_of(plain[1]) is None


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (49, 1536), (7, 70), (130, 33), (300, 64)])
def test_float32_tiles_match_float64_linear(portable: bool, n: int, k: int) -> None:
    """f32_tiles.cpp's kernel on pack_tiles' layout against F.linear in float64: within float32 rounding of the sums;
    N not a multiple of the panel's columns (a part panel, zeros past N), with and without bias, row counts around
    the tile's rows (12 under AVX-512, 6 under AVX2, and their tails) and a large one; the portable build too."""
    lib = linear.tiles_library(portable)
    call = linear._tiles_call(lib, n, k)
    g = torch.Generator().manual_seed(n + 7 * k)
    w = torch.randn(n, k, generator=g)
    panel = lib.pagoda_f32_tiles_panel()
    packed = linear.pack_tiles(w, panel)
    assert packed.shape == (-(-n // panel), k, panel) and torch.equal(packed[0, :, 1], w[1])
    assert not packed[-1, :, n - (len(packed) - 1) * panel:].any()  # zeros past N
    for bias in (None, torch.randn(n, generator=g)):
        for m in (1, 5, 6, 7, 11, 12, 13, 25, 130):
            x = torch.randn(m, k, generator=g)
            want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            got = call(x, packed, bias)
            assert got.dtype == torch.float32 and got.shape == (m, n)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (49, 1536), (7, 70), (130, 33), (300, 64)])
def test_bfloat16_tiles_match_float64_linear(portable: bool, n: int, k: int) -> None:
    """The bfloat16 tiles (weights in pairs of k; `vdpbf16ps` where the build has AVX-512 BF16, widened to float32
    elsewhere and in the portable build) against F.linear in float64 on the same bfloat16 values: within one bfloat16
    rounding of the sums; odd K (the last pair's second weight zero, its x never read), a part panel, with and
    without bias, row counts around the tile's rows."""
    lib = linear.tiles_library(portable)
    call = linear._tiles_call(lib, n, k, torch.bfloat16)
    g = torch.Generator().manual_seed(n + 5 * k)
    w = torch.randn(n, k, generator=g).bfloat16()
    panel = lib.pagoda_f32_tiles_panel()
    packed = linear.pack_tiles(w, panel)
    assert packed.shape == (-(-n // panel), -(-k // 2), panel, 2) and torch.equal(packed[0, :k // 2, 1, 1], w[1, 1::2])
    assert not packed[-1, :, n - (len(packed) - 1) * panel:].any() and (k % 2 == 0 or not packed[:, -1, :, 1].any())
    for bias in (None, torch.randn(n, generator=g).bfloat16()):
        for m in (1, 5, 6, 7, 11, 12, 13, 25, 130):
            x = torch.randn(m + 1, k, generator=g).bfloat16()
            x[-1] = float("nan")  # a row past the m read: a NaN there would reach the sums
            want = F.linear(x[:m].double(), w.double(), None if bias is None else bias.double())
            got = call(x[:m], packed, bias)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-2)


def test_tiles_free_the_plain_float32_weights_and_a_tied_embedding_reads_the_tiles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """prepack_linears frees a float32 layer's plain weight once its tiles take every input (an empty tensor of its
    dtype stays), a tied lm_head's too, the embedding that shared it then reading its rows from the tiles (the same
    values, bit for bit; out-of-range ids refused); with keep_plain it frees none; the tiles then serve inputs of any
    leading shape and refuse other dtypes and widths by name; should_prepack counts no copy then; a second
    prepack_linears leaves the layers as they are."""
    model = nn.Module()
    model.embed = nn.Embedding(48, 64)
    model.proj = nn.Linear(64, 40)
    model.lm_head = nn.Linear(64, 48, bias=False)
    model.lm_head.weight = model.embed.weight
    plain = {name: m.weight.detach().clone() for name, m in (("proj", model.proj), ("lm_head", model.lm_head))}
    monkeypatch.setattr(linear, "PREPACK_AUTO_MAX_BYTES", 0)  # the tiles leave no copy: not even the tied weight
    assert linear.should_prepack(model, torch.float32, None, compile_model=False)
    freed: list[int] = []
    added, _ = linear.prepack_linears(model, freed=freed.append)
    assert sorted(freed) == [40 * 64 * 4, 48 * 64 * 4]  # each plain weight's bytes, told as it goes
    assert model.proj.weight.numel() == 0 and model.proj.weight.dtype == torch.float32
    assert isinstance(model.embed, TiedEmbedding) and model.lm_head.weight.numel() == 0
    assert model.embed.weight is model.lm_head.weight and model.embed.packed is linear.tiles_of(model.lm_head)
    ids = torch.tensor([[0, 47, 31], [32, 5, 5]])
    assert torch.equal(model.embed(ids), plain["lm_head"][ids]) and model.embed(ids[:, :0]).shape == (2, 0, 64)
    for bad in (48, -1):
        with pytest.raises(IndexError, match=r"token ids must be in \[0, 48\)"):
            model.embed(torch.tensor([3, bad]))
    panels = [linear.tiles_of(m) for m in (model.proj, model.lm_head)]
    assert added == sum(t.numel() for t in panels if t is not None) * 4 - (40 + 48) * 64 * 4
    x = torch.randn(2, 3, 64)
    for name, layer in (("proj", model.proj), ("lm_head", model.lm_head)):
        want = F.linear(x.double(), plain[name].double(), None if layer.bias is None else layer.bias.double())
        torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-4)
    assert model.proj(x[:, :0]).shape == (2, 0, 40)
    with pytest.raises(ValueError, match=r"float32 x of shape \(\.\.\., 64\); got torch.bfloat16"):
        model.proj(x.bfloat16())
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 64\); got torch.float32 \(5, 63\)"):
        model.proj(torch.randn(5, 63))
    assert linear.prepack_linears(model) == (0, None) and linear.tiles_of(model.proj) is panels[0]
    kept = nn.Linear(64, 40)
    linear.prepack_linears(nn.Sequential(kept), keep_plain=True)
    assert kept.weight.shape == (40, 64) and linear.tiles_of(kept) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(48, 64), (45, 63), (97, 33)])
def test_tile_rows_are_the_weights_rows(dtype: torch.dtype, n: int, k: int) -> None:
    """tile_rows gives weight[ids] from pack_tiles's layout: part last panels, odd widths (bfloat16's pairs)."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    for panel in (16, 32):
        ids = torch.randint(0, n, (3, 7), generator=g)
        ids[0, :2] = torch.tensor([0, n - 1])
        rows = linear.tile_rows(linear.pack_tiles(w, panel), ids, k)
        assert rows.shape == (3, 7, k) and rows.dtype == dtype and torch.equal(rows, w[ids])


def test_a_weight_shared_beyond_embeddings_keeps_its_plain_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tied weight that another linear (or an embedding with max_norm, which rewrites rows) shares stays beside
    the tiles, and should_prepack counts that copy; keep_plain leaves a tied embedding as it was."""
    for other in ("linear", "max_norm", "keep_plain"):
        model = nn.Module()
        model.embed = nn.Embedding(48, 64, max_norm=1.0 if other == "max_norm" else None)
        model.lm_head = nn.Linear(64, 48, bias=False)
        model.lm_head.weight = model.embed.weight
        if other == "linear":
            model.twin = nn.Linear(64, 48, bias=False)
            model.twin.weight = model.embed.weight
        monkeypatch.setattr(linear, "PREPACK_AUTO_MAX_BYTES", 48 * 64 * 4 - 1)
        assert linear.should_prepack(model, torch.float32, None, compile_model=False) == (other == "keep_plain")
        linear.prepack_linears(model, keep_plain=other == "keep_plain")
        assert isinstance(model.embed, nn.Embedding) and model.lm_head.weight is model.embed.weight
        assert model.embed.weight.shape == (48, 64) and linear.tiles_of(model.lm_head) is not None


def test_float32_packs_for_onednn_without_tiles() -> None:
    """prepack_linears(tiles=False) (and where the tile kernel cannot be built) packs float32 weights for oneDNN,
    whose results are F.linear's up to float32 rounding."""
    layer = nn.Linear(40, 70)
    linear.prepack_linears(nn.Sequential(layer), tiles=False)
    assert linear.tiles_of(layer) is None and linear.is_packed(layer)
    x = torch.randn(9, 40)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_float32_steps_beyond_the_gemv_go_to_onednn(monkeypatch: pytest.MonkeyPatch, bias: bool) -> None:
    """enable_gemv: a float32 linear without a packed weight takes oneDNN's matmul on its plain weight beyond the
    GEMV's rows, with F.linear's result up to float32 rounding; with ONEDNN_FLOAT32 off, F.linear."""
    dnn_calls: list[int] = []
    pointwise = torch.ops.mkldnn._linear_pointwise  # looked up when a layer's forward is built: patch first
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *a: dnn_calls.append(x.shape[0]) or pointwise(x, *a), raising=False)
    layer = nn.Linear(40, 130, bias=bias)
    assert linear.enable_gemv(nn.Sequential(layer)) >= 0 and not linear.is_packed(layer)
    top = linear.GEMV_MAX_ROWS
    for rows in (1, top, top + 1, 37, 300):
        x = torch.randn(rows, 40)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert dnn_calls == [top + 1, 37, 300]
    monkeypatch.setattr(linear, "ONEDNN_FLOAT32", False)
    x = torch.randn(37, 40)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias)) and dnn_calls == [top + 1, 37, 300]
