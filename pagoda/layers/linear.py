"""Linear layers on oneDNN-packed weights for decode-sized batches (`--prepack-weights`; by default for
bfloat16 models whose packed copy takes at most PREPACK_AUTO_MAX_BYTES).

With M rows (the requests of a decode step), `F.linear` on a plain weight costs far more than reading
the weight. oneDNN on the same weights reordered once into its blocked layout does better, by dtype
(`python -m pagoda.bench.linear_stream [--dtype bfloat16]`, one step's matmuls, BENCHMARKS.md):
  - float32: 1.30-1.56x faster at 4-32 rows, about as fast at 64-128, 0.90x at 1-2 rows;
  - bfloat16: 1.08-1.73x at 1-1,024 rows, but 0.61x at 2,048 (a full prompt-chunk step).

So each packed layer keeps both copies and picks by the number of rows: the packed weight for
PACKED_ROWS[dtype], the plain one otherwise (one float32 stream, large prompt chunks). The cost is a
second copy of every linear weight (the tied lm_head included). Results differ from F.linear by float
rounding only. Not combined with --compile-model, whose graph would have to branch on the token count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# rows (tokens in the step) that use the packed weight, per weight dtype; measured, see above
PACKED_ROWS: dict[torch.dtype, range] = {torch.float32: range(3, 97), torch.bfloat16: range(1, 1025)}


def _packed_forward(layer: nn.Linear, packed: torch.Tensor, rows: range) -> Callable[[torch.Tensor], torch.Tensor]:
    linear_pointwise = torch.ops.mkldnn._linear_pointwise

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] in rows:
            return linear_pointwise(x, packed, layer.bias, "none", [], "")
        return F.linear(x, layer.weight, layer.bias)

    return forward


# `prepack_weights` left to the engine (None) packs bfloat16 models whose copy takes at most this much: the
# 128-request workload ran 1.23x and 1.31x faster end to end with the default model (+270 MB), while larger
# models' copies cost more memory for a share of the step that was not measured (BENCHMARKS.md).
PREPACK_AUTO_MAX_BYTES = 1 << 30


def should_prepack(model: nn.Module, dtype: torch.dtype, asked: bool | None, compile_model: bool) -> bool:
    """Whether the engine packs the model's linears: as asked, or by default (asked is None) for bfloat16
    models whose copy fits PREPACK_AUTO_MAX_BYTES, except with compile_model (whose graph cannot branch on
    the token count)."""
    if asked is not None:
        return asked
    if dtype != torch.bfloat16 or compile_model or not torch.backends.mkldnn.is_available():
        return False
    copy = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, nn.Linear) and m.weight.dtype in PACKED_ROWS)
    return copy <= PREPACK_AUTO_MAX_BYTES


def prepack_linears(model: nn.Module) -> tuple[int, range | None]:
    """Gives every float32 or bfloat16 nn.Linear of the model a oneDNN-packed copy of its weight, used for
    PACKED_ROWS[dtype] rows; returns the bytes the copies take and the rows they serve ((0, None) if
    oneDNN is unavailable or no layer has a packable dtype)."""
    if not torch.backends.mkldnn.is_available():
        return 0, None
    added, used = 0, None
    for module in model.modules():
        if isinstance(module, nn.Linear) and (rows := PACKED_ROWS.get(module.weight.dtype)) is not None:
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 16)
            module.forward = _packed_forward(module, packed, rows)  # type: ignore[method-assign,assignment]
            added += module.weight.numel() * module.weight.element_size()
            used = rows
    return added, used
