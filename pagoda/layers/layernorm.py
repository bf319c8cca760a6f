"""RMSNorm, computed in float32 (or wider) as HF does, with the residual add before it."""

from __future__ import annotations

import torch

from pagoda.layers.elementwise import ElementwiseOps


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float, ops: ElementwiseOps | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops or ElementwiseOps()  # the model's: torch ops, or fused C++ once enabled

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """h = residual + x (or x) -> (the normalized h, h). h may be residual, updated in place."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
