"""A circuit breaker: after a run of failures the store is not called at all for a while.

A store that is down must cost a request microseconds, not a connect time-out: once
``failures`` calls in a row have failed the breaker *opens* and :meth:`CircuitBreaker.allow`
refuses every call for ``cooldown`` seconds; then it lets one call through (*half-open*) and
closes again if that succeeds, or opens for another cooldown if it fails.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

State = Literal["closed", "open", "half-open"]


class CircuitBreaker:
    """Closed (calls go through), open (refused), half-open (one trial call). Thread-safe: the
    engine thread fetches while the publisher thread publishes."""

    def __init__(self, failures: int, cooldown: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.failures, self.cooldown, self._clock = failures, cooldown, clock
        self._lock = threading.Lock()
        self._failed = 0  # consecutive failures
        self._until = 0.0  # open until then
        self._trial = False  # a half-open trial call is out
        self.opened = 0  # times the breaker opened so far

    @property
    def state(self) -> State:
        with self._lock:
            if self._failed < self.failures:
                return "closed"
            return "open" if self._trial or self._clock() < self._until else "half-open"

    def allow(self) -> bool:
        """Whether a call may go out now (a half-open breaker lets one through)."""
        with self._lock:
            if self._failed < self.failures:
                return True
            if self._trial or self._clock() < self._until:
                return False
            self._trial = True
            return True

    def success(self) -> None:
        with self._lock:
            self._failed, self._trial = 0, False

    def failure(self) -> None:
        with self._lock:
            self._failed += 1
            self._trial = False
            if self._failed >= self.failures:
                if self._failed == self.failures:
                    self.opened += 1
                self._until = self._clock() + self.cooldown
