"""One live-PIC serving scenario, for tests that run it on two engine configurations (kernels or
not, graphs or not) and compare what each served."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from irminsul.engine import Engine, SamplingParams, Scheduler


@dataclass
class Served:
    pic_tokens: int  # the target's tokens served from the registry
    last: torch.Tensor  # the target's last-token logits
    steps: torch.Tensor  # logits of three tokens appended to it
    outs: list[list[int]]  # greedy tokens of the scheduler's requests


def serve_shifted(engine: Engine, *, seed: int, headers: tuple[int, int], docs: tuple[int, int],
                  question: int, requests: Callable[[np.ndarray, np.ndarray, np.ndarray],
                                                    list[np.ndarray]],
                  batch_tokens: int, chunk_tokens: int, max_tokens: int) -> Served:
    """A source (header, doc A, doc B) served, then a target (another header, B, A, a question)
    reusing both documents shifted, three tokens appended to it, then ``requests(source, target,
    doc A)`` batched by a scheduler; the engine's accounting checked at the end."""
    rng = np.random.default_rng(seed)
    doc_a, doc_b = rng.integers(0, 97, docs[0]), rng.integers(0, 97, docs[1])
    source = np.concatenate([rng.integers(0, 97, headers[0]), doc_a, doc_b])
    target = np.concatenate([rng.integers(0, 97, headers[1]), doc_b, doc_a,
                             rng.integers(0, 97, question)])
    seq, _ = engine.prefill(source, [headers[0], headers[0] + docs[0]])
    engine.finish(seq)
    seq, last = engine.prefill(target, [headers[1], headers[1] + docs[1], target.size - question])
    steps = engine.extend(seq, [int(last.argmax()), 5, 7])
    engine.finish(seq)
    scheduler = Scheduler(engine, batch_tokens=batch_tokens, chunk_tokens=chunk_tokens)
    ids = [scheduler.add(p, SamplingParams(max_tokens=max_tokens))
           for p in requests(source, target, doc_a)]
    outs: dict[int, list[int]] = {i: [] for i in ids}
    while scheduler.has_work():
        for out in scheduler.step():
            outs[out.request_id] += out.new_tokens
    engine.check()
    return Served(seq.stats.pic_tokens, last.cpu(), steps.cpu(), list(outs.values()))


def assert_same(got: Served, want: Served, tol: float) -> None:
    """Same reuse, logits within ``tol`` of the largest, the same greedy tokens."""
    assert got.pic_tokens == want.pic_tokens
    assert (got.last - want.last).abs().max() <= tol * want.last.abs().max()
    assert (got.steps - want.steps).abs().max() <= tol * want.steps.abs().max()
    assert got.outs == want.outs
