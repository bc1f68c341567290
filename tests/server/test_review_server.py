"""Review findings on the server: the published index after an abort between steps."""

from __future__ import annotations

import asyncio
import threading

from fixtures.openai_server import Server

from irminsul.engine import SamplingParams
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
