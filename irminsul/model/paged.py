"""What a forward needs to read and write the engine's split pool in place.

The engine gives the new tokens slots before the forward; every layer stores its new latent rows
there first, then attends. A batch is a list of contiguous spans (a prefill's novel spans, decode
steps), each attending to its sequence's rows up to its last position — so spans of one sequence
see each other's rows within one forward (a sequence split into several spans by reused runs
may attend in one masked call instead, :class:`MaskedSpans`). Short spans run in the paged kernel
(:mod:`irminsul.kernels`, CUDA), which reads the pool in place; the rest — long spans
(``mla.naive_from``: fresh prefills among them), everything where there is no kernel — in torch,
over context gathered from the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from ..kernels import PagedLayout


class MaskedSpans(NamedTuple):
    """One sequence's new tokens, in several spans, attending in one call: every row of the
    sequence up to its last new token gathered from the pool (the new ones stored first), each
    token seeing the rows at or before its position."""

    rows: torch.Tensor  # int64 [n]: the tokens' batch rows
    positions: torch.Tensor  # int64 [n]: their positions
    ckv: torch.Tensor  # int64 [last + 1]: c_KV slots of positions 0..last
    kr: torch.Tensor  # int64 [last + 1]: their k_r slots


@dataclass
class PagedKV:
    """The pool [layers, slots, ·] and this batch's place in it."""

    ckv: torch.Tensor  # [layers, slots, kv_lora_rank]
    kr: torch.Tensor  # [layers, slots, qk_rope_head_dim]
    new_ckv: torch.Tensor  # int64 [T]: c_KV slots of the batch's new tokens, in batch order
    new_kr: torch.Tensor  # int64 [T]: their k_r slots
    layout: PagedLayout | None  # spans the kernel reads in place (absorbed form), or None
    kernel_tokens: torch.Tensor | None  # batch rows of those spans; None: every row
    # Spans attended in torch: batch rows, and the c_KV / k_r slots of their context (None:
    # none), gathered from the pool; the form follows MLAttention's cost rule.
    gathered: list[tuple[slice, torch.Tensor | None, torch.Tensor | None]]
    masked: list[MaskedSpans] = field(default_factory=list)

    def store(self, layer: int, rows: torch.Tensor) -> None:
        """Write the new tokens' latent rows [T, rank + rope] of one layer into the pool."""
        rank = self.ckv.shape[2]
        self.ckv[layer].index_copy_(0, self.new_ckv, rows[:, :rank].to(self.ckv.dtype))
        self.kr[layer].index_copy_(0, self.new_kr, rows[:, rank:].to(self.kr.dtype))
