"""Publishing off the request path: a thread drains a queue of rows to write to the store.

The engine thread only gathers the new chunks' rows into fresh tensors (device work queued
behind the forward that wrote them, so later writes to the same slots cannot change them) and
hands them over; this thread copies them to the host, encodes and writes them, one round trip a
batch. A full queue (a store slower than the engine registers) drops the batch and counts it:
publishing is best effort, serving never waits for it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch

from .client import StoreClient, StoreUnavailable
from .stats import StoreStats
from .value import Rows, Shape, encode

log = logging.getLogger(__name__)


class Chunk(NamedTuple):
    """One registered chunk to publish: its key and what its value's header says."""

    key: str
    namespace: int
    fingerprint: int
    tokens: bytes  # int64 bytes
    p_source: int


class _Batch(NamedTuple):
    chunks: list[Chunk]
    ckv: torch.Tensor  # [layers, sum of the chunks' tokens, rank], on the pool's device
    kr: torch.Tensor
    nbytes: int


class Publisher:
    """A daemon thread writing published rows to the store; :meth:`close` stops it."""

    def __init__(self, client: StoreClient, shape: Shape, stats: StoreStats, *, ttl_s: int,
                 max_value_bytes: int, max_queued_bytes: int) -> None:
        self.client, self.shape, self.stats = client, shape, stats
        self.ttl_s, self.max_value_bytes = ttl_s, max_value_bytes
        self.max_queued_bytes = max_queued_bytes
        self._queued = 0  # bytes of rows in the queue
        self._lock = threading.Lock()
        # Batches to write, keys to delete, callbacks (flush), None (stop)
        self._queue: queue.Queue[_Batch | list[str] | Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="irminsul-store-publish",
                                        daemon=True)
        self._thread.start()

    def publish(self, chunks: list[Chunk], ckv: torch.Tensor, kr: torch.Tensor) -> None:
        """Queue chunks whose rows are ``ckv`` / ``kr`` back to back along dim 1 (their own
        tensors: nothing else writes them); dropped and counted if the queue is full."""
        nbytes = ckv.numel() * ckv.element_size() + kr.numel() * kr.element_size()
        with self._lock:
            if self._queued + nbytes > self.max_queued_bytes:
                self.stats.error("publish_dropped", len(chunks))
                return
            self._queued += nbytes
        self._queue.put(_Batch(chunks, ckv, kr, nbytes))

    def delete(self, keys: list[str]) -> None:
        """Queue keys to delete (values found corrupt: the next publisher writes them anew)."""
        self._queue.put(list(keys))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is written (or dropped); tests and shutdown."""
        done = threading.Event()
        self._queue.put(done.set)
        return done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                if isinstance(job, list):
                    self.client.delete(job)
                elif isinstance(job, _Batch):
                    self._write(job)
                else:
                    job()
            except StoreUnavailable as err:
                self.stats.error("unavailable")
                log.debug("%s", err)
            except Exception:  # a bug here must not end publishing for good
                log.exception("publishing to the store failed")
            finally:
                if isinstance(job, _Batch):
                    with self._lock:
                        self._queued -= job.nbytes

    def _write(self, batch: _Batch) -> None:
        ckv, kr = batch.ckv.cpu(), batch.kr.cpu()
        items, at = [], 0
        for chunk in batch.chunks:
            n = len(chunk.tokens) // 8
            rows = Rows(chunk.p_source, ckv[:, at:at + n], kr[:, at:at + n])
            at += n
            value = encode(self.shape, chunk.namespace, chunk.fingerprint, chunk.tokens, rows)
            if len(value) <= self.max_value_bytes:
                items.append((chunk.key, value))
        self.client.put_many(items, self.ttl_s)
        self.stats.add("published_chunks", len(items))
        self.stats.add("published_bytes", sum(len(v) for _, v in items))
