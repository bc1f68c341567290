"""The router's backends: each one's index view, load, health and backoff, and their polling.

A backend is *up* until a connection to it or a poll of its index fails; then it is skipped for
``backoff_s``, doubled on each further failure up to ``backoff_max_s``, and polled again when
that has passed; the first poll that answers brings it back. A poll that connects but times out
(``timeout_s``) is a busy backend's, not a failure: a server reads its index between engine
steps, so a long prefill's step delays the answer. The backend keeps its last index and load
(counted *stale*: :attr:`Backend.stale`, and its index's age in the metrics) and stays up until
``poll_timeouts`` polls in a row time out. A backend that answers 404 at
``/irminsul/index`` (a server without a published index) is up with an empty index: it is
balanced by load only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from ..config import RouterConfig
from .digest import Digest, DigestError, Load
from .metrics import RouterMetrics
from .view import IndexView

log = logging.getLogger(__name__)


@dataclass
class Backend:
    """One backend as the router sees it. Event loop only."""

    url: str
    view: IndexView
    load: Load = field(default_factory=Load)
    in_flight: int = 0  # requests this router sent and has not seen end
    up: bool = True
    failures: int = 0  # consecutive
    retry_at: float = 0.0  # monotonic seconds: when a backend that is down is polled again
    last_error: str = ""
    stale: int = 0  # consecutive polls that timed out: its index and load are that old
    answered_at: float | None = None  # monotonic seconds: when the last answered poll was sent

    @property
    def queue(self) -> int:
        """Requests in flight there: what this router knows of now, or what the backend said
        at its last poll (other routers' included), whichever is more."""
        return max(self.in_flight, self.load.running + self.load.waiting)

    def mark_down(self, reason: str, config: RouterConfig, now: float | None = None) -> None:
        delay = min(config.backoff_max_s, config.backoff_s * 2 ** min(self.failures, 30))
        if self.up:
            log.warning("backend %s is down (%s); retrying in %.1f s", self.url, reason, delay)
        self.up, self.failures, self.last_error = False, self.failures + 1, reason
        self.retry_at = (time.monotonic() if now is None else now) + delay

    def mark_up(self) -> None:
        if not self.up:
            log.warning("backend %s is back", self.url)
        self.up, self.failures, self.stale = True, 0, 0

    def index_age(self, now: float | None = None) -> float | None:
        """Seconds since the last answered poll was sent (None: none answered yet)."""
        if self.answered_at is None:
            return None
        return (time.monotonic() if now is None else now) - self.answered_at

    def to_json(self) -> dict:
        v = self.view
        age = self.index_age()
        return {"url": self.url, "up": self.up, "failures": self.failures,
                "last_error": self.last_error, "stale_polls": self.stale,
                "index_age_s": None if age is None else round(age, 3),
                "in_flight": self.in_flight,
                "load": {"running": self.load.running, "waiting": self.load.waiting,
                         "kv_usage": self.load.kv_usage},
                "index": {"generation": v.generation, "version": v.version,
                          "prefix_blocks": len(v.prefix), "chunks": len(v.chunks),
                          "routed": v.routed}}


class Backends:
    """The backends in the configured order, and the tasks that poll them."""

    def __init__(self, config: RouterConfig, client: httpx.AsyncClient,
                 metrics: RouterMetrics) -> None:
        self.config, self.client, self.metrics = config, client, metrics
        self.all = [Backend(url.rstrip("/"), IndexView(config.routed)) for url in config.backends]
        self._tasks: list[asyncio.Task] = []
        self._turn = 0
        for backend in self.all:
            metrics.watch(backend)

    def __iter__(self) -> Iterator[Backend]:
        return iter(self.all)

    def up(self, exclude: set[str] = frozenset()) -> list[Backend]:
        return [b for b in self.all if b.up and b.url not in exclude]

    def next_in_turn(self, exclude: set[str] = frozenset()) -> Backend | None:
        """Round robin over the backends that are up."""
        for _ in range(len(self.all)):
            backend = self.all[self._turn % len(self.all)]
            self._turn += 1
            if backend.up and backend.url not in exclude:
                return backend
        return None

    async def poll(self, backend: Backend) -> None:
        """Poll one backend's index once; mark it up or down by the outcome (a time-out: down
        only at the ``poll_timeouts``-th in a row)."""
        asked_at = time.monotonic()
        params = {} if backend.view.generation is None else {
            "generation": backend.view.generation, "since": str(backend.view.version)}
        try:
            token = self.config.index_token
            headers = {} if token is None else {"Authorization": f"Bearer {token}"}
            response = await self.client.get(f"{backend.url}/irminsul/index", params=params,
                                             headers=headers, timeout=self.config.timeout_s)
            if response.status_code == 404:
                # No published index: balanced by load alone. Whatever an earlier process
                # there published (its content, its load) no longer holds.
                backend.view.clear(asked_at)
                backend.load = Load()
                backend.answered_at = asked_at
                backend.mark_up()
                self.metrics.poll(backend.url, "no_index")
                return
            response.raise_for_status()
            digest = Digest.from_json(response.json())
            backend.view.apply(digest, asked_at)
        except (httpx.HTTPError, DigestError, ValueError) as err:
            if isinstance(err, DigestError):  # start again from a full index
                backend.view.generation = None
            # Connected, not answered in time: busy (a connect time-out is no connection).
            if isinstance(err, httpx.TimeoutException) \
                    and not isinstance(err, httpx.ConnectTimeout):
                self.metrics.poll(backend.url, "timeout")
                backend.stale += 1
                if backend.up and backend.stale < self.config.poll_timeouts:
                    backend.last_error = f"index poll: {err!r} ({backend.stale} in a row)"
                    return  # routed by its last index and load meanwhile
                backend.mark_down(f"index poll: {backend.stale} time-outs in a row ({err!r})",
                                  self.config)
                return
            self.metrics.poll(backend.url, "error")
            backend.mark_down(f"index poll: {err!r}", self.config)
            return
        backend.load = digest.load
        backend.answered_at = asked_at
        backend.mark_up()
        self.metrics.poll(backend.url, "ok")

    async def _poll_forever(self, backend: Backend) -> None:
        while True:
            now = time.monotonic()
            if not backend.up and now < backend.retry_at:
                await asyncio.sleep(backend.retry_at - now)
                continue
            try:
                await self.poll(backend)
            except Exception:  # a bug here must not stop the polling of this backend
                log.exception("polling %s failed", backend.url)
            await asyncio.sleep(self.config.poll_interval_s)

    async def start(self) -> None:
        """Poll every backend once (concurrently), then keep polling them in the background."""
        await asyncio.gather(*(self.poll(b) for b in self.all))
        self._tasks = [asyncio.create_task(self._poll_forever(b)) for b in self.all]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
