"""The attention probabilities of a forward's new tokens, per layer, read off the running model.

The runtime never forms attention probabilities (SDPA fuses them away), so :class:`AttentionProbe`
hooks each layer's attention and recomputes them from the same inputs: the queries (the layer's own
projection and RoPE), the context's latent rows and the new tokens' rows, scored in the absorbed
form softmax(scale · (W_UKᵀ q_nope · c_KV + q_r · k_r)) with the causal mask aligned to the last
key — the scores both forms of :class:`~irminsul.model.mla.MLAttention` compute. The forward itself
runs unchanged, so what the layers pass on is the runtime's own output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..model import MLAModel
from ..model.mla import MLAttention


def attention_probabilities(attn: MLAttention, x: torch.Tensor, positions: torch.Tensor,
                            context: torch.Tensor | None) -> torch.Tensor:
    """float32 [heads, T, C + T]: the attention of T new tokens (normed hidden states ``x``
    [T, D] at ``positions``) over ``context`` [C, L+R] followed by their own rows."""
    q_nope, q_rope = attn._query(x, positions)  # the layer's own query path, RoPE included
    rows = attn.latent(x, positions)
    keys = rows if context is None else torch.cat([context.to(rows.dtype), rows])
    c, k_r = keys.float().split([attn.rank, attn.rope_dim], dim=-1)
    w_uk, _ = attn._weights()
    q_latent = torch.einsum("thp,hpl->htl", q_nope.float(), w_uk.float())
    scores = (q_latent @ c.T + q_rope.float().transpose(0, 1) @ k_r.T) * attn.scale
    n_new, n_ctx = x.shape[0], keys.shape[0] - x.shape[0]
    visible = torch.ones(n_new, keys.shape[0], dtype=torch.bool, device=x.device).tril(n_ctx)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)


class AttentionProbe:
    """``with AttentionProbe(model) as probe: model.forward(...)`` records ``probe.layers``: one
    float32 [heads, T, C + T] per layer for the forward's new tokens (one sequence per forward;
    the last forward's probabilities), or what ``reduce`` makes of it — a large model's full
    probabilities for a few thousand keys would not fit, their sums over key ranges do."""

    def __init__(self, model: MLAModel,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.model = model
        self.reduce = reduce
        self.layers: list[torch.Tensor] = []
        self._handles: list[Any] = []

    def __enter__(self) -> AttentionProbe:
        for layer in self.model.model.layers:
            self._handles.append(layer.self_attn.register_forward_pre_hook(
                self._record, with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _record(self, attn: nn.Module, args: tuple, kwargs: dict) -> None:
        x, positions, contexts, lengths = args
        if len(lengths) != 1:
            raise ValueError("AttentionProbe reads one sequence per forward")
        if attn.layer == 0:
            self.layers = []
        probabilities = attention_probabilities(attn, x, positions, contexts[0])
        self.layers.append(probabilities if self.reduce is None else self.reduce(probabilities))
