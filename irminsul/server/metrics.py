"""Prometheus metrics of the server: where prompt tokens came from, latency, engine load.

Names use the ``irminsul:`` prefix (colons are legal in Prometheus metric names and mark them as
the server's own, as ``vllm:`` does). Every app gets its own registry, so several apps in one
process (tests) do not collide in the global one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from ..engine import ServeStats
from ..engine.audit import KL_BUCKETS
from .async_engine import EngineSnapshot

if TYPE_CHECKING:
    from ..engine.audit import AuditStats
    from ..quality import GateResult
    from ..store.stats import StoreStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    """The counters, histograms and gauges, and the hooks that update them."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot],
                 store: StoreStats | None = None, audit: AuditStats | None = None) -> None:
        """``snapshot``: the engine's latest load; ``store``: the shared store's counters, when
        the engine has one (``irminsul:store_*``); ``audit``: the live-PIC audit's record
        (``irminsul:pic_audit_*``)."""
        self.registry = CollectorRegistry()
        r = self.registry
        if store is not None:
            r.register(_StoreCollector(store))
        if audit is not None:
            r.register(_AuditCollector(audit))

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"irminsul:{name}", doc, labels, registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of served requests")
        self.prefix_cached_tokens = counter(
            "prefix_cached_tokens", "Prompt tokens served from the exact-prefix radix tree")
        self.pic_cached_tokens = counter(
            "pic_cached_tokens", "Prompt tokens served from the position-independent registry")
        self.derived_prefix_cached_tokens = counter(
            "derived_prefix_cached_tokens", "Prompt tokens served from the radix tree whose rows "
            "derive from position-independent reuse (an earlier turn's): cached, not exact")
        self.would_be_pic_tokens = counter(
            "would_be_pic_tokens", "Registry hits prefilled anyway (observer mode)")
        self.prefilled_tokens = counter("prefilled_tokens", "Prompt tokens computed")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.requests_finished = counter("requests_finished", "Requests finished, by reason",
                                         ("reason",))
        self.request_errors = counter("request_errors", "Requests answered with an error (an "
                                      "error event mid-stream included), by HTTP status and "
                                      "OpenAI error code", ("status", "code"))
        self.ttft = Histogram("irminsul:time_to_first_token_seconds",
                              "Time from admission request to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("irminsul:e2e_request_latency_seconds",
                             "Time from submission to the last token", buckets=LATENCY_BUCKETS,
                             registry=r)

        # Gauges read the engine's latest published snapshot when scraped, never the engine.
        def gauge(name: str, doc: str, read: Callable[[EngineSnapshot], float]) -> None:
            Gauge(f"irminsul:{name}", doc, registry=r).set_function(lambda: read(snapshot()))

        gauge("kv_pool_usage_ratio", "Share of KV pool slots referenced (requests and indexes)",
              lambda s: s.pool_usage)
        gauge("kv_pool_free_slots", "KV pool slots free", lambda s: s.pool_free)
        gauge("kv_pool_capacity_slots", "KV pool slots in all", lambda s: s.pool_capacity)
        gauge("num_requests_running", "Requests being prefilled or decoded", lambda s: s.running)
        gauge("num_requests_waiting", "Requests waiting for admission", lambda s: s.waiting)
        gauge("engine_step_errors", "Engine steps that raised as a whole (their batch failed)",
              lambda s: s.step_errors)
        gauge("engine_request_failures", "Requests the engine failed alone (an error of their "
              "own while planning, computing or sampling); the batch went on",
              lambda s: s.request_failures)
        gauge("cuda_graph_replays", "Forwards replayed from a CUDA graph (batches of short spans)",
              lambda s: s.graph_replays)
        gauge("healed_tokens", "Cached rows that came from reuse, recomputed in idle time and "
              "swapped in for the reused ones (live PIC's heal)", lambda s: s.healed_tokens)

    def pic_gate(self, result: GateResult) -> None:
        """The PIC gate's verdict and figures at start (set once; absent if it did not run)."""
        r = self.registry
        Gauge("irminsul:pic_gate_passed", "1: the PIC correctness gate passed and live PIC "
              "serves; 0: it refused, and the server serves exact prefixes only",
              registry=r).set(int(result.passed))
        kl = Gauge("irminsul:pic_gate_kl", "The gate's mean KL(p_full || p_x) per token over "
                   "its probes (nats), for PIC (path=pic) and naive reuse (path=naive)",
                   ("path",), registry=r)
        kl.labels(path="pic").set(result.kl_pic)
        kl.labels(path="naive").set(result.kl_naive)
        Gauge("irminsul:pic_gate_argmax_match", "Share of the gate's continuation steps where "
              "PIC's argmax is full recomputation's token", registry=r).set(result.argmax)

    def prompt_served(self, stats: ServeStats, ttft: float | None) -> None:
        """A request's prompt was served (its first token arrived)."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.prefix_cached_tokens.inc(stats.prefix_tokens)
        self.pic_cached_tokens.inc(stats.pic_tokens)
        self.derived_prefix_cached_tokens.inc(stats.derived_prefix_tokens)
        self.would_be_pic_tokens.inc(stats.would_be_pic_tokens)
        self.prefilled_tokens.inc(stats.prefilled_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)

    def finished(self, reason: str, generated: int, latency: float) -> None:
        self.generation_tokens.inc(generated)
        self.requests_finished.labels(reason=reason).inc()
        self.e2e.observe(latency)

    def error(self, status: int, code: str | None) -> None:
        self.request_errors.labels(status=str(status), code=code or "none").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _AuditCollector(Collector):
    """The live-PIC audit's KL histogram and skips, read when scraped (the engine thread keeps
    them; see :mod:`irminsul.engine.audit`)."""

    def __init__(self, stats: AuditStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        s = self.stats
        counts, running, buckets = list(s.counts), 0, []
        for bound, count in zip((*KL_BUCKETS, float("inf")), counts):
            running += count
            buckets.append((str(bound) if bound != float("inf") else "+Inf", running))
        yield HistogramMetricFamily("irminsul:pic_audit_kl", "KL(full recomputation ‖ served) "
                                    "of the first token of sampled live-PIC requests, in nats, "
                                    "recomputed in idle capacity", buckets=buckets,
                                    sum_value=s.kl_sum)
        yield CounterMetricFamily("irminsul:pic_audit_skipped", "Requests picked for the audit "
                                  "while its queue was full", value=s.skipped)


class _StoreCollector(Collector):
    """The shared store's counters and fetch-time histogram, read when scraped (the engine and
    publisher threads keep them; see :mod:`irminsul.store.stats`)."""

    def __init__(self, stats: StoreStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        s = self.stats
        yield CounterMetricFamily("irminsul:store_hit_tokens", "Prompt tokens whose KV rows "
                                  "were fetched from the shared store instead of prefilled",
                                  value=s.hit_tokens)
        yield CounterMetricFamily("irminsul:store_published_chunks", "Chunks written to the "
                                  "shared store", value=s.published_chunks)
        yield CounterMetricFamily("irminsul:store_skipped_tokens", "Missed tokens the cost "
                                  "model chose to prefill rather than fetch",
                                  value=s.skipped_tokens)
        errors = CounterMetricFamily("irminsul:store_errors", "Shared-store failures, by kind: "
                                     "unavailable (down, time-out, restart), corrupt (checksum "
                                     "or length; dropped), mismatch (another model's, tenant's "
                                     "or chunk's value; not served), publish_dropped (queue "
                                     "full)", labels=("kind",))
        for kind, count in dict(s.errors).items():
            errors.add_metric((kind,), count)
        yield errors
        buckets, total = s.histogram()
        yield HistogramMetricFamily("irminsul:store_fetch_seconds", "Round trip of a batched "
                                    "store lookup (the rows of every chunk found included)",
                                    buckets=buckets, sum_value=total)
