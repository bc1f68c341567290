"""The studies' reuse path: cached latent rows served at another position, as the engine serves
them, in plain torch over per-layer row lists (no pool, so attention can be probed).

A row is ``[c_KV | k_r]``. PIC keeps c_KV and rotates k_r by δ = p_target − p_source with the
model's own rotary (:meth:`~irminsul.model.rope.Rotary.rotate`, what the engine's kernel
computes); naive reuse keeps k_r as it was cached.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..model import MLAModel

Rows = list[torch.Tensor]  # per layer [n, kv_lora_rank + qk_rope_head_dim]


def moved(model: MLAModel, rows: Rows, delta: int, *, rotate: bool = True) -> Rows:
    """Rows cached at p_source served at p_source + ``delta``: k_r rotated by δ (PIC), or left as
    cached with ``rotate=False`` (naive reuse); c_KV as cached either way."""
    rank = model.config.kv_lora_rank
    if not rotate or delta == 0:
        return list(rows)
    return [torch.cat([r[:, :rank], model.rotary.rotate(r[:, rank:], delta)], dim=-1)
            for r in rows]


def joined(*parts: Rows | None) -> Rows | None:
    """Per-layer concatenation of row lists (None parts skipped; None if all are)."""
    given = [p for p in parts if p is not None and p[0].shape[0]]
    if not given:
        return None
    return [torch.cat(layer) for layer in zip(*given)]


def prefill(model: MLAModel, tokens: Sequence[int] | np.ndarray, start: int,
            context: Rows | None = None) -> Rows:
    """The rows of ``tokens`` computed at positions start, start+1, ... after ``context`` (the
    rows of positions [0, start), or None for none)."""
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    positions = torch.arange(start, start + ids.shape[0])
    return model.forward(ids, positions, context).latents
