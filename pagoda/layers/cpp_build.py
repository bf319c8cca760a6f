"""Build Pagoda's C++ kernels at start-up through inductor's C++ code cache: the compiler, vector-ISA
flags, OpenMP runtime and on-disk cache torch.compile uses for its own kernels, so a second process loads
a kernel without compiling. Each source is compiled after `cpp_vector.h`, with its constants #defined
ahead of both as PAGODA_<NAME>."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

_VECTOR_HEADER = Path(__file__).with_name("cpp_vector.h")


def load_library(source: Path, defines: dict[str, int], extra_flags: tuple[str, ...] = (),
                 rev: str | None = None) -> Any:
    """Compile (or load the cached build of) source; returns the ctypes library. rev: build the source and
    the header as they were at this git revision instead (benchmarks time a kernel against its past).

    The build targets this CPU (inductor's -march=native and its vector ISA's flags); extra_flags cannot narrow it.
    To build what an older CPU would run, set inductor's TORCHINDUCTOR_CPP_MARCH (e.g. haswell) and
    ATEN_CPU_CAPABILITY (avx2) before the process starts (pagoda/bench/f32_tiles.py)."""
    from torch._inductor.codecache import CppCodeCache  # the import is slow: only when used

    header = "".join(f"#define PAGODA_{k} {v}\n" for k, v in defines.items())
    return CppCodeCache.load(header + _read(_VECTOR_HEADER, rev) + _read(source, rev), extra_flags=extra_flags)


def _read(path: Path, rev: str | None) -> str:
    if rev is None:
        return path.read_text()
    repo = path.parent
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=repo, capture_output=True, text=True,
                             check=True).stdout.strip()
        name = path.resolve().relative_to(Path(top).resolve()).as_posix()
        return subprocess.run(["git", "show", f"{rev}:{name}"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout
    except (OSError, ValueError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        raise ValueError(f"cannot read {path.name} at git revision {rev!r} (a checkout of the repository is "
                         f"needed): {detail}") from e
