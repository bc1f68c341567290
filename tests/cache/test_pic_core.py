"""The algebraic core of position-independent caching, end to end through the planner.

In a one-layer model a token's latent row depends on the token and its position only, so KV built
from chunks prefilled elsewhere and re-rotated by δ must give exactly the logits of recomputation;
reusing the same rows without rotation must not.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from fixtures.tiny_models import build

from irminsul.cache.planner import Planner
from irminsul.config import ALGORITHM1
from irminsul.model import load_model


def _serve(model, planner: Planner, store: list[torch.Tensor], tokens: np.ndarray,
           resets: list[int], rotate: bool) -> tuple[torch.Tensor, int]:
    """Serve a prompt like an engine would: reused rows from the store (k_r rotated by δ unless
    ``rotate`` is False), everything else prefilled against the rows before it. Returns the
    logits of the last prefilled segment and how many tokens were reused."""
    plan = planner.plan(tokens, resets)
    rank = model.config.kv_lora_rank
    rows = torch.zeros(tokens.size, model.config.latent_dim)
    handles = np.zeros(tokens.size, dtype=np.int64)
    logits = None
    for seg in plan.segments:
        span = slice(seg.start, seg.end)
        if seg.kind in ("prefix", "hit"):
            src = (plan.prefix.handles if seg.kind == "prefix"
                   else seg.entry.handles[seg.offset:seg.offset + seg.size])
            reused = torch.stack([store[h] for h in src.tolist()])
            if seg.kind == "hit" and rotate:
                reused = torch.cat([reused[:, :rank], model.rotary.rotate(reused[:, rank:],
                                                                          seg.delta)], dim=1)
            rows[span] = reused
            handles[span] = src
        else:
            out = model.forward(torch.from_numpy(tokens[span].astype(np.int64)),
                                torch.arange(seg.start, seg.end), [rows[:seg.start]])
            rows[span] = out.latents[0]
            handles[span] = np.arange(len(store), len(store) + seg.size)
            store.extend(out.latents[0])
            logits = out.logits
    planner.commit(plan, handles)
    return logits, plan.tokens_of("hit")


@pytest.mark.parametrize("case", ["v2_lite_like", "v3_like"])
def test_shifted_reuse_with_rotation_equals_recomputation(case: str, tmp_path) -> None:
    build(case, tmp_path, layers=1)
    model = load_model(tmp_path)
    rng = np.random.default_rng(0)
    doc_a, doc_b = rng.integers(0, 97, 300), rng.integers(0, 97, 250)
    question = rng.integers(0, 97, 24)
    # Source prompt: header, A, B. Target: a longer header, B, A (reordered, shifted), question.
    source = np.concatenate([rng.integers(0, 97, 40), doc_a, doc_b])
    target = np.concatenate([rng.integers(0, 97, 75), doc_b, doc_a, question])
    resets_source = [40, 340]
    resets_target = [75, 325, 625]
    expected = model.logits(torch.from_numpy(target))[625:]
    for rotate, should_match in ((True, True), (False, False)):
        planner, store = Planner(replace(ALGORITHM1, s1=False)), []
        _serve(model, planner, store, source, resets_source, rotate)
        logits, reused = _serve(model, planner, store, target, resets_target, rotate)
        assert reused >= 0.9 * (doc_a.size + doc_b.size)  # the documents really were reused
        err = float((logits - expected).abs().max())
        if should_match:
            assert err <= 1e-5
        else:
            assert err > 1e-3  # naive reuse (no δ-rotation) is measurably wrong
