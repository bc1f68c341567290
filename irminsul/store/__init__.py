"""A content store shared by engines (``irminsul serve --store redis://HOST:PORT``).

An engine publishes every chunk it registers — fingerprint, tokens, ``p_source``, namespace and
its KV rows (``c_KV`` and the ``k_r`` base, every layer) under a checksum — to a Redis (or
Valkey) server. An engine that misses a chunk locally and finds it there fetches the rows instead
of prefilling them when the cost model says that is faster, verifies them, registers them and
serves them rotated by δ like any local hit. docs/scale-out.md says how and why.

    value      the value format: versioned header, tokens, rows, xxh3 checksum
    keys       keys (model id, namespace, fingerprint) and the model identity
    client     the Redis client: short time-outs, no retries, through the breaker
    breaker    the circuit breaker
    cost       the cost model: fetch or prefill
    publisher  the thread that writes published rows off the request path
    stats      counters and the fetch-time histogram, for /metrics
    shared     SharedStore: what the cache manager calls
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import StoreConfig
from .keys import model_identity, parse_model_id
from .shared import Fetched, SharedStore
from .value import Shape

if TYPE_CHECKING:
    from ..engine import Engine

__all__ = ["Fetched", "SharedStore", "attach"]


def attach(engine: Engine, config: StoreConfig) -> SharedStore:
    """Connect ``engine`` to the store ``config.url``: its cache manager fetches from it and
    publishes to it from now on. Returns the store (``close()`` it when done). Connecting does
    no I/O: a store that is down now is a store that holds nothing until it is up."""
    model, pool = engine.model, engine.pool
    model_id = (parse_model_id(config.model_id) if config.model_id is not None
                else model_identity(model, pool.ckv.dtype))
    shape = Shape(model_id, model.config.num_hidden_layers, model.config.kv_lora_rank,
                  model.config.qk_rope_head_dim, pool.ckv.dtype)
    store = SharedStore(config, shape, carve_out=engine.config.cache.carve_out,
                        context=model.config.max_position_embeddings)
    engine.cache.store = store
    return store
