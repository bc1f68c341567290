"""RMSNorm, computed in float32 as the reference implementations do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, with the statistics in float32 and the result in x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel for the statistics; the weight multiplies after the cast, as in the
        # reference code (which rounds the normalised row to x's dtype first).
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
