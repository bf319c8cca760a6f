"""Pagoda: an LLM inference and serving engine. Public API: LLM, SamplingParams, RequestOutput."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagoda.entrypoints.llm import LLM
    from pagoda.outputs import CompletionOutput, RequestOutput
    from pagoda.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so that `import pagoda.core...` stays free of torch and fast to test.
    if name == "LLM":
        from pagoda.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagoda.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from pagoda import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
