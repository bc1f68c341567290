"""The router's own Prometheus metrics (``irminsul:router_*``), in a registry of its own."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from .backends import Backend

ROUTE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


class RouterMetrics:
    """Counters of requests, decisions, polls and errors; gauges read from the backends."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("irminsul:router_requests", "Requests answered by a backend, by "
                                "backend and HTTP status", ("backend", "status"), registry=r)
        self.decisions = Counter("irminsul:router_decisions", "Backend choices, by reason: score "
                                 "(best alone), session (a tie the session's last backend won), "
                                 "hash (a tie rendezvous hashing broke), round_robin, "
                                 "unparsed (a body the router could not render: by load)",
                                 ("reason",), registry=r)
        self.prompt_tokens = Counter("irminsul:router_prompt_tokens", "Prompt tokens of the "
                                     "requests routed (as the router rendered them)", registry=r)
        self.expected_cached = Counter("irminsul:router_expected_cached_tokens", "Prompt tokens "
                                       "the chosen backend's index said it would serve from "
                                       "cache", registry=r)
        self.polls = Counter("irminsul:router_index_polls", "Index polls, by backend and outcome "
                             "(ok, timeout: connected but not answered in time, error, "
                             "no_index)", ("backend", "outcome"), registry=r)
        self.errors = Counter("irminsul:router_errors", "Requests the router answered with an "
                              "error of its own, by code (no_backend, upstream_error, "
                              "request_too_large), broke off mid-stream (upstream_broken) or "
                              "stopped forwarding for a client gone (client_gone)",
                              ("code",), registry=r)
        self.route_seconds = Histogram("irminsul:router_route_seconds", "Time from a request's "
                                       "body to its backend chosen (rendering, chunking, "
                                       "scoring)", buckets=ROUTE_BUCKETS, registry=r)
        self._up = Gauge("irminsul:router_backend_up", "1 while a backend is up, 0 while it is "
                         "skipped", ("backend",), registry=r)
        self._in_flight = Gauge("irminsul:router_backend_in_flight", "Requests sent to a backend "
                                "and not ended", ("backend",), registry=r)
        self._version = Gauge("irminsul:router_backend_index_version", "The version of a "
                              "backend's index the router holds", ("backend",), registry=r)
        self._age = Gauge("irminsul:router_backend_index_age_seconds", "Seconds since the "
                          "backend's last answered index poll was sent: its index's and load's "
                          "age (NaN: none answered yet)", ("backend",), registry=r)

    def watch(self, backend: Backend) -> None:
        """Export a backend's state, read when scraped."""
        self._up.labels(backend.url).set_function(lambda: float(backend.up))
        self._in_flight.labels(backend.url).set_function(lambda: backend.in_flight)
        self._version.labels(backend.url).set_function(lambda: backend.view.version or 0)
        self._age.labels(backend.url).set_function(
            lambda: age if (age := backend.index_age()) is not None else float("nan"))

    def poll(self, backend: str, outcome: str) -> None:
        self.polls.labels(backend, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
