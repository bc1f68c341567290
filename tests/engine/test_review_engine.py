"""Review regressions: faults and edge cases of the engine's host path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures.tiny_models import build

from irminsul.config import CacheConfig, EngineConfig
from irminsul.engine import Engine, SamplingParams, Scheduler
from irminsul.model import load_model

V = 97
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v3_review")
    build("v3_like", directory, layers=2)
    return load_model(directory)


def _greedy(model, prompt, n: int) -> list[int]:
    ids = [int(t) for t in prompt]
    for _ in range(n):
        ids.append(int(model.logits(torch.tensor(ids))[-1].argmax()))
    return ids[len(prompt):]


def _drain(scheduler: Scheduler, limit: int = 200) -> tuple[dict[str, list[int]], dict[str, str]]:
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    for _ in range(limit):
        if not scheduler.has_work():
            break
        for out in scheduler.step():
            tokens.setdefault(out.request_id, []).extend(out.new_tokens)
            if out.error is not None:
                errors[out.request_id] = out.error
        scheduler.engine.check()
    return tokens, errors


def test_a_failing_repair_check_holds_nothing_and_blocks_no_one(model) -> None:
    """The repair's check forward (run while planning) fails for one request: that request
    fails alone, and it leaves nothing behind — no plan locks, no sequence, no chunks counted
    as in flight (a later request computing the same novel content must not wait for a
    prefill that will never land)."""
    rng = np.random.default_rng(5)
    doc, novel = rng.integers(0, V, 300), rng.integers(0, V, 400)
    h1, h2, h3 = (rng.integers(0, V, n) for n in (40, 60, 50))
    h2[0], h3[0] = (h1[0] + 1) % V, (h1[0] + 2) % V
    engine = Engine(model, EngineConfig(slots=4000, mode="live",
                                        cache=CacheConfig(recompute_share=0.25)))
    scheduler = Scheduler(engine)
    scheduler.add(np.concatenate([h1, doc]), SamplingParams(max_tokens=2), resets=[40])
    _drain(scheduler)
    real = engine.cache.latent_check

    def faulty(*args):
        raise RuntimeError("CUDA out of memory (injected)")

    engine.cache.latent_check = faulty
    poison = scheduler.add(np.concatenate([h2, doc, novel]), SamplingParams(max_tokens=2),
                           resets=[60, 360])
    _, errors = _drain(scheduler)
    assert set(errors) == {poison}
    engine.cache.latent_check = real
    assert engine.sequences == []
    # The same novel content behind another header: computed, not waited for forever.
    prompt = np.concatenate([h3, novel])
    request = scheduler.add(prompt, SamplingParams(max_tokens=3), resets=[50])
    tokens, errors = _drain(scheduler)
    assert not errors and not scheduler.has_work()
    assert tokens[request] == _greedy(model, prompt, 3)
    # Nothing stays locked: the indexes can be emptied and every slot is free again.
    engine.cache.clear()
    engine.check()
    assert engine.pool.free == engine.pool.capacity


def test_generate_that_runs_out_of_slots_gives_them_back(model) -> None:
    """Engine.generate whose decode runs out of slots raises PoolExhausted and, like a failed
    prefill, gives back every slot it took: no sequence is left holding them."""
    from irminsul.engine import PoolExhausted

    engine = Engine(model, EngineConfig(slots=64, mode="off"))
    prompt = np.random.default_rng(7).integers(0, V, 62)
    with pytest.raises(PoolExhausted):
        engine.generate(prompt, 8)
    engine.check()
    assert engine.sequences == []
    engine.cache.clear()
    assert engine.pool.free == engine.pool.capacity
    # The engine serves the same prompt once it asks for what fits.
    out, _ = engine.generate(prompt, 2)
    assert out == _greedy(model, prompt, 2)
