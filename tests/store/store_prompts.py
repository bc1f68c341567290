"""The prompts the store tests serve, and publishing one (plain helpers: importable by a name
no other test directory uses)."""

from __future__ import annotations

import numpy as np

from irminsul.engine import Engine

VOCAB = 8192  # the embedded model's


def documents(seed: int, doc: int = 400) -> tuple[np.ndarray, list[int], np.ndarray, list[int]]:
    """A source prompt (header 40, a document) and a target holding the same document shifted
    (header 75, the document, a question of 20), with resets at the document's edges."""
    rng = np.random.default_rng(seed)
    body = rng.integers(10, VOCAB, doc)
    h1, h2, question = (rng.integers(10, VOCAB, n) for n in (40, 75, 20))
    h2[0] = (h1[0] + 1) % VOCAB  # no exact prefix in common
    source = np.concatenate([h1, body])
    target = np.concatenate([h2, body, question])
    return source, [40], target, [75, 75 + doc]


def publish(engine: Engine, prompt: np.ndarray, resets: list[int], namespace: int = 0) -> None:
    """Serve a prompt on ``engine`` and wait until its chunks are in the store."""
    seq, _ = engine.prefill(prompt, resets, namespace=namespace)
    engine.finish(seq)
    assert engine.cache.store.flush()
