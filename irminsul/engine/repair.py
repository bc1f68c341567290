"""Repair on the latent: which reused tokens of a prompt are computed instead of reused.

A reused row was computed after another prompt's context. Its c_KV at layer 0 depends on the
token alone (and k_r, rotated by δ, on token and position), so it is exact; from layer 1 on it
carries that other context. Repair computes some reused tokens in this prompt's context after
all; the rest stay reused. Two rules, both :class:`~irminsul.config.CacheConfig` knobs, both
applied to the plan's stretches before anything is served (so admission counts what they
compute):

* **heads** (``recompute_head`` = k, EPIC-style): the first k tokens of every reused run, where a
  run's rows differ most from what this context would give, having attended to another prefix.
* **deviating** (``recompute_share`` = r, CacheBlend-style on c_KV): the share r of the reused
  tokens whose c_KV at layer ``recompute_check_layer`` (1) deviates most from a fresh
  computation. :class:`LatentCheck` runs the check forward: the prompt up to its last reused
  token through the layers below the check layer, from scratch — exact, since every row below
  layer 1 is a function of token and position, and ``1/num_layers`` of a fresh prefill at the
  default layer — and takes the L2 distance between each reused token's fresh c_KV at the check
  layer and the cached one it would be served. The tokens with the largest distances, ``floor(r ·
  reused)`` of them, are computed.
* **signed** (``recompute_rule`` "signed", the same share): :class:`SignedCheck` runs the same
  check forward over the whole prompt and, at each layer 1 .. ``recompute_check_layer``, the
  attention of the prompt's tail (its tokens after the last reused one, computed fresh when
  served) over the served rows against over the fresh ones; each reused token is scored by the
  first-order drop of that error when its fresh c_KV replaces the cached one. Reused tokens'
  errors partly offset each other: recomputing a token whose error offsets the others' raises
  the output's error, which the size of its deviation cannot tell.
* **recent** (``recompute_rule`` "recent", the same share): :func:`nearest_the_end` ranks the
  reused tokens by position, so the share computed is the reused tokens nearest the prompt's
  end: the rows the prompt's tail and the reply attend to at the shortest distance. No check
  forward: it costs only the tokens it computes. With ``recompute_head`` the two take different
  rows, each run's first tokens and the last runs' ends (docs/quality.md measures both).
* **budget** (``recompute_budget`` = b): at most the share b of the reused tokens is computed,
  all rules together. The share's tokens are kept; the heads shrink (:func:`heads_within`) to
  what the budget leaves them. A prompt of many short runs (re-ranked documents) would
  otherwise compute k tokens of each: 15.7% of rerank's reused tokens at k = 32 + 5% recent.

The stretches are the cache manager's ``[kind, start, end, hits]`` lists (kind "prefix",
"derived", "reuse" or "compute"; a reuse's hits are the plan's segments it serves, trimmed to
its tokens). The deviating rule also takes the derived prefix's rows as candidates: an earlier
turn's reused rows, matched in the radix tree, carry that turn's approximation into this one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..cache.plan import Segment
from ..device import upload
from ..model import MLAModel
from .kv_pool import unpack

# (prompt, reused positions, their cached c_KV slots) -> one deviation per position
Deviation = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def recompute_heads(stretches: list[list], k: int) -> list[list]:
    """The first ``k`` tokens of every reused run computed instead (EPIC's repair), the rest
    still reused. A reuse stretch fuses consecutive hits; a run is the hits that continue one
    another in their source too (one δ): where δ changes, the next hit's rows were computed
    after another context, and a run starts there."""
    out: list[list] = []
    for kind, start, end, hits in stretches:
        if kind != "reuse":
            if kind == "compute" and out and out[-1][0] == "compute" and out[-1][2] == start:
                out[-1][2] = end
            else:
                out.append([kind, start, end, hits])
            continue
        for run in _runs(hits):
            first, last = run[0].start, run[-1].end
            cut = min(last, first + k)
            if out and out[-1][0] == "compute" and out[-1][2] == first:
                out[-1][2] = cut
            else:
                out.append(["compute", first, cut, []])
            if cut < last:
                out.append(["reuse", cut, last, _trimmed(run, cut, last)])
    return out


def heads_within(stretches: list[list], k: int, cap: int) -> int:
    """The largest k' <= ``k`` whose heads (:func:`recompute_heads`) compute at most ``cap``
    tokens (0 where even one token a run is more)."""
    lengths = np.array([run[-1].end - run[0].start for kind, _, _, hits in stretches
                        if kind == "reuse" for run in _runs(hits)], dtype=np.int64)
    for head in range(k, 0, -1):  # k is tens of tokens: a plain scan
        if int(np.minimum(lengths, head).sum()) <= cap:
            return head
    return 0


def reused_count(stretches: list[list]) -> int:
    """The tokens the plan serves from earlier rows: its reuse and derived stretches (the share
    rules' candidates, :func:`reused_rows` given the prefix)."""
    return sum(end - start for kind, start, end, _ in stretches if kind in ("reuse", "derived"))


def _runs(hits: list[Segment]) -> list[list[Segment]]:
    """Consecutive hits split where one does not continue the one before in its source: a
    gap in the prompt or another δ."""
    runs: list[list[Segment]] = []
    for hit in hits:
        if runs and runs[-1][-1].end == hit.start and runs[-1][-1].delta == hit.delta:
            runs[-1].append(hit)
        else:
            runs.append([hit])
    return runs


def recompute_deviating(stretches: list[list], prompt: np.ndarray, share: float,
                        deviation: Deviation, prefix: np.ndarray | None = None) -> list[list]:
    """The ``floor(share · reused)`` reused tokens with the largest ``deviation`` computed
    instead (CacheBlend's selection, on c_KV); ties go to the earlier position. ``prefix``: the
    radix match's handles, whose "derived" stretches (an earlier turn's reused rows) are
    candidates too: they carry that turn's approximation into this one."""
    positions, slots = reused_rows(stretches, prefix)
    if int(share * positions.size) == 0:
        return stretches
    return recompute_at(stretches, positions[most_deviating(
        deviation(prompt, positions, slots), share)])


def nearest_the_end(prompt: np.ndarray, positions: np.ndarray,
                    ckv_slots: np.ndarray) -> np.ndarray:
    """The "recent" rule's ranking (a :data:`Deviation` that reads no row): each reused
    position scores its position, so :func:`most_deviating` picks the last ones."""
    return np.asarray(positions, dtype=np.float64)


def most_deviating(scores: np.ndarray, share: float) -> np.ndarray:
    """The indices of the ``floor(share · n)`` largest of ``scores``, ties to the earlier index
    (a stable sort keeps equal scores in position order)."""
    scores = np.asarray(scores, dtype=np.float64)
    return np.argsort(-scores, kind="stable")[:int(share * scores.size)]


def reused_rows(stretches: list[list], prefix: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """The positions the reuse stretches (and, given the radix match's handles ``prefix``, the
    derived stretches) serve and the c_KV slots of the rows they serve there."""
    positions, slots = [], []
    for kind, start, end, hits in stretches:
        if kind == "derived" and prefix is not None:
            positions.append(np.arange(start, end))
            slots.append(unpack(prefix[start:end])[0])
        if kind != "reuse":
            continue
        for hit in hits:
            positions.append(np.arange(hit.start, hit.end))
            slots.append(unpack(hit.entry.handles[hit.offset:hit.offset + hit.size])[0])
    if not positions:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(positions), np.concatenate(slots)


def recompute_at(stretches: list[list], picked: np.ndarray) -> list[list]:
    """The stretches with the reused tokens at ``picked`` positions computed instead: each
    reuse stretch split around them, computed neighbours fused into one stretch."""
    picked = np.unique(np.asarray(picked, dtype=np.int64))
    out: list[list] = []

    def add(kind: str, start: int, end: int, hits: list[Segment]) -> None:
        if start >= end:
            return
        if kind == "compute" and out and out[-1][0] == "compute" and out[-1][2] == start:
            out[-1][2] = end
        else:
            out.append([kind, start, end, hits])

    for kind, start, end, hits in stretches:
        lo, hi = np.searchsorted(picked, [start, end])
        if kind not in ("reuse", "derived") or lo == hi:
            add(kind, start, end, hits)
            continue
        inside = picked[lo:hi]
        cursor = start
        for run in np.split(inside, np.flatnonzero(np.diff(inside) != 1) + 1):
            first, stop = int(run[0]), int(run[-1]) + 1
            add(kind, cursor, first, _trimmed(hits, cursor, first))
            add("compute", first, stop, [])
            cursor = stop
        add(kind, cursor, end, _trimmed(hits, cursor, end))
    return out


def _trimmed(hits: list[Segment], start: int, end: int) -> list[Segment]:
    """The hits' parts within prompt tokens [start, end); each keeps its δ (start and offset
    move together)."""
    return [h._replace(start=max(h.start, start), end=min(h.end, end),
                       offset=h.offset + max(0, start - h.start))
            for h in hits if h.start < end and h.end > start]


def check_layer_fits(layers: int, layer: int, name: str = "recompute_check_layer") -> None:
    """Refuse a check layer (the setting ``name``) that a model of ``layers`` layers has no
    layer for, or none below: layer 0's c_KV depends on no context, so 1 is the first."""
    if not 1 <= layer < layers:
        raise ValueError(f"{name} must be in [1, {layers - 1}] for a model of {layers} "
                         f"layers, got {layer}")


def _fresh_layers(model: MLAModel, tokens: np.ndarray, layers: int,
                  device: torch.device) -> list[torch.Tensor]:
    """The residual stream [T, D] of ``tokens`` from position 0 before each of the first
    ``layers`` + 1 layers, computed from scratch (no cached row is read)."""
    body = model.model
    at = torch.arange(len(tokens), device=device)
    x = body.embed_tokens(upload(tokens, device))
    stream = [x]
    for layer in body.layers[:layers]:
        x, _ = layer(x, at, [None], [len(tokens)], None)
        stream.append(x)
    return stream


class LatentCheck:
    """The check forward of CacheBlend-style repair: reused tokens' fresh c_KV at one layer,
    against the cached c_KV the pool would serve them."""

    def __init__(self, model: MLAModel, ckv: torch.Tensor, layer: int = 1) -> None:
        """``ckv``: the pool's c_KV rows [layers, slots, kv_lora_rank]; ``layer``: the check
        layer (1 is the first whose c_KV depends on context)."""
        check_layer_fits(model.config.num_hidden_layers, layer)
        self.model, self.ckv, self.layer = model, ckv, layer
        self.depth = layer  # the layers its forward runs whole: 0 .. layer − 1

    @torch.inference_mode()
    def __call__(self, prompt: np.ndarray, positions: np.ndarray,
                 ckv_slots: np.ndarray) -> np.ndarray:
        """‖fresh c_KV − cached c_KV‖₂ at the check layer for each reused position (float64)."""
        device = self.ckv.device
        length = int(positions.max()) + 1
        x = _fresh_layers(self.model, prompt[:length], self.layer, device)[-1]
        check = self.model.model.layers[self.layer]
        where = upload(positions, device)
        fresh = check.self_attn.latent(check.input_layernorm(x[where]), where)
        fresh = fresh[:, :self.ckv.shape[2]].float()
        cached = self.ckv[self.layer, upload(ckv_slots, device)].float()
        return torch.linalg.vector_norm(fresh - cached, dim=-1).double().cpu().numpy()


class SignedCheck:
    """The check forward of sign-aware repair (``recompute_rule`` "signed"): each reused token's
    first-order effect on the error of the prompt tail's attention output, summed over layers
    1 .. ``layers``."""

    def __init__(self, model: MLAModel, ckv: torch.Tensor, layers: int = 1,
                 tail: int = 16) -> None:
        """``ckv``: the pool's c_KV rows [layers, slots, kv_lora_rank]; ``layers``: the check
        layers 1 .. layers; ``tail``: the prompt's last tokens whose attention is compared (at
        most this many, all after the last reused one where the prompt has them)."""
        check_layer_fits(model.config.num_hidden_layers, layers)
        self.model, self.ckv, self.layers, self.tail = model, ckv, layers, tail
        self.depth = layers  # the layers its forward runs whole: 0 .. layers − 1

    def __call__(self, prompt: np.ndarray, positions: np.ndarray,
                 ckv_slots: np.ndarray) -> np.ndarray:
        """Per reused position (float64), larger first: the drop, to first order, of
        Σ_layers ‖out(served) − out(fresh)‖² / ‖out(fresh)‖² when its fresh c_KV replaces the
        cached one, ``out`` the tail's attention output over the rows before it (served: each
        reused token's cached c_KV, every other row fresh). Reused positions inside the tail
        (a prompt ending in reused tokens) score −inf: the tail's own rows are fresh here."""
        device, rank = self.ckv.device, self.ckv.shape[2]
        length = len(prompt)
        start = min(max(int(positions.max()) + 1, length - self.tail), length - 1)
        before = positions < start
        where = upload(positions[before], device)
        slots = upload(ckv_slots[before], device)
        at = torch.arange(length, device=device)
        with torch.inference_mode():
            stream = _fresh_layers(self.model, prompt, self.layers, device)
        drop = torch.zeros(int(before.sum()), dtype=torch.float64, device=device)
        for index in range(1, self.layers + 1):
            attn = self.model.model.layers[index].self_attn
            with torch.inference_mode():
                h = self.model.model.layers[index].input_layernorm(stream[index])
                fresh = attn.latent(h[:start], at[:start]).float()
                reference, _ = attn(h[start:], at[start:], [fresh.to(h.dtype)],
                                    [length - start])
            # Inference tensors cannot take part in autograd: plain copies of what it reads.
            h, fresh, reference = h.clone(), fresh.clone(), reference.float()
            cached = self.ckv[index, slots].float()
            served = fresh.clone()
            served[where, :rank] = cached
            served.requires_grad_(True)
            with torch.enable_grad():
                out, _ = attn(h[start:], at[start:], [served.to(h.dtype)], [length - start])
                error = (out.float() - reference).pow(2).sum() / reference.pow(2).sum()
                (grad,) = torch.autograd.grad(error, served)
            # Replacing cached by fresh moves the served row by (fresh − cached).
            drop -= (grad[where, :rank] * (fresh[where, :rank] - cached)).sum(-1).double()
        scores = np.full(len(positions), -np.inf)
        scores[before] = drop.cpu().numpy()
        return scores
