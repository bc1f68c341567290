"""RMSNorm, computed in float32 as the reference implementations do."""

from __future__ import annotations

from dataclasses import dataclass

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
        # One fused op, statistics in float32 (its accumulation type for half inputs). The
        # reference code rounds the normalised row to x's dtype before the weight multiplies;
        # here the product is rounded once, which differs by at most one bf16 ulp.
        return F.rms_norm(x, self.weight.shape, self.weight.to(x.dtype), self.eps)


@dataclass
class PendingNorm:
    """A residual add and RMSNorm not yet applied to a layer's input: the input is
    ``norm(x + delta)`` for the residual stream x, and ``summed`` receives ``x + delta``, the
    stream after the add. The launch that reads the input applies both
    (:func:`~irminsul.kernels.gemv.normed_gemv`): one launch fewer a decode layer."""

    delta: torch.Tensor  # [T, D], or [T, J, D] terms summed first (a MoE's outputs)
    norm: RMSNorm
    summed: torch.Tensor  # [T, D], contiguous
