"""Linear layers on oneDNN-packed float32 weights for decode-sized batches (`--prepack-weights`).

With M rows (the requests of a decode step), `F.linear` on a plain float32 weight costs far more than
reading the weight: one step's matmuls took 2.4x longer at 16 rows than at one
(`python -m pagoda.bench.linear_stream`). oneDNN on the same weights reordered once into its blocked
layout ran those matmuls 1.30-1.56x faster at 4-32 rows, about as fast at 64-128, and 0.90x at 1-2 rows.

So each packed layer keeps both copies and picks by the number of rows: the packed weight for
PACKED_ROWS, the plain one otherwise (one stream, prompt chunks). The cost is a second copy of every
float32 linear weight (the tied lm_head included). Results differ from F.linear by float rounding only.
Not combined with --compile-model, whose graph would have to branch on the token count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

PACKED_ROWS = range(3, 97)  # rows (tokens in the step) that use the packed weight; measured, see above


def _packed_forward(layer: nn.Linear, packed: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    linear_pointwise = torch.ops.mkldnn._linear_pointwise

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] in PACKED_ROWS:
            return linear_pointwise(x, packed, layer.bias, "none", [], "")
        return F.linear(x, layer.weight, layer.bias)

    return forward


def prepack_linears(model: nn.Module) -> int:
    """Gives every float32 nn.Linear of the model a oneDNN-packed copy of its weight, used for
    PACKED_ROWS rows; returns the bytes the copies take (0 if oneDNN is unavailable)."""
    if not torch.backends.mkldnn.is_available():
        return 0
    added = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32:
            packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 16)
            module.forward = _packed_forward(module, packed)  # type: ignore[method-assign,assignment]
            added += module.weight.numel() * 4
    return added
