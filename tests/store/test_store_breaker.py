"""The circuit breaker and the cost model, on their own."""

from __future__ import annotations

import pytest

from irminsul.store.breaker import CircuitBreaker
from irminsul.store.client import StoreClient
from irminsul.store.cost import CostModel


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_a_run_of_failures_and_tries_again_after_cooldown() -> None:
    clock = Clock()
    breaker = CircuitBreaker(3, 5.0, clock=clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.failure()
    assert breaker.state == "closed"
    breaker.success()  # a success ends the run
    for _ in range(3):
        assert breaker.allow()
        breaker.failure()
    assert breaker.state == "open" and not breaker.allow() and breaker.opened == 1
    clock.now = 5.1
    assert breaker.state == "half-open"
    assert breaker.allow()  # one trial call
    assert not breaker.allow()  # and only one
    breaker.failure()  # the trial failed: another cooldown
    assert breaker.state == "open" and not breaker.allow()
    clock.now = 10.2
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow()


def test_cost_model_weighs_bytes_over_bandwidth_against_prefill() -> None:
    cost = CostModel(1e9, 10_000.0, round_trip=1e-3)
    # 1,000 tokens: 0.1 s to prefill; 1 MB: 2 ms to fetch
    assert cost.worth_fetching(1000, 1 << 20)
    # 10 tokens: 1 ms to prefill, no faster than the round trip alone
    assert not cost.worth_fetching(10, 1000)
    # 1,000 tokens of 1 GB: 1 s over the link
    assert not cost.worth_fetching(1000, 1 << 30)
    for _ in range(50):  # the link turns out ten times slower than configured
        cost.observe(10 << 20, 1e-3 + (10 << 20) / 1e8)
    assert abs(cost.bandwidth / 1e8 - 1) < 0.01
    assert not cost.worth_fetching(1000, 20 << 20)


def test_a_trial_call_that_raises_anything_counts_as_a_failure() -> None:
    """A half-open breaker's one trial call that raises something other than a connection
    error still ends the trial: the breaker opens again and, after the next cooldown, allows
    another trial (it never stays refusing for good)."""
    clock = Clock()
    breaker = CircuitBreaker(1, 5.0, clock=clock)
    client = StoreClient("redis://127.0.0.1:1/0", timeout=0.01, breaker=breaker)
    assert breaker.allow()
    breaker.failure()
    clock.now = 5.1

    def odd() -> None:
        raise KeyError("not a redis error")

    with pytest.raises(KeyError):
        client._call("get", odd)
    assert breaker.state == "open"
    clock.now = 10.2
    assert breaker.allow()
