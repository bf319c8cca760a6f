"""The glibc allocator settings applied at engine start-up (pagoda/worker/host_memory.py)."""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda.worker import host_memory
from tests.conftest import resident_pages

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(host_memory, "_done", None)
    host_memory._libc.cache_clear()  # opened once per process
    yield
    host_memory._libc.cache_clear()  # not the test's stand-in


@glibc
def test_applied_once_and_reported(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGODA_KEEP_FREED_MEMORY", raising=False)
    assert host_memory.keep_freed_memory() is True
    # A second call does not call mallopt again.
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: pytest.fail("mallopt called twice"))
    assert host_memory.keep_freed_memory() is True


def test_opt_out(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_KEEP_FREED_MEMORY", "0")
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: pytest.fail("mallopt called despite the opt-out"))
    assert host_memory.keep_freed_memory() is False


def test_without_glibc_it_does_nothing(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_libc(*args: object, **kwargs: object) -> None:
        raise OSError("no such library")

    monkeypatch.delenv("PAGODA_KEEP_FREED_MEMORY", raising=False)
    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert host_memory.keep_freed_memory() is False


def _smaps_field(address: int, field: str) -> str:
    """A field of the /proc/self/smaps entry of the mapping holding address. The kernel merges neighbouring
    mappings with the same flags into one entry, so its counts may include other allocations than ours."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == field + ":":
                return line.split(":", 1)[1].strip()
    raise AssertionError(f"no mapping holds {address:#x}")


def _anon_huge_kib(address: int) -> int:
    return int(_smaps_field(address, "AnonHugePages").split()[0])


def _advised(address: int) -> bool:
    """The memory at address was advised for huge pages (madvise MADV_HUGEPAGE: VmFlags `hg`)."""
    return "hg" in _smaps_field(address, "VmFlags").split()


thp = pytest.mark.skipif(not host_memory.huge_pages_enabled(),
                         reason="transparent huge pages are off on this system (or PAGODA_HUGE_PAGES=0)")


@thp
def test_huge_page_zeros_is_aligned_zeroed_and_backed_by_huge_pages() -> None:
    buf = host_memory.huge_page_zeros(3 * host_memory.HUGE_PAGE + 123)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * host_memory.HUGE_PAGE + 123
    assert buf.data_ptr() % host_memory.HUGE_PAGE == 0
    assert _advised(buf.data_ptr()) and _advised(buf.data_ptr() + buf.numel() - 1)
    assert int(buf.count_nonzero()) == 0
    before = _anon_huge_kib(buf.data_ptr())
    buf.fill_(7)
    # the writes got huge pages: at least the three whole 2 MiB pages of the buffer
    assert _anon_huge_kib(buf.data_ptr()) - before >= 3 * 2048


@thp
def test_touch_pages_backs_every_page_and_keeps_the_zeros() -> None:
    # a fresh mapping: no page is backed until written (what the KV cache relies on without --kv-cache-prefault)
    buf = host_memory.huge_page_zeros(3 * host_memory.HUGE_PAGE + 5000)
    assert resident_pages(buf)[0] == 0
    host_memory.touch_pages(buf[:host_memory.HUGE_PAGE])  # only the first huge page
    resident, pages = resident_pages(buf)
    assert resident == host_memory.HUGE_PAGE // host_memory.PAGE < pages
    host_memory.touch_pages(buf)
    assert resident_pages(buf) == (pages, pages)
    assert int(buf.count_nonzero()) == 0


@thp
def test_touch_pages_backs_the_last_page_of_an_unaligned_tensor() -> None:
    # 200 bytes across the boundary of two huge pages: the 4 KiB stride alone writes into the first one only
    hp = host_memory.HUGE_PAGE
    part = host_memory.huge_page_zeros(2 * hp)[hp - 100:hp + 100]
    assert resident_pages(part) == (0, 2)
    host_memory.touch_pages(part)
    assert resident_pages(part) == (2, 2)


def test_small_page_zeros_is_zeroed_lazily_backed_and_not_on_huge_pages() -> None:
    buf = host_memory.small_page_zeros(3 * host_memory.HUGE_PAGE + 123)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * host_memory.HUGE_PAGE + 123
    assert buf.data_ptr() % host_memory.PAGE == 0
    assert resident_pages(buf)[0] == 0  # nothing backed until written
    assert int(buf.count_nonzero()) == 0
    assert "nh" in _smaps_field(buf.data_ptr(), "VmFlags").split()  # advised MADV_NOHUGEPAGE
    buf.fill_(7)
    assert _anon_huge_kib(buf.data_ptr()) == 0 and resident_pages(buf)[0] == resident_pages(buf)[1]


def test_without_huge_pages_the_buffer_is_plain_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_HUGE_PAGES", "0")
    assert not host_memory.huge_pages_enabled()
    buf = host_memory.huge_page_zeros(1000)
    assert buf.numel() == 1000 and int(buf.count_nonzero()) == 0


@pytest.mark.parametrize("enabled", ["1", "0"])
def test_move_to_huge_pages_copies_each_tensor(monkeypatch: pytest.MonkeyPatch, enabled: str) -> None:
    monkeypatch.setenv("PAGODA_HUGE_PAGES", enabled)
    originals = [torch.randn(3, 5), torch.arange(7, dtype=torch.int16), torch.randn(4, 6).t(),
                 torch.randint(0, 255, (33,), dtype=torch.uint8)]
    copies = host_memory.move_to_huge_pages(originals)
    for t, c in zip(originals, copies, strict=True):
        assert c.shape == t.shape and c.dtype == t.dtype and c.is_contiguous()
        assert torch.equal(c, t)
        assert c.data_ptr() % 64 == 0 and c.data_ptr() != t.data_ptr()
    # one region, back to back: the copies do not overlap
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in copies)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))


@glibc
@pytest.mark.parametrize("release", [True, False])
def test_copy_releasing_copies_and_hands_the_source_pages_back_chunk_by_chunk(release: bool,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    page, chunk = host_memory.PAGE, 256 << 10
    src = torch.randn((5 << 20) // 4 + 1234)  # pages not aligned to the tensor's ends
    expect = src.clone()
    dst = torch.empty_like(src)
    assert resident_pages(src)[0] == resident_pages(src)[1]
    real = host_memory._libc_function("madvise")
    calls: list[tuple[int, int, bool]] = []  # (start, length, dst complete up to the chunk's end when called)

    def madvise(start: int, length: int, advice: int) -> int:
        done = (start + length - src.data_ptr()) // src.element_size()
        calls.append((start, length, torch.equal(dst[:done], expect[:done])))
        return real(ctypes.c_void_p(start), ctypes.c_size_t(length), advice)

    monkeypatch.setattr(host_memory, "_libc_function", lambda name: madvise if name == "madvise" else None)
    host_memory.copy_releasing(dst, src, release=release, chunk=chunk)
    assert torch.equal(dst, expect)
    resident, pages = resident_pages(src)
    if not release:
        assert not calls and torch.equal(src, expect) and resident == pages
        return
    # each chunk's whole pages once its bytes were copied, one after the other, and none before that
    assert len(calls) == -(-src.numel() * 4 // chunk) and all(ok for _, _, ok in calls)
    assert all(start % page == 0 and length % page == 0 and length <= chunk for start, length, _ in calls)
    assert all(a + n == b for (a, n, _), (b, _, _) in zip(calls, calls[1:], strict=False))
    assert calls[0][0] - src.data_ptr() < page and src.data_ptr() + src.numel() * 4 - sum(calls[-1][:2]) < page
    assert resident <= 2  # the first and last pages, which the tensor shares with its neighbours
    first = -(-src.data_ptr() // page) * page
    interior = src[(first - src.data_ptr()) // 4:][: (calls[-1][0] + calls[-1][1] - first) // 4]
    assert int(interior.count_nonzero()) == 0  # dropped: an anonymous page reads zeros once handed back


def test_sole_holder_counts_every_tensor_over_the_storage() -> None:
    t = torch.randn(1000)
    assert host_memory.sole_holder(t)
    view = t[10:]
    assert not host_memory.sole_holder(t) and not host_memory.sole_holder(view)  # a view, and part of a storage
    del view
    assert host_memory.sole_holder(t)
    p = torch.nn.Parameter(torch.randn(64), requires_grad=False)
    assert host_memory.sole_holder(p.data, alias=True) and not host_memory.sole_holder(p.data)
    other = torch.tensor([])
    other.set_(t.untyped_storage())  # another tensor over the same storage, no view relation
    assert not host_memory.sole_holder(t)
    # memory torch did not allocate: a NumPy array's (which may have other holders torch cannot count)
    assert not host_memory.sole_holder(torch.from_numpy(np.zeros(1000, dtype=np.float32)))


def test_the_move_keeps_a_weight_that_something_else_still_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight whose memory another tensor shares is copied whole and its pages kept: only weights the move
    frees (all of a model's, where nothing else holds them) are released as they are copied."""
    from torch import nn

    from pagoda.engine import llm_engine
    from pagoda.engine.llm_engine import move_weights_to_huge_pages

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256, bias=False))
    shared = model[1].weight.detach().view(-1)  # e.g. a caller's alias of one weight
    expect = shared.clone()
    released: list[bool] = []
    real = host_memory.copy_releasing

    def spy(dst: torch.Tensor, src: torch.Tensor, release: bool, chunk: int = host_memory.RELEASE_CHUNK) -> None:
        released.append(release)
        real(dst, src, release, chunk=4096)

    monkeypatch.setattr(llm_engine, "copy_releasing", spy)
    move_weights_to_huge_pages(model)
    assert released == [True, True, False]  # weight, bias, the shared weight
    assert torch.equal(shared, expect) and torch.equal(model[1].weight.view(-1), expect)


@thp
@pytest.mark.parametrize("scheme", ["none", "q8_0", "tiles"])
@pytest.mark.parametrize("every", [1, 64 << 20])
def test_engine_weights_move_to_huge_pages(scheme: str, every: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parameters, packed quantized weights and float32 tiles move into the huge-page region, each old copy dropped
    as its new one takes its place: whenever the free heap is handed back to the kernel (before, as the moved bytes
    add up to release_every, and at the end), nothing holds the old copies moved so far (else keep_freed_memory's
    settings keep them resident: the float32 tiles' old copies once stayed, +400 MB of RSS for the default model),
    and the move does not wait for the end to drop them (the start-up's peak had been the two copies side by
    side)."""
    import weakref

    from torch import nn

    from pagoda.engine import llm_engine
    from pagoda.engine.llm_engine import move_weights_to_huge_pages
    from pagoda.layers.linear import prepack_linears, tiles_of
    from pagoda.layers.q4_linear import packed_of, quantize_linears

    torch.manual_seed(0)
    model = nn.Module()
    model.embed = nn.Embedding(64, 32)
    model.model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 32, bias=False))
    model.lm_head = nn.Linear(32, 64, bias=False)
    model.lm_head.weight = model.embed.weight  # tied, as the default model's
    x = torch.randn(3, 32)
    if scheme == "tiles":
        prepack_linears(model)
    elif scheme != "none":
        quantize_linears(model, scheme)
    with torch.no_grad():  # as the engine runs: no autograd graph holding the weights
        before = model.lm_head(model.model(x))
        ids = torch.tensor([0, 63, 17])
        rows = model.embed(ids)
    old = [weakref.ref(tiles_of(m)) for m in model.modules() if tiles_of(m) is not None]  # no name bound to one
    old += [weakref.ref(q.w) for q in map(packed_of, model.modules()) if q]
    assert bool(old) == (scheme != "none")
    released = []
    record = lambda: released.append([r() is None for r in old])  # noqa: E731
    monkeypatch.setattr(llm_engine, "release_free_heap", record)
    monkeypatch.setattr(host_memory, "release_free_heap", record)  # HeapReleaser's
    releases: list[bool] = []
    sources: list[int] = []
    packed_biases = {q.bias.data_ptr() for q in map(packed_of, model.modules()) if q and q.bias is not None}
    copy = host_memory.copy_releasing
    monkeypatch.setattr(llm_engine, "copy_releasing", lambda dst, src, release: (
        releases.append(release), sources.append(src.data_ptr()), copy(dst, src, release))[-1])
    moved = move_weights_to_huge_pages(model, release_every=every)
    assert released[-1] == [True] * len(old)
    if every == 1:  # a release after each tensor (the parameters first): the old copies die one by one
        params = len([p for p in model.parameters() if p.numel()])
        assert [sum(r) for r in released] == [0] * (1 + params) + list(range(1, len(old) + 1)) + [len(old)]
    else:  # a tiny model: a release before (the holes the packing left) and one at the end
        assert len(released) == 2
    assert model.lm_head.weight is model.embed.weight
    tensors = [p for p in model.parameters() if p.numel()] + [q.w for q in map(packed_of, model.modules()) if q]
    tensors += [t for m in model.modules() if (t := tiles_of(m)) is not None]
    assert moved == sum(t.numel() * t.element_size() for t in tensors)
    assert all(_advised(t.data_ptr()) for t in tensors)
    assert torch.equal(model.lm_head(model.model(x)), before)
    assert torch.equal(model.embed(ids), rows)  # a TiedEmbedding reads the tiles' new copy
    # each old copy handed back as it was copied, but for a bias that a packed layer reads as it is (its storage)
    assert releases == [ptr not in packed_biases for ptr in sources]


@thp
@pytest.mark.parametrize("prefault", [False, True])
def test_the_engine_keeps_its_weights_on_huge_pages_and_its_cache_when_prefaulted(tmp_path: Path,
                                                                                  prefault: bool) -> None:
    from pagoda import LLM, SamplingParams
    from tests.conftest import make_tiny_model

    llm = LLM(str(make_tiny_model(tmp_path, "llama")), kv_cache_memory="8MiB", kv_cache_prefault=prefault)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))  # writes the cache
    engine = llm.engine
    from pagoda.layers.linear import tiles_of

    # the parameters (empty where the float32 tiles freed a plain weight) and the tiles
    weights = [p for p in engine.model.parameters() if p.numel()]
    tiles = [t for m in engine.model.modules() if (t := tiles_of(m)) is not None]
    assert tiles and all(_advised(t.data_ptr()) for t in weights + tiles)
    cache = engine.runner.kv_caches[0]
    assert _advised(cache.k.data_ptr()) == _advised(cache.v.data_ptr()) == prefault
