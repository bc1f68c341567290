"""Review findings on the cache core and how the engine uses it: each test failed before its fix."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.tiny_models import build

from irminsul.config import EngineConfig
from irminsul.engine import Engine, SamplingParams, Scheduler
from irminsul.model import load_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v3")
    build("v3_like", directory)
    return load_model(directory)


def test_drop_of_a_prefilling_request_does_not_leave_its_chunks_in_flight(model) -> None:
    """drop (the server's last resort when abort raised) of a request still prefilling: a later
    request with the same prompt must not wait forever for chunks nobody is computing."""
    engine = Engine(model, EngineConfig(slots=3000, mode="live", await_shared=32))
    scheduler = Scheduler(engine, chunk_tokens=32)
    prompt = np.random.default_rng(0).integers(0, 97, 600)
    first = scheduler.add(prompt, SamplingParams(max_tokens=4))
    scheduler.step()
    assert [r.state for r in scheduler.running] == ["prefill"]
    scheduler.drop(first)
    second = scheduler.add(prompt, SamplingParams(max_tokens=4))
    got: list[int] = []
    for _ in range(100):
        got += [t for o in scheduler.step() if o.request_id == second for t in o.new_tokens]
        if not scheduler.has_work():
            break
    assert not scheduler.has_work() and len(got) == 4


def test_drop_of_a_prefilling_request_releases_its_plan(model) -> None:
    """A dropped prefill's plan no longer pins the radix path and registry entries it reused:
    they are evictable again (its sequence stays, accounted for, as drop documents)."""
    engine = Engine(model, EngineConfig(slots=3000, mode="live"))
    rng = np.random.default_rng(1)
    doc = rng.integers(0, 97, 300)
    engine.generate(np.concatenate([rng.integers(0, 97, 40), doc]), 2)
    scheduler = Scheduler(engine, chunk_tokens=16)
    prompt = np.concatenate([rng.integers(0, 97, 45), doc, rng.integers(0, 97, 200)])
    request = scheduler.add(prompt, SamplingParams(max_tokens=4))
    scheduler.step()
    (running,) = scheduler.running
    assert running.state == "prefill" and running.prefill.plan.hits  # it reuses the doc
    scheduler.drop(request)
    planner = engine.cache.planner
    assert planner.radix.evictable_tokens == planner.radix.total_tokens
    assert all(entry.refcount == 0 for entry in planner.registry.entries())
    engine.check()
