"""Faults change nothing but speed: a store that is killed, slow, restarted or never there is a
store that holds nothing; no request fails, and each is served exactly as without a store.
Corrupted values are detected by their checksum, dropped (deleted from the store) and counted."""

from __future__ import annotations

import time

import numpy as np
import torch
from store_prompts import documents, publish

from irminsul.engine import SamplingParams, Scheduler
from irminsul.loadgen.server import free_port


def run(scheduler: Scheduler, prompts: list[tuple[np.ndarray, list[int]]]) -> dict:
    """Serve prompts together, greedily, 4 tokens each; request id -> (tokens, reason, stats)."""
    ids = [scheduler.add(p, SamplingParams(max_tokens=4), resets=r) for p, r in prompts]
    out = {i: ([], None, None) for i in ids}
    while scheduler.has_work():
        for step in scheduler.step():
            tokens, _, stats = out[step.request_id]
            out[step.request_id] = (tokens + step.new_tokens, step.finish_reason,
                                    stats or step.stats)
    return [out[i] for i in ids]


def test_store_killed_mid_run_changes_nothing_but_speed(redis_server, engines) -> None:
    docs = [documents(10 + i, doc=250) for i in range(4)]
    config = dict(breaker_cooldown_s=0.3, timeout_s=0.5)
    a, b = engines(redis_server.url, **config), engines(redis_server.url, **config)
    for source, rs, _, _ in docs[:3]:
        publish(a, source, rs)
    served, reference = Scheduler(b), Scheduler(engines())  # B, and an engine with no store
    first = run(served, [docs[0][2:]])[0]
    assert first[1] == "length" and first[2].pic_tokens >= 200  # from the store
    run(reference, [docs[0][2:]])

    redis_server.kill()
    outs = run(served, [d[2:] for d in docs[1:3]])
    assert [o[1] for o in outs] == ["length", "length"]  # no request failed
    assert all(o[2].pic_tokens == 0 for o in outs)  # computed, as with no store
    assert [o[0] for o in outs] == [o[0] for o in run(reference, [d[2:] for d in docs[1:3]])]
    stats = b.cache.store.stats
    assert stats.errors["unavailable"] >= 1 and stats.hit_tokens == first[2].pic_tokens
    b.check()

    # Restarted (empty): once the breaker's cooldown is over, both engines use it again.
    redis_server.start()
    time.sleep(0.4)
    source, rs, target, rt = docs[3]
    publish(a, source, rs)
    assert a.cache.store.stats.published_chunks > 0 and redis_server.client().dbsize() > 0
    out = run(served, [(target, rt)])[0]
    assert out[1] == "length" and out[2].pic_tokens >= 200
    b.check()


def test_slow_store_times_out_then_the_breaker_costs_microseconds(redis_server, engines) -> None:
    source, rs, target, rt = documents(20, doc=250)
    a = engines(redis_server.url)
    b = engines(redis_server.url, timeout_s=0.05, breaker_failures=2, breaker_cooldown_s=60)
    publish(a, source, rs)
    redis_server.pause()  # the kernel accepts connections; nothing answers
    try:
        reference = engines()
        for prompt, resets in ((target, rt), (source[::-1].copy(), [])):
            seq, logits = b.prefill(prompt, resets)
            _, expected = reference.prefill(prompt, resets)
            assert torch.equal(logits, expected) and seq.stats.pic_tokens == 0
            b.finish(seq)
            b.cache.store.flush()  # its publish times out too
        store = b.cache.store
        assert store.breaker.state == "open" and store.stats.errors["unavailable"] >= 2
        plan = b.cache.planner.plan(np.arange(100, 700), [50])
        start = time.perf_counter()
        assert store.fetch(plan) == []
        assert time.perf_counter() - start < 1e-3  # no socket, no time-out
        b.check()
    finally:
        redis_server.resume()


def test_a_store_that_was_never_there_is_an_empty_store(engines) -> None:
    source, rs, target, rt = documents(21, doc=200)
    b = engines(f"redis://127.0.0.1:{free_port()}", breaker_failures=1)
    reference = engines()
    for prompt, resets in ((source, rs), (target, rt)):
        seq, logits = b.prefill(prompt, resets)
        _, expected = reference.prefill(prompt, resets)
        assert torch.equal(logits, expected)
        b.finish(seq)
    assert b.cache.store.stats.errors["unavailable"] >= 1 and b.cache.store.breaker.opened >= 1
    b.check()


def test_corrupted_values_are_dropped_and_counted(redis_server, engines) -> None:
    source, rs, target, rt = documents(30)
    a, b = engines(redis_server.url), engines(redis_server.url)
    publish(a, source, rs)
    store = redis_server.client()
    keys = sorted(store.keys("*"))
    assert len(keys) >= 3
    for i, name in enumerate(keys):  # truncated, a flipped row byte, a flipped header byte
        value = bytearray(store.get(name))
        if i % 3 == 0:
            value = value[:len(value) // 2]
        else:
            value[len(value) - 7 if i % 3 == 1 else 33] ^= 0x40
        store.set(name, bytes(value))
    seq, logits = b.prefill(target, rt)
    _, expected = engines().prefill(target, rt)
    assert torch.equal(logits, expected)  # nothing of them was served
    assert seq.stats.pic_tokens == 0 and b.cache.store.stats.hit_tokens == 0
    assert b.cache.store.stats.errors["corrupt"] == len(keys)
    b.finish(seq)
    b.check()
    # Deleted, and written again whole by B, which computed them: a third engine fetches them.
    assert b.cache.store.flush()
    c = engines(redis_server.url)
    seq, _ = c.prefill(source, rs)
    assert seq.stats.pic_tokens >= 300 and c.cache.store.stats.errors["corrupt"] == 0


class _Holding:
    """A shared store that holds the chunks of ``document`` and fails to write their rows
    (``write_rows`` raised on some rank): what it offers never reaches the pool."""

    def __init__(self, document: list[int]) -> None:
        self.document = np.asarray(document, dtype=np.int64).tobytes()

    def fetch(self, plan):
        from irminsul.store.shared import Fetched
        from irminsul.store.value import Rows

        return [Fetched(c.fingerprint, plan.tokens[c.start:c.end].copy(), Rows(100, None, None))
                for c in plan.chunks if c.kind == "miss" and c.start >= max(32, plan.prefix.length)
                and plan.tokens[c.start:c.end].astype(np.int64).tobytes() in self.document]

    def write(self, handles, found, write_rows) -> bool:
        return False

    def publish(self, *args) -> None:
        pass


def test_a_fetch_that_evicts_and_fails_leaves_no_stale_plan(tmp_path) -> None:
    """Making room for a fetch evicts what no plan holds yet, the first plan's own hits among
    them. When the fetched rows then cannot be written, that plan must not be served: it would
    lock an evicted entry and serve c_KV slots already back on the free list (given out again to
    the same prompt's computed tokens). The request waits for room instead, and every slot's
    reference count agrees with the free lists."""
    from fixtures.tiny_models import build

    from irminsul.config import EngineConfig
    from irminsul.engine import Engine
    from irminsul.model import load_model

    build("v3_like", tmp_path)
    engine = Engine(load_model(tmp_path), EngineConfig(slots=680, kr_slots=1200, mode="live"))
    scheduler = Scheduler(engine)
    rng = np.random.default_rng(0)
    head, a, c = (rng.integers(0, 97, n).tolist() for n in (40, 200, 40))
    first = scheduler.add(head + a, SamplingParams(max_tokens=1), resets=[40])
    while any(r.id == first for r in scheduler.running + scheduler.waiting):
        scheduler.step()
    engine.cache.store = _Holding(c)
    scheduler.add(rng.integers(0, 97, 400).tolist(), SamplingParams(max_tokens=20))
    scheduler.step()
    scheduler.step()  # decoding: its 400 rows are held
    # The same document a behind a longer header: its entries are hits of the first plan, and
    # the store's c needs room that only evicting them (and more) could make.
    third = scheduler.add(head + [5] * 8 + a + c, SamplingParams(max_tokens=2),
                          resets=[40, 48, 248])
    outputs = scheduler.step()
    assert not [o for o in outputs if o.request_id == third and o.error]
    engine.check()  # reference counts agree with the free lists
    for request in scheduler.running:
        if request.id == third:  # admitted: only what is still registered is reused
            assert all(h.entry.registered for h in request.prefill.plan.hits)
    while scheduler.has_work():
        outputs = scheduler.step()
        assert not [o for o in outputs if o.error]
    engine.check()
