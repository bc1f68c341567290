"""The shared store as the cache manager sees it: fetch what a plan misses, publish what it
registered.

:meth:`SharedStore.fetch` takes a plan's whole missed chunks past the exact prefix, asks the cost
model whether fetching their rows beats prefilling them, and if so asks the store for all of them
in one round trip. Each value found is checked (checksum, header: model, namespace, chunk,
shapes) and its tokens compared with the prompt's, one by one; what passes is returned, the
rest dropped and counted. The cache manager writes the rows into fresh slots
(:meth:`SharedStore.write`), registers them as if they had been prefilled here at their source
position, and plans the prompt again: they are ordinary hits then, rotated by δ like any other.

:meth:`SharedStore.publish` runs after a prefill's commit: the chunks it registered are gathered
from the pool and handed to the :class:`~.publisher.Publisher` thread.

Nothing here fails a request: a store that is down, slow or restarting is a store that holds
nothing (and, once the circuit breaker opens, costs no I/O at all).
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_right
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from ..cache.plan import Chunk as PlanChunk
from ..cache.plan import Plan
from ..cache.registry import Registry
from ..config import StoreConfig
from ..engine.kv_pool import KVPool, unpack
from .breaker import CircuitBreaker
from .client import StoreClient, StoreUnavailable
from .cost import CostModel
from .keys import key
from .publisher import Chunk, Publisher
from .stats import StoreStats
from .value import HEADER, CorruptValue, Rows, Shape, ValueMismatch, decode

log = logging.getLogger(__name__)

# (slot pairs, c_KV rows [layers, tokens, rank], k_r rows [layers, tokens, rope]) -> None:
# the model runner's write_rows
RowWriter = Callable[[np.ndarray, torch.Tensor, torch.Tensor], None]


class Fetched(NamedTuple):
    """A chunk the store held, verified: its fingerprint, tokens and rows."""

    fingerprint: int
    tokens: np.ndarray  # int64
    rows: Rows


class SharedStore:
    """One engine's link to the shared store (see the module's docstring)."""

    def __init__(self, config: StoreConfig, shape: Shape, *, carve_out: int,
                 context: int) -> None:
        """``shape``: the model id and the pool's row shapes and dtype; ``carve_out`` and
        ``context``: where a fetched chunk's source position may lie (as one registered here
        could)."""
        if config.url is None:
            raise ValueError("a shared store needs a url")
        self.config, self.shape = config, shape
        self.carve_out, self.context = carve_out, context
        element = torch.empty(0, dtype=shape.dtype).element_size()
        self.row_bytes = shape.layers * (shape.rank + shape.rope) * element
        self.stats = StoreStats()
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s)
        self.client = StoreClient(config.url, timeout=config.timeout_s, breaker=self.breaker)
        self.cost = CostModel(config.link_bandwidth, config.prefill_tokens_per_second)
        self.publisher = Publisher(self.client, shape, self.stats, ttl_s=config.ttl_s,
                                   max_value_bytes=config.max_value_bytes,
                                   max_queued_bytes=config.publish_queue_bytes)

    def value_bytes(self, tokens: int) -> int:
        """The size of a value holding ``tokens`` tokens."""
        return HEADER.size + tokens * (8 + self.row_bytes)

    # -- fetch -----------------------------------------------------------------------------------

    def wanted(self, plan: Plan) -> list[PlanChunk]:
        """The plan's chunks worth asking for: missed whole (not partly served by a probe),
        past the exact prefix and the carve-out, each fingerprint once."""
        misses = [(s.start, s.end) for s in plan.segments if s.kind == "miss"]
        starts = [start for start, _ in misses]
        first = max(plan.prefix.length, self.carve_out)
        seen: set[int] = set()
        out = []
        for chunk in plan.chunks:
            if chunk.kind != "miss" or chunk.start < first or chunk.fingerprint in seen:
                continue
            i = bisect_right(starts, chunk.start) - 1
            if i >= 0 and misses[i][1] >= chunk.end:
                seen.add(chunk.fingerprint)
                out.append(chunk)
        return out

    def fetch(self, plan: Plan) -> list[Fetched]:
        """The plan's missed chunks the store holds, verified, when the cost model says
        fetching them beats prefilling them (one round trip); [] when the store is down.
        Never raises."""
        if not self.client.available():
            return []
        try:
            return self._fetch(plan)
        except Exception:  # a bug must cost the store's help, not the request
            log.exception("fetching from the store failed")
            return []

    def _fetch(self, plan: Plan) -> list[Fetched]:
        chunks = self.wanted(plan)
        tokens = sum(c.end - c.start for c in chunks)
        if not chunks:
            return []
        if not self.cost.worth_fetching(tokens, sum(self.value_bytes(c.end - c.start)
                                                    for c in chunks)):
            self.stats.add("skipped_tokens", tokens)
            return []
        keys = [key(self.shape.model_id, plan.namespace, c.fingerprint) for c in chunks]
        start = time.perf_counter()
        try:
            values = self.client.get_many(keys)
        except StoreUnavailable as err:
            self.stats.error("unavailable")
            log.debug("%s", err)
            return []
        elapsed = time.perf_counter() - start
        got = sum(len(v) for v in values if v is not None)
        self.stats.fetched(elapsed)
        self.stats.add("fetched_bytes", got)
        self.cost.observe(got, elapsed)
        found, corrupt = [], []
        for chunk, name, value in zip(chunks, keys, values):
            if value is None:
                continue
            content = plan.tokens[chunk.start:chunk.end].astype(np.int64).tobytes()
            try:
                rows = decode(value, self.shape, plan.namespace, chunk.fingerprint, content)
                n = chunk.end - chunk.start
                if not self.carve_out <= rows.p_source <= self.context - n:
                    raise ValueMismatch(f"source position {rows.p_source} out of range")
            except CorruptValue as err:
                self.stats.error("corrupt")
                corrupt.append(name)
                log.warning("store value %s dropped: %s", name, err)
                continue
            except ValueMismatch as err:
                self.stats.error("mismatch")
                log.warning("store value %s not served: %s", name, err)
                continue
            found.append(Fetched(chunk.fingerprint, np.frombuffer(content, dtype=np.int64), rows))
        if corrupt:
            self.publisher.delete(corrupt)  # the next engine to register them writes them anew
        return found

    def write(self, handles: np.ndarray, found: list[Fetched], write_rows: RowWriter) -> bool:
        """Write fetched rows into the pool slots ``handles`` (fresh, one per token, in
        order) through ``write_rows`` (the model runner's, which writes every rank's pool), on
        the engine thread, before anything can read them. Whether it did (never raises: a
        request is served without them otherwise)."""
        try:
            write_rows(handles, torch.cat([f.rows.ckv for f in found], dim=1),
                       torch.cat([f.rows.kr for f in found], dim=1))
        except Exception:
            log.exception("writing fetched rows into the KV pool failed")
            return False
        self.stats.add("hit_tokens", int(handles.size))
        return True

    # -- publish ---------------------------------------------------------------------------------

    def publish(self, plan: Plan, registry: Registry, pool: KVPool) -> None:
        """Hand the chunks a committed plan registered to the publisher (their rows gathered
        now, written to the store by its thread). Never raises: publishing is best effort."""
        if not self.client.available():
            return
        try:
            chunks, handles, seen = [], [], set()
            for chunk in plan.chunks:
                if chunk.kind != "miss" or chunk.fingerprint in seen:
                    continue
                seen.add(chunk.fingerprint)
                entry = registry.lookup(plan.namespace, chunk.fingerprint,
                                        plan.tokens[chunk.start:chunk.end])
                if entry is None or self.value_bytes(entry.size) > self.config.max_value_bytes:
                    continue  # evicted already, or too large a value
                chunks.append(Chunk(key(self.shape.model_id, plan.namespace, entry.fingerprint),
                                    plan.namespace, entry.fingerprint, entry.content,
                                    entry.p_source))
                handles.append(entry.handles)
            if not chunks:
                return
            ckv_slots, kr_slots = (torch.from_numpy(s).to(pool.ckv.device)
                                   for s in unpack(np.concatenate(handles)))
            # Fresh tensors: the slots may be written again once the entries are evicted.
            self.publisher.publish(chunks, pool.ckv[:, ckv_slots], pool.kr[:, kr_slots])
        except Exception:
            log.exception("publishing to the store failed")

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until what was published so far is written (tests, shutdown)."""
        return self.publisher.flush(timeout)

    def close(self) -> None:
        self.publisher.close()
        self.client.close()
