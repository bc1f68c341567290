"""Heal in the server's engine loop: with ``CacheConfig.heal`` on, an idle AsyncEngine recomputes
the rows a finished turn reused, on its own, and the next turn is served an exact prefix; with
it off that prefix stays derived (the control)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from fixtures.tiny_models import build

from irminsul.config import CacheConfig, EngineConfig
from irminsul.engine import Engine, SamplingParams, Scheduler
from irminsul.model import load_model
from irminsul.server import AsyncEngine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v3_heal")
    build("v3_like", directory, layers=2)
    return load_model(directory)


@pytest.mark.parametrize("heal", [True, False])
def test_an_idle_server_heals_between_turns(model, heal: bool) -> None:
    rng = np.random.default_rng(21)
    doc = rng.integers(0, 97, 300)
    first, second = rng.integers(0, 97, 40), rng.integers(0, 97, 60)
    second[0] = (first[0] + 1) % 97
    source, turn = np.concatenate([first, doc]).tolist(), np.concatenate([second, doc]).tolist()
    config = EngineConfig(slots=4000, mode="live", idle_delay_s=0.05, heal_tokens=64,
                          cache=CacheConfig(heal=heal))
    engine = AsyncEngine(Scheduler(Engine(model, config)))
    engine.start()
    params = SamplingParams(max_tokens=3)

    async def run(prompt: list[int], resets: list[int]) -> tuple[list[int], object]:
        outs = [out async for out in engine.generate(prompt, params, resets=resets)]
        return [t for o in outs for t in o.new_tokens], outs[0].stats

    async def main() -> None:
        await run(source, [40])
        out, stats = await run(turn, [60])
        assert stats.pic_tokens > 200
        deadline = time.perf_counter() + 20
        while heal and engine.snapshot.healed_tokens == 0 and time.perf_counter() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # idle past the delay: a heal (if on) has landed by now
        # The turn's sequence holds its prompt and every output but the last (never fed).
        _, stats = await run(turn + out[:-1] + [5, 6, 7], [])
        stored = len(turn) + len(out) - 1
        if heal:
            assert engine.snapshot.healed_tokens > 0
            assert (stats.prefix_tokens, stats.derived_prefix_tokens) == (stored, 0)
        else:
            assert engine.snapshot.healed_tokens == 0
            assert stats.derived_prefix_tokens > 0

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    engine.scheduler.check()
