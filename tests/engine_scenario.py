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
    prompts: list[np.ndarray]  # the scheduler's requests
    outs: list[list[int]]  # their greedy tokens


def poison_graph_inputs(engine: Engine) -> None:
    """Fill the graphs' input buffer and every host mirror of it with an out-of-range value, so
    that a replay reading anything its batch's fill did not write fails (an index past the
    vocabulary, the positions, the pool)."""
    staging = engine.graphs.inputs
    for _ in range(4):  # at least the ring's depth: each send moves to the next mirror
        staging.host()[:] = 1 << 40
        staging.send((0, staging.buffer.numel()))


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
    prompts = requests(source, target, doc_a)
    ids = [scheduler.add(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    outs: dict[int, list[int]] = {i: [] for i in ids}
    while scheduler.has_work():
        for out in scheduler.step():
            outs[out.request_id] += out.new_tokens
    engine.check()
    return Served(seq.stats.pic_tokens, last.cpu(), steps.cpu(), prompts, list(outs.values()))


def assert_same(got: Served, want: Served, tol: float, reference: Engine | None = None) -> None:
    """Same reuse, logits within ``tol`` of the largest, the same greedy tokens — or, given the
    engine ``want`` came from (arithmetic that rounds differently may break a near-tie the
    other way), greedy tokens that are each within ``tol`` of the best token there, fed the
    same tokens before it."""
    assert got.pic_tokens == want.pic_tokens
    assert (got.last - want.last).abs().max() <= tol * want.last.abs().max()
    assert (got.steps - want.steps).abs().max() <= tol * want.steps.abs().max()
    if reference is None or got.outs == want.outs:
        assert got.outs == want.outs
        return
    for prompt, out in zip(got.prompts, got.outs):
        seq, last = reference.prefill(prompt)
        logits = torch.cat([last[None], reference.extend(seq, out[:-1])]).float().cpu()
        reference.finish(seq)
        best = logits.max(-1).values
        chosen = logits[torch.arange(len(out)), torch.tensor(out)]
        assert ((best - chosen) <= tol * logits.abs().max()).all(), (out, best - chosen)
