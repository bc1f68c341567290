"""A document registered on engine A is served to engine B from the store: B's outputs equal B
serving it by local position-independent reuse (the rows are the same rows, rotated by the same
δ), and B's slot accounting stays exact."""

from __future__ import annotations

import numpy as np
import torch
from store_prompts import documents, publish

from irminsul.store.keys import key, model_identity


def local_reference(make, source, rs, target, rt) -> tuple:  # noqa: ANN001
    """The target served by an engine with no store that served the source itself."""
    engine = make()
    publish_locally = engine.prefill(source, rs)
    engine.finish(publish_locally[0])
    seq, logits = engine.prefill(target, rt)
    stats = seq.stats
    engine.finish(seq)
    return logits, stats, engine


def test_document_registered_on_a_is_served_to_b_from_the_store(redis_server, engines) -> None:
    source, rs, target, rt = documents(1)
    a, b = engines(redis_server.url), engines(redis_server.url)
    publish(a, source, rs)
    assert a.cache.store.stats.published_chunks >= 3
    seq, logits = b.prefill(target, rt)
    b.finish(seq)
    reference, stats, _ = local_reference(engines, source, rs, target, rt)
    # The same rows, rotated by the same δ: within the tolerance of local PIC's exactness tests
    # (1e-5), and in fact equal.
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
    assert seq.stats.pic_tokens == stats.pic_tokens >= 0.9 * 400
    assert seq.stats.prefilled_tokens == stats.prefilled_tokens
    assert b.cache.store.stats.hit_tokens >= 0.9 * 400
    b.check()
    a.check()
    # B registered what it fetched: a third prompt with the document hits it locally.
    fetched = b.cache.store.stats.fetched_bytes
    header = np.full(50, 5, dtype=np.int64)  # another header, of another length
    seq, _ = b.prefill(np.concatenate([header, source[40:]]), [50])
    assert seq.stats.pic_tokens >= 0.9 * 400 and b.cache.store.stats.fetched_bytes == fetched
    b.finish(seq)
    b.check()


def test_greedy_generation_from_the_store_equals_local_reuse(redis_server, engines) -> None:
    source, rs, target, rt = documents(2, doc=300)
    a, b, c = engines(redis_server.url), engines(redis_server.url), engines()
    a.generate(source, 2, resets=rs)
    assert a.cache.store.flush()
    out, seq = b.generate(target, 8, resets=rt)
    c.generate(source, 2, resets=rs)
    reference, ref_seq = c.generate(target, 8, resets=rt)
    assert out == reference
    assert seq.stats.pic_tokens == ref_seq.stats.pic_tokens > 250
    b.check()


def test_chunks_the_cost_model_rejects_are_prefilled(redis_server, engines) -> None:
    """A link too slow to beat the prefill: nothing is asked for, everything computed."""
    source, rs, target, rt = documents(3, doc=200)
    a = engines(redis_server.url)
    b = engines(redis_server.url, link_bandwidth=1.0)  # one byte a second
    publish(a, source, rs)
    seq, _ = b.prefill(target, rt)
    assert seq.stats.pic_tokens == 0 and b.cache.store.stats.hit_tokens == 0
    assert b.cache.store.stats.skipped_tokens >= 200
    b.finish(seq)
    b.check()


def test_keys_name_model_namespace_and_chunk(redis_server, engines, model) -> None:
    source, rs, _, _ = documents(4, doc=200)
    a = engines(redis_server.url)
    publish(a, source, rs, namespace=77)
    model_id = model_identity(model, torch.float32)
    assert a.cache.store.shape.model_id == model_id
    keys = sorted(k.decode() for k in redis_server.client().keys("*"))
    entries = a.cache.planner.registry.entries()  # chunks and the region (not published)
    assert len(keys) >= 2
    assert set(keys) <= {key(model_id, 77, e.fingerprint) for e in entries if e.namespace == 77}
    ttl = redis_server.client().ttl(keys[0])
    assert 0 < ttl <= 24 * 3600


def test_a_pool_too_small_for_the_fetch_serves_by_computing(redis_server, model) -> None:
    """B's pool holds the target computed whole but not with the whole document fetched (a
    fetched chunk holds its own c_KV and k_r rows besides the request's rotated k_r): the
    request is still served, fetching only what fits beside its own rows (here 109 of the 400
    document tokens), with every slot accounted for. Its greedy output is not compared with an
    engine that computes everything: the fetched rows are reused, and reuse may flip a near-tie
    (it does on the embedded model, where step 2's top two logits are 0.06 apart)."""
    from irminsul.config import EngineConfig, StoreConfig
    from irminsul.engine import Engine, SamplingParams, Scheduler
    from irminsul.store import attach

    source, rs, target, rt = documents(3)
    a = Engine(model, EngineConfig(slots=4000, mode="live"))
    stores = [attach(a, StoreConfig(url=redis_server.url))]
    publish(a, source, rs)
    decode = 4
    outputs = {}
    for url in (redis_server.url, None):
        # Room for the target and its decode, plus half the document: not for both the fetched
        # rows and the target's own.
        b = Engine(model, EngineConfig(slots=len(target) + decode + 200, mode="live"))
        if url is not None:
            stores.append(attach(b, StoreConfig(url=url)))
        scheduler = Scheduler(b)
        scheduler.add(target, SamplingParams(max_tokens=decode), resets=rt)
        got, stats = [], None
        while scheduler.has_work():
            for out in scheduler.step():
                assert out.error is None, out.error
                got += out.new_tokens
                stats = out.stats or stats
        outputs[url] = (got, stats)
        b.check()
        # What it fetched fits beside its own rows: the fetched chunks' rows and the request's.
        assert stats.pic_tokens + len(target) + decode <= b.config.slots
    (fetched, with_store), (computed, alone) = outputs[redis_server.url], outputs[None]
    assert len(fetched) == len(computed) == decode
    assert alone.pic_tokens == 0 and alone.prefilled_tokens == len(target)
    # Some of the document came from the store, not all of it (it does not fit).
    assert 0 < with_store.pic_tokens < len(source) - rs[0]
    assert with_store.pic_tokens + with_store.prefilled_tokens == len(target)
    for store in stores:
        store.close()


def test_the_audits_recomputation_asks_the_store_nothing(redis_server, engines) -> None:
    """The audit's reference computes from scratch in a namespace of its own: it never asks
    the store (a fetched chunk would be registered in that namespace, which must stay empty),
    and it leaves the engine's accounting exact."""
    source, rs, target, _ = documents(3)
    a, b = engines(redis_server.url), engines(redis_server.url)
    publish(a, source, rs)
    asked = []
    real = b.cache._from_store
    b.cache._from_store = lambda plan: asked.append(plan) or real(plan)
    b.recompute_in_pool(target, budget=256)
    assert asked == [] and b.cache.store.stats.fetched_bytes == 0
    b.check()
