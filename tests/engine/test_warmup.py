"""The warm-up before serving: it runs the paths it names (a multi-chunk prefill, a shifted
body PIC reuses, turns extending a cached prefix, sampled and greedy decodes side by side) and
leaves nothing behind: every slot free, nothing reusable, the same outputs as a scheduler that
never warmed up."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from fixtures.tiny_models import build

from irminsul.config import EngineConfig, ServerConfig
from irminsul.engine import Engine, SamplingParams, Scheduler
from irminsul.engine.warmup import SHORT_PROMPTS, TAILS, warm_up
from irminsul.model import default_model_dir, load_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v3")
    build("v3_like", directory)
    return load_model(directory)


def _scheduler(model, mode: str = "live") -> Scheduler:
    return Scheduler(Engine(model, EngineConfig(mode=mode, slots=3000)), batch_tokens=256,
                     chunk_tokens=128)


def _serve(scheduler: Scheduler, prompts: list[np.ndarray]) -> tuple[dict, list]:
    ids = [scheduler.add(p, SamplingParams(max_tokens=5)) for p in prompts]
    outs, stats = {i: [] for i in ids}, []
    while scheduler.has_work():
        for out in scheduler.step():
            outs[out.request_id] += out.new_tokens
            if out.stats is not None:  # with its first token
                stats.append(out.stats)
    return outs, stats


def test_warm_up_runs_its_paths_and_leaves_the_cache_empty(model) -> None:
    scheduler = _scheduler(model)
    pool = scheduler.engine.pool
    free = (pool.ckv_slots.free, pool.kr_slots.free)
    report = warm_up(scheduler)
    assert report.requests == 2 + len(TAILS) + SHORT_PROMPTS
    # The body is longer than a chunk (two forwards), and its shifted copy was served by PIC.
    assert report.prompt_tokens >= 2 * (64 + 160)
    assert report.pic_tokens > 0
    # The turns extending the first prompt found it whole as their exact prefix.
    assert report.prefix_tokens >= len(TAILS) * (64 + 160)
    assert (pool.ckv_slots.free, pool.kr_slots.free) == free  # every slot back
    assert all(r.size == 0 for r in scheduler.cache.references()[1:])  # past the reserved
    scheduler.check()


def test_warm_up_fits_a_small_pool(model) -> None:
    """A pool of a few hundred slots (a quarter of it shorter than the header and reply) still
    warms up: the body, the tails and the short prompts shrink to what fits."""
    scheduler = Scheduler(Engine(model, EngineConfig(mode="live", slots=250)), chunk_tokens=128)
    report = warm_up(scheduler)
    assert report.requests == 2 + len(TAILS) + SHORT_PROMPTS
    scheduler.check()


def test_outputs_after_warm_up_equal_a_cold_scheduler(model) -> None:
    rng = np.random.default_rng(5)
    doc = rng.integers(0, 97, 200)
    prompts = [np.concatenate([rng.integers(0, 97, 40), doc]),
               np.concatenate([rng.integers(0, 97, 70), doc])]
    warm = _scheduler(model)
    warm_up(warm)
    warm_outs, warm_stats = _serve(warm, prompts)
    cold_outs, cold_stats = _serve(_scheduler(model), prompts)
    assert list(warm_outs.values()) == list(cold_outs.values())
    # Where the prompts' tokens came from is theirs alone: nothing of the warm-up is reused.
    assert [(s.prefix_tokens, s.pic_tokens) for s in warm_stats] == [
        (s.prefix_tokens, s.pic_tokens) for s in cold_stats]


def test_warm_up_needs_an_idle_scheduler(model) -> None:
    scheduler = _scheduler(model, mode="off")
    scheduler.add(np.arange(10), SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        warm_up(scheduler)


def test_server_warms_up_when_asked(caplog) -> None:
    from irminsul.server.launch import build_server

    with caplog.at_level(logging.INFO, logger="irminsul"):
        _, engine = build_server(default_model_dir(), ServerConfig(device="cpu", warmup=True,
                                                                   gate=None))
    assert any("warm-up: 12 requests" in r.getMessage() for r in caplog.records)
    pool = engine.scheduler.engine.pool
    assert pool.ckv_slots.free == pool.capacity
