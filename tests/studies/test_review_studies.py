"""The studies' figures against hand computations on tiny inputs (review of roc and sink)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures.tiny_models import build

from irminsul.model import load_model
from irminsul.studies.attention import AttentionProbe
from irminsul.studies.reuse import prefill
from irminsul.studies.sink import SINK, SinkSettings, anchoring


@pytest.fixture(scope="module")
def peaked(tmp_path_factory: pytest.TempPathFactory):
    """A tiny model whose queries are scaled up, so its heads attend unevenly (random weights
    alone give near-uniform attention, where every averaging order agrees)."""
    directory = tmp_path_factory.mktemp("tiny_peaked")
    build("v2_lite_like", directory, layers=2)
    model = load_model(directory)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
    return model


def test_w_is_the_mean_of_per_head_within_chunk_fractions(peaked) -> None:
    """sink.py defines W(q) per head and layer (first-32 chunk mass / chunk mass) and Table 4's
    cells as W averaged over heads: the mean of each head's ratio, not the ratio of the
    head-averaged masses."""
    rng = np.random.default_rng(0)
    p, n = 40, 64
    chunk = rng.integers(0, 97, n)
    context = prefill(peaked, rng.integers(0, 97, p), 0)
    settings = SinkSettings(positions=(p,), chunk_tokens=n)
    got = anchoring(peaked, None, settings, chunk[None], [context], bos=0)
    with AttentionProbe(peaked) as probe:
        prefill(peaked, chunk, p, context)
    for layer, probs in enumerate(probe.layers):
        probs = probs.double()  # [heads, T, p + T]
        per_head = probs[..., p:p + SINK].sum(-1) / probs[..., p:].sum(-1)
        want = per_head.mean(0).numpy()
        pooled = (probs[..., p:p + SINK].sum(-1).mean(0) / probs[..., p:].sum(-1).mean(0)).numpy()
        assert np.abs(want - pooled)[SINK:].max() > 1e-3  # the two orders differ here
        np.testing.assert_allclose(got.W[0, 0, layer], want, atol=1e-5)
        np.testing.assert_allclose(got.S[0, 0, layer],
                                   probs[..., :SINK].sum(-1).mean(0).numpy(), atol=1e-5)


def test_sink_refuses_a_negative_repair_head() -> None:
    """``--repair-head -3`` made the pic_head path compute body[:-3] (all but the last three
    tokens) in place and report it as EPIC at k = -3; the engine's recompute_head refuses it."""
    with pytest.raises(ValueError, match="repair_head must be >= 0, got -3"):
        SinkSettings(repair_head=-3).check(2)
