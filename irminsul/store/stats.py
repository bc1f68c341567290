"""What the store did, for the server's metrics: counters and the fetch-time histogram.

Updated by the engine thread (fetches) and the publisher thread (publishes), read by the
metrics endpoint when scraped; plain integers and a list behind a lock.
"""

from __future__ import annotations

import bisect
import threading

FETCH_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
ERROR_KINDS = ("unavailable", "corrupt", "mismatch", "publish_dropped")


class StoreStats:
    """Counters of one engine's store traffic."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hit_tokens = 0  # tokens whose rows came from the store instead of a prefill
        self.published_chunks = 0
        self.published_bytes = 0
        self.fetched_bytes = 0
        self.skipped_tokens = 0  # missed tokens the cost model chose to prefill
        self.errors = dict.fromkeys(ERROR_KINDS, 0)
        self.fetch_counts = [0] * (len(FETCH_BUCKETS) + 1)  # per bucket, +Inf last
        self.fetch_sum = 0.0

    def error(self, kind: str, count: int = 1) -> None:
        with self._lock:
            self.errors[kind] += count

    def add(self, name: str, value: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + value)

    def fetched(self, seconds: float) -> None:
        """A fetch's round trip took ``seconds``."""
        with self._lock:
            self.fetch_counts[bisect.bisect_left(FETCH_BUCKETS, seconds)] += 1
            self.fetch_sum += seconds

    def histogram(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (upper bound, count) buckets, +Inf last, and the sum: Prometheus's shape."""
        with self._lock:
            counts, total = list(self.fetch_counts), self.fetch_sum
        bounds = [str(b) for b in FETCH_BUCKETS] + ["+Inf"]
        cumulative, running = [], 0
        for bound, count in zip(bounds, counts):
            running += count
            cumulative.append((bound, running))
        return cumulative, total
