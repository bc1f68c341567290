"""Review findings on the server: the published index after an abort between steps, and after
a step that failed."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from fixtures.openai_server import Server, config, running

from irminsul.config import EngineConfig
from irminsul.engine import SamplingParams
from irminsul.router.digest import Digest
from irminsul.server.async_engine import EngineError
from irminsul.server.index import IndexPublisher


def test_an_abort_between_steps_reaches_the_published_index(server: Server) -> None:
    """An abort that remembers its request (a stop string, a client gone) inserts the prompt
    and reply into the radix tree on the engine thread between steps. A poll whose read is
    applied just before that abort, in the same turn, read the snapshot of the latest step;
    the engine, idle after the abort, takes no step, so polls must still see the abort's
    blocks: the publisher's sets must equal a fresh read of the tree (a new publisher's).
    The window (between a turn's published snapshot and the next turn's commands) is
    microseconds wide; the test widens it by pausing the engine thread there."""
    engine = server.engine
    prompt = [int(t) for t in (7 + (i * 5) % 90 for i in range(60))]  # < one 64-token block
    pause, paused, resume = threading.Event(), threading.Event(), threading.Event()
    publish = engine._publish

    def publish_then_pause() -> None:
        publish()
        if pause.is_set():
            pause.clear()
            paused.set()
            resume.wait(10)

    async def scenario() -> tuple[set[int], set[int], set[int]]:
        publisher = IndexPublisher(engine)
        handle = await engine.submit(prompt, SamplingParams(max_tokens=1000), namespace=4242)
        got = 0
        async for out in handle:
            got += len(out.new_tokens)
            if got >= 16:  # prompt + reply now hold a whole block
                break
        pause.set()  # after the next step's snapshot, before the next turn's commands
        assert await asyncio.to_thread(paused.wait, 10)
        poll = asyncio.ensure_future(publisher.digest(None, None))
        await asyncio.sleep(0.1)  # its read is queued
        handle.abort()
        resume.set()
        stale = await poll
        async for _ in handle:  # the abort's final output: it has been applied
            pass
        while engine.snapshot.running:  # and the engine's turn that applied it published
            await asyncio.sleep(0.01)
        later = await publisher.digest(stale.generation, stale.version)
        prefix = (stale.prefix_added | later.prefix_added) - later.prefix_removed
        fresh = await IndexPublisher(engine).digest(None, None)
        return stale.prefix_added, prefix, fresh.prefix_added

    engine._publish = publish_then_pause  # the engine thread calls it after each turn
    try:
        stale, published, truth = asyncio.run(scenario())
    finally:
        del engine._publish
        resume.set()
    assert truth - stale, "the abort added no block: the scenario did not happen"
    assert published == truth
    server.check()


def test_a_failed_step_reaches_the_published_index(model_dir) -> None:
    """A step that raises as a whole (the server's last resort: it fails the running requests,
    :meth:`AsyncEngine._fail_running`) may have evicted cached content to admit them before it
    raised. That step is neither a step the publisher counts nor an abort, so polls went on
    announcing the evicted blocks, their rows freed, until another request came (on an idle
    server, for good). The publisher's sets must equal a fresh read of the indexes."""
    rng = np.random.default_rng(7)
    first, second = rng.integers(5, 90, 180).tolist(), rng.integers(5, 90, 200).tolist()
    # 256 slots: the second prompt fits only once the first one's cached rows are evicted.
    with running(model_dir, config(engine=EngineConfig(mode="live", slots=256))) as server:
        engine = server.engine
        scheduler = engine.scheduler

        def faulty(work, outputs, prepared=None):
            raise RuntimeError("injected step fault")

        async def scenario() -> tuple[Digest, Digest, Digest]:
            publisher = IndexPublisher(engine)
            async for _ in engine.generate(first, SamplingParams(max_tokens=2)):
                pass
            await asyncio.to_thread(server.check)  # idle, its last turn published
            before = await publisher.digest(None, None)
            scheduler._forward = faulty  # after admission made room: the whole step raises
            with pytest.raises(EngineError, match="injected step fault"):
                async for _ in engine.generate(second, SamplingParams(max_tokens=2)):
                    pass
            await asyncio.to_thread(server.check)
            after = await publisher.digest(before.generation, before.version)
            fresh = await IndexPublisher(engine).digest(None, None)
            return before, after, fresh

        try:
            before, after, fresh = asyncio.run(scenario())
        finally:
            del scheduler._forward
    assert before.prefix_added - fresh.prefix_added, "nothing evicted: the scenario did not happen"
    assert (before.prefix_added | after.prefix_added) - after.prefix_removed == fresh.prefix_added
    assert (before.chunks_added | after.chunks_added) - after.chunks_removed == fresh.chunks_added


def test_idle_work_reaches_the_published_index(model_dir) -> None:
    """An audit's recomputation, run by an idle engine, makes room for its prompt as a prefill
    does: it may evict cached content. No step ran and no abort was applied, so polls went on
    announcing the evicted blocks. The publisher's sets must equal a fresh read."""
    prompt = np.random.default_rng(8).integers(5, 90, 180).tolist()
    engine_config = EngineConfig(mode="live", slots=256, pic_audit_rate=0.0, idle_delay_s=0.0)
    with running(model_dir, config(engine=engine_config)) as server:
        engine = server.engine
        vocab = engine.limits.vocab_size

        def keep_for_audit(scheduler) -> None:  # as if the draw had kept the served request
            scheduler.audit._pending.append((np.array(prompt), torch.zeros(vocab)))

        async def scenario() -> tuple[Digest, Digest, Digest]:
            publisher = IndexPublisher(engine)
            async for _ in engine.generate(prompt, SamplingParams(max_tokens=2)):
                pass
            await asyncio.to_thread(server.check)
            before = await publisher.digest(None, None)
            await asyncio.wrap_future(engine.run_in_engine_thread(keep_for_audit))
            # the prompt's 180 fresh rows fit only once its cached ones are evicted
            while (await asyncio.wrap_future(engine.run_in_engine_thread(
                    lambda s: s.audit.stats.audited))) == 0:
                await asyncio.sleep(0.01)
            after = await publisher.digest(before.generation, before.version)
            fresh = await IndexPublisher(engine).digest(None, None)
            return before, after, fresh

        before, after, fresh = asyncio.run(scenario())
    assert before.prefix_added - fresh.prefix_added, "nothing evicted: the scenario did not happen"
    assert (before.prefix_added | after.prefix_added) - after.prefix_removed == fresh.prefix_added
    assert (before.chunks_added | after.chunks_added) - after.chunks_removed == fresh.chunks_added
