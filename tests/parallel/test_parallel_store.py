"""The shared content store under tensor parallel: rows another engine published are fetched
once, by the leader, and written into every rank's pool (they travel with the leader's message),
so a two-rank engine serves a document registered elsewhere as one process serves it by local
reuse, and every rank's pool holds the same rows."""

from __future__ import annotations

import numpy as np
from parallel_ranks import run_ranks, values
from test_parallel_engine import followed, shifted_docs
from tiny_parallel import tiny_model

from irminsul.config import EngineConfig, StoreConfig
from irminsul.engine import Engine
from irminsul.parallel import ParallelGroup, leader_engine, shard_model
from irminsul.store import attach

CONFIG = EngineConfig(mode="live", slots=1200)


def fetched(group: ParallelGroup, url: str) -> dict:
    model = tiny_model("v2_lite_like", layers=2, seed=4)
    source, source_resets, target, target_resets = shifted_docs()
    # One identity for the whole model and its shards (the default hashes the weights a process
    # holds, and a shard's differ from the whole model's).
    store_config = StoreConfig(url=url, model_id="tiny-2-layers")
    if group.leader:
        # Another engine (the whole model) registers the documents and publishes them. The
        # reference: an engine with no store serving the target by local reuse.
        publisher, local = Engine(model, CONFIG), Engine(model, CONFIG)
        store = attach(publisher, store_config)
        for engine in (publisher, local):
            seq, _ = engine.prefill(source, source_resets)
            engine.finish(seq)
        assert store.flush() and store.stats.published_chunks > 0
        store.close()
        seq, want = local.prefill(target, target_resets)
        want_pic = seq.stats.pic_tokens
    shard_model(model, group)
    if not group.leader:
        return followed(model, group)
    engine = leader_engine(model, CONFIG, group)
    store = attach(engine, store_config)
    try:
        seq, got = engine.prefill(target, target_resets)
        engine.finish(seq)
        engine.check()
    except BaseException as err:
        engine.runner.stop(f"{type(err).__name__}: {err}")
        raise
    finally:
        store.close()
    engine.runner.stop()
    return dict(error=float((got - want).abs().max()), pic_tokens=seq.stats.pic_tokens,
                want_pic=want_pic, hit_tokens=store.stats.hit_tokens,
                pool=(engine.pool.ckv.numpy().copy(), engine.pool.kr.numpy().copy()))


def test_rows_fetched_from_the_store_reach_every_rank(redis_server) -> None:  # noqa: ANN001
    leader, follower = values(run_ranks(fetched, 2, redis_server.url, timeout_s=300))
    assert leader["hit_tokens"] >= 300  # both documents came from the store
    assert leader["pic_tokens"] == leader["want_pic"] >= 300
    # The same rows rotated by the same δ, through a sharded forward: float rounding apart.
    assert leader["error"] <= 1e-5, leader["error"]
    assert follower["forwards"] > 0
    assert np.array_equal(follower["pool"][0], leader["pool"][0])
    assert np.array_equal(follower["pool"][1], leader["pool"][1])

