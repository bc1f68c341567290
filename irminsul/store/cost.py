"""The cost model: fetch a run's rows from the store, or prefill them?

Fetching ``n`` tokens costs a round trip plus their bytes over the link; prefilling them costs
``n`` tokens at the engine's prefill rate. Both estimates are linear in what is asked, so one
batched lookup is fetched whole or not at all. The link's bandwidth and round trip start from
the configured guesses and follow what fetches measure (an exponential average); the prefill
rate is the deployment's (``StoreConfig.prefill_tokens_per_second``).
"""

from __future__ import annotations

import threading

SMOOTHING = 0.2  # weight of each new measurement in the averages
MIN_BANDWIDTH_BYTES = 64 << 10  # a smaller fetch measures the round trip, not the bandwidth
# Batches declined in a row after which one is fetched anyway: the averages learn only from
# fetches, so without a trial a link that was slow for a while would never be measured again.
PROBE_AFTER = 32


class CostModel:
    """Seconds to fetch bytes, seconds to prefill tokens, and the choice between them."""

    def __init__(self, bandwidth: float, prefill_tokens_per_second: float, *,
                 round_trip: float = 5e-4) -> None:
        self.bandwidth, self.round_trip = float(bandwidth), float(round_trip)
        self.prefill_rate = float(prefill_tokens_per_second)
        self._lock = threading.Lock()
        self._declined = 0  # batches declined in a row

    def fetch_seconds(self, nbytes: int) -> float:
        return self.round_trip + nbytes / self.bandwidth

    def prefill_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_rate

    def worth_fetching(self, tokens: int, nbytes: int) -> bool:
        """Whether fetching ``nbytes`` of rows beats prefilling those ``tokens`` (or, after
        ``PROBE_AFTER`` declined batches in a row, whether to fetch one anyway to measure the
        link again)."""
        if self.fetch_seconds(nbytes) < self.prefill_seconds(tokens):
            self._declined = 0
            return True
        self._declined += 1
        if self._declined >= PROBE_AFTER:
            self._declined = 0
            return True
        return False

    def observe(self, nbytes: int, seconds: float) -> None:
        """A round trip that brought ``nbytes`` back in ``seconds``."""
        with self._lock:
            if nbytes < MIN_BANDWIDTH_BYTES:
                self.round_trip += SMOOTHING * (seconds - self.round_trip)
                return
            moving = max(seconds - self.round_trip, 1e-6)
            self.bandwidth += SMOOTHING * (nbytes / moving - self.bandwidth)
