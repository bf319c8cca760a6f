"""Build Pagoda's C++ kernels at start-up through inductor's C++ code cache: the compiler, vector-ISA
flags, OpenMP runtime and on-disk cache torch.compile uses for its own kernels, so a second process loads
a kernel without compiling. Each source is compiled after `cpp_vector.h`, with its constants #defined
ahead of both as PAGODA_<NAME>."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_VECTOR_HEADER = Path(__file__).with_name("cpp_vector.h")


def load_library(source: Path, defines: dict[str, int], extra_flags: tuple[str, ...] = ()) -> Any:
    """Compile (or load the cached build of) source; returns the ctypes library."""
    from torch._inductor.codecache import CppCodeCache  # the import is slow: only when used

    header = "".join(f"#define PAGODA_{k} {v}\n" for k, v in defines.items())
    return CppCodeCache.load(header + _VECTOR_HEADER.read_text() + source.read_text(), extra_flags=extra_flags)
