"""Our MLA runtime against transformers' DeepseekV2/V3 on tiny random checkpoints (fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.tiny_models import CASES, build

from irminsul.model import load_model

TOL = 1e-4


@pytest.fixture(scope="module", params=[*CASES, "v2_lite_like:legacy", "v3_like:legacy"])
def pair(request, tmp_path_factory):
    name, _, legacy = request.param.partition(":")
    directory = tmp_path_factory.mktemp(request.param.replace(":", "_"))
    reference = build(name, directory, legacy=bool(legacy))
    if legacy:
        raw = json.loads((directory / "config.json").read_text())
        assert "rope_parameters" not in raw and "rope_theta" in raw
    return reference, load_model(directory)


def _ids(n: int = 48) -> torch.Tensor:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(1))


def test_logits_equal_transformers(pair) -> None:
    reference, ours = pair
    ids = _ids()
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    got = ours.logits(ids)
    assert expected.abs().max() > 0.5  # a test that can fail: outputs are not near zero
    assert (got - expected).abs().max() <= TOL


def test_incremental_decode_equals_full_forward(pair) -> None:
    """Prefill 30 tokens, then decode one at a time against the cached latent rows."""
    _, ours = pair
    ids = _ids()
    full = ours.logits(ids)
    first = ours.forward(ids[:30], torch.arange(30))
    context, outs = first.latents, [first.logits]
    for t in range(30, ids.shape[0]):
        step = ours.forward(ids[t:t + 1], torch.tensor([t]), context)
        outs.append(step.logits)
        context = [torch.cat([c, r]) for c, r in zip(context, step.latents)]
    assert (torch.cat(outs) - full).abs().max() <= TOL


def test_absorbed_equals_naive(pair) -> None:
    """Both attention forms, fresh prefill and against context of several lengths."""
    _, ours = pair
    ids = _ids()
    naive = ours.forward(ids, torch.arange(ids.shape[0]), absorbed=False).logits
    absorbed = ours.forward(ids, torch.arange(ids.shape[0]), absorbed=True).logits
    assert (naive - absorbed).abs().max() <= TOL
    # Context shorter than the segment (the naive form squares the mask) and longer (a
    # lower-right bias).
    for cut in (10, 24, 40):
        head = ours.forward(ids[:cut], torch.arange(cut))
        tail = ids[cut:], torch.arange(cut, 48), head.latents
        tail_abs = ours.forward(*tail, absorbed=True).logits
        tail_naive = ours.forward(*tail, absorbed=False).logits
        assert (tail_abs - tail_naive).abs().max() <= TOL
        assert (tail_abs - naive[cut:]).abs().max() <= TOL


def test_single_token_decode_both_forms(pair) -> None:
    """One new token after context (the decode shape, which runs without a mask) gives the full
    forward's logits in both attention forms."""
    _, ours = pair
    ids = _ids()
    full = ours.logits(ids)
    head = ours.forward(ids[:-1], torch.arange(47))
    for absorbed in (True, False):
        step = ours.forward(ids[-1:], torch.tensor([47]), head.latents, absorbed=absorbed)
        assert (step.logits[0] - full[-1]).abs().max() <= TOL
