"""Review tests for repair (recompute_head / recompute_share) and heal, each against an
independent expectation built without the code under test."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.tiny_models import build

from irminsul.config import CacheConfig, EngineConfig
from irminsul.engine import Engine
from irminsul.model import load_model

V = 97

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model3(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v3_3layer_review_repair")
    build("v3_like", directory, layers=3)
    return load_model(directory)


def reordered_docs(seed: int):
    """Source: header 40, doc A 300, doc B 250; target: header 75, doc B, doc A, question 24
    (resets at document starts): B and A are reused back to back, each from its own place in
    the source (two rotations, two contexts)."""
    rng = np.random.default_rng(seed)
    doc_a, doc_b = rng.integers(0, V, 300), rng.integers(0, V, 250)
    h1, h2 = rng.integers(0, V, 40), rng.integers(0, V, 75)
    h2[0] = (h1[0] + 1) % V
    question = rng.integers(0, V, 24)
    source = np.concatenate([h1, doc_a, doc_b])
    target = np.concatenate([h2, doc_b, doc_a, question])
    return source, [40, 340], target, [75, 325, 625]


def computed_positions(prefill) -> set[int]:
    return {p for kind, start, end, _ in prefill.stretches if kind == "compute"
            for p in range(start, end)}


def test_heads_recompute_the_head_of_each_document_reused_back_to_back(model3) -> None:
    """recompute_head=k computes the first k tokens of every reused run: doc B (reused from
    source position 340 on) and doc A (from 40 on), adjacent in the target but each computed
    after another context in the source, are two runs, so both heads are computed (EPIC
    recomputes the head of each reused chunk), not just B's."""
    source, rs, target, rt = reordered_docs(4)
    k = 16
    engine = Engine(model3, EngineConfig(slots=4000, mode="live",
                                         cache=CacheConfig(recompute_head=k)))
    seq, _ = engine.prefill(source, rs)
    engine.finish(seq)
    prefill = engine.start_prefill(target, rt)
    # By hand: header and question computed; B's head at 75, A's head at 325.
    want = set(range(0, 75 + k)) | set(range(325, 325 + k)) | set(range(625, len(target)))
    assert computed_positions(prefill) == want
    while (span := engine.advance(prefill, prefill.prompt.size)) is not None:
        engine.run_batch([(prefill.seq, *span)])
    engine.complete_prefill(prefill)
    stats = prefill.seq.stats
    assert stats.pic_tokens == 550 - 2 * k
    assert stats.prefilled_tokens == len(target) - stats.pic_tokens
    engine.finish(prefill.seq)
    engine.check()


def test_share_counts_only_tokens_the_plan_reuses_when_the_prompt_ends_reused(model3) -> None:
    """A prompt that ends inside a reused document: its last token is computed whatever
    serves it (its logits start the generation), so the unrepaired plan reuses one token
    less than its hits cover. recompute_share=r computes floor(r · reused) of the tokens it
    reuses, so that pic_tokens drops by exactly that much (as when the prompt ends computed),
    and no pick goes to the last token."""
    source, rs, target, rt = reordered_docs(4)
    target, rt = target[:625], rt[:2]  # header, B, A: ends inside A
    counts = []
    for share in (0.0, 0.1):
        engine = Engine(model3, EngineConfig(slots=4000, mode="live",
                                             cache=CacheConfig(recompute_share=share)))
        seq, _ = engine.prefill(source, rs)
        engine.finish(seq)
        seq, _ = engine.prefill(target, rt)
        counts.append(seq.stats.pic_tokens)
        engine.finish(seq)
        engine.check()
    assert counts[0] == 550 - 1
    assert counts[1] == counts[0] - int(0.1 * counts[0])
