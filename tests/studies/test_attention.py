"""The attention probabilities the sink study reads, against transformers' eager attention
(plain softmax over q·k, computed by the reference implementation from the same weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures.tiny_models import build

from irminsul.model import load_model
from irminsul.studies.attention import AttentionProbe
from irminsul.studies.reuse import prefill
from irminsul.studies.sink import SINK, probe, sink_mass

T = 48  # > SINK, so the mass to [0, SINK) is a proper part of the keys


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    directory = tmp_path_factory.mktemp("tiny")
    reference = build("v2_lite_like", directory, layers=2)
    reference.config._attn_implementation = "eager"
    return reference, load_model(directory)


def _reference_attention(reference, ids: np.ndarray) -> list[torch.Tensor]:
    with torch.no_grad():
        out = reference(input_ids=torch.from_numpy(ids)[None], output_attentions=True)
    return [a[0].float() for a in out.attentions]  # per layer [heads, T, T]


def test_fresh_prefill_probabilities_match_reference(models: tuple) -> None:
    reference, ours = models
    ids = np.random.default_rng(0).integers(0, 97, T)
    expected = _reference_attention(reference, ids)
    with AttentionProbe(ours) as attention:
        prefill(ours, ids, 0)
    assert len(attention.layers) == len(expected) == 2
    for got, want in zip(attention.layers, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_sink_mass_after_context_matches_reference(models: tuple) -> None:
    """A tail computed after cached context rows (the study's fresh path) sees what a full
    prefill's last queries see."""
    reference, ours = models
    ids = np.random.default_rng(1).integers(0, 97, T)
    split = 40
    context = prefill(ours, ids[:split], 0)
    masses = probe(ours, ids[split:], split, context, sink_mass)
    for got, want in zip(masses, _reference_attention(reference, ids)):
        expected = want[:, split:, :SINK].sum(-1)
        assert 0.05 < float(expected.mean()) < 0.95  # a real part of the attention
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
