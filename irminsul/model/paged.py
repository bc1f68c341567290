"""What a forward needs to read and write the engine's split pool in place (the GPU path).

The engine allocates the new tokens' slots before the forward; every layer stores its new latent
rows there and attends with the paged kernel (:mod:`irminsul.kernels`) over each request's slot
lists, so cached context is never gathered into per-request tensors. Requests with no context at
all (a fresh prefill) run the naive causal form instead, which is faster without context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..kernels import PagedLayout


@dataclass
class PagedKV:
    """The pool [layers, slots, ·] and this batch's place in it."""

    ckv: torch.Tensor  # [layers, slots, kv_lora_rank]
    kr: torch.Tensor  # [layers, slots, qk_rope_head_dim]
    new_ckv: torch.Tensor  # int64 [T]: c_KV slots of the batch's new tokens, in batch order
    new_kr: torch.Tensor  # int64 [T]: their k_r slots
    layout: PagedLayout | None  # absorbed-form requests (read in place by the kernel), or None
    kernel_tokens: torch.Tensor | None  # batch rows of those requests; None: every row
    # Naive-form requests: batch rows, and the c_KV / k_r slots of their context (None: none).
    naive: list[tuple[slice, torch.Tensor | None, torch.Tensor | None]]

    def store(self, layer: int, rows: torch.Tensor) -> None:
        """Write the new tokens' latent rows [T, rank + rope] of one layer into the pool."""
        rank = self.ckv.shape[2]
        self.ckv[layer].index_copy_(0, self.new_ckv, rows[:, :rank].to(self.ckv.dtype))
        self.kr[layer].index_copy_(0, self.new_kr, rows[:, rank:].to(self.kr.dtype))
