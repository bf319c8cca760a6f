"""Step-time breakdown (`--profile`): where each engine step's wall time goes.

Phases of a step (schedule, input preparation, forward, logits, sampling, scheduler update, output
processing) are timed around their calls, and do not overlap: "logits" (the lm_head, for the rows that sample
or score prompt tokens) is reported apart from "sampling", which then holds the sampler and its bookkeeping. Inside the
forward pass, forward hooks time the modules by kind (attention and MLP blocks, their linear layers, norms,
embedding). A decode step run as one C++ call (pagoda/model/one_stream.py says which) runs no hooks:
its forward is "forward/one_call", and the C++ loop times each kind of call in it ("forward/one_call/qkv_proj",
".../attention", ...); the by-kind rows above cover the other steps only. Such a step's lm_head runs in the same
call (".../lm_head"), so its "logits" phase only hands those logits back. Off unless asked for: the
engine then uses `NULL_PROFILER`, whose phases cost one no-op context manager.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class StepProfiler:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._starts: dict[int, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - start
            self.counts[name] += 1

    def attach(self, model: nn.Module) -> None:
        """Time modules by kind with forward hooks (leaves timed inside their blocks too), and the model's
        one-call decode forward, which runs no hooks, as forward/one_call."""
        for name, module in model.named_modules():
            kind = _kind(name, module)
            if kind is not None:
                module.register_forward_pre_hook(self._pre)
                module.register_forward_hook(self._post(kind))
        one_call = getattr(model, "one_stream_forward", None)
        if one_call is not None:
            model.one_stream_forward = _TimedOneCall(one_call, self)  # type: ignore[assignment]

    def _pre(self, module: nn.Module, args: Any) -> None:
        self._starts[id(module)] = time.perf_counter()

    def _post(self, kind: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.totals[f"forward/{kind}"] += time.perf_counter() - self._starts.pop(id(module))
        return hook

    def report(self) -> dict[str, dict[str, float]]:
        """Per phase: ms per step and share of the step. Derived: attention and MLP without their linears, and
        sampling without the logits."""
        t = dict(self.totals)
        if "sampling" in t:
            t["sampling"] -= t.get("logits", 0.0)
        t["forward/attention_core"] = t.get("forward/attention", 0.0) - t.get("forward/attention_linear", 0.0)
        t["forward/mlp_activation"] = t.get("forward/mlp", 0.0) - t.get("forward/mlp_linear", 0.0)
        step = t.get("step", 0.0) or 1e-12
        n = max(self.counts.get("step", 0), 1)
        return {k: {"ms_per_step": 1000 * v / n, "share": v / step} for k, v in sorted(t.items())}


class _TimedOneCall:
    """The model's one-call forward (pagoda/model/one_stream.py), timed as forward/one_call in the steps it takes
    (it returns None for the others, which run the eager forward and its hooks), and each kind of call inside it
    as forward/one_call/<kind> (timed by the C++ loop)."""

    def __init__(self, inner: Any, profiler: StepProfiler) -> None:
        from pagoda.model.one_stream import OPS

        self.inner, self.profiler, self.ops = inner, profiler, OPS
        self.op_seconds = torch.zeros(len(OPS), dtype=torch.float64)

    def __call__(self, *args: Any) -> Any:
        return self._timed(self.inner, *args)

    def applies(self, meta: Any) -> bool:
        return bool(self.inner.applies(meta))

    def decode_steps(self, *args: Any) -> Any:
        """Several decode steps in one call, timed as one (a step of the engine's)."""
        return self._timed(self.inner.decode_steps, *args)

    def verify(self, *args: Any) -> Any:
        """Draft tokens' rows in one call (speculative decoding)."""
        return self._timed(self.inner.verify, *args)

    @property
    def steps_rows(self) -> int:
        return int(self.inner.steps_rows)

    def _timed(self, call: Any, *args: Any) -> Any:
        start = time.perf_counter()
        out = call(*args, op_seconds=self.op_seconds)
        if out is not None:
            totals = self.profiler.totals
            totals["forward/one_call"] += time.perf_counter() - start
            self.profiler.counts["forward/one_call"] += 1
            for op, seconds in zip(self.ops, self.op_seconds.tolist(), strict=True):
                totals[f"forward/one_call/{op}"] += seconds
        self.op_seconds.zero_()
        return out


def _kind(name: str, module: nn.Module) -> str | None:
    cls = type(module).__name__
    if cls == "Attention":
        return "attention"
    if cls == "MLP":
        return "mlp"
    if cls == "GateUpSiLU":  # packed gate_up weights fused with SiLU-and-multiply
        return "mlp_linear"
    if cls == "NormLinear":  # an RMSNorm and the packed qkv projection, or MLP, after it
        return name.rsplit(".", 1)[-1]  # norm_qkv, norm_mlp
    if isinstance(module, nn.Linear):
        if name == "lm_head":
            return None  # the "logits" phase times it, outside the forward
        return "attention_linear" if ".self_attn." in name else "mlp_linear"
    if cls == "RMSNorm":
        return "norm"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return None


class _NullProfiler(StepProfiler):
    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield


NULL_PROFILER = _NullProfiler()
