"""The glibc allocator settings applied at engine start-up (pagoda/worker/host_memory.py)."""

from __future__ import annotations

import ctypes
import platform

import pytest

from pagoda.worker import host_memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "_done", None)


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
