"""Sessions replayed against a server: each session's calls one after another (a call is sent when
the previous call of its session has its whole reply), sessions side by side.

Sessions start in order, either ``concurrency`` at a time (the next one as soon as one ends), or
arriving as a Poisson process of ``rate`` sessions per second (exponential gaps from a seeded
generator, the first at 0), optionally at most ``concurrency`` at once (a session that arrives
when that many run waits for one to end; its wait is in ``queued_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from tqdm import tqdm

from .client import CallRecord
from .sessions import Call, Session


@dataclass
class SessionRecord:
    """When one session ran, in seconds from the run's start."""

    session: str
    index: int
    calls: int
    arrival_s: float
    start_s: float = 0.0
    end_s: float = 0.0

    @property
    def wall_s(self) -> float:
        return self.end_s - self.start_s

    def to_json(self) -> dict:
        return asdict(self) | {"wall_s": self.wall_s, "queued_s": self.start_s - self.arrival_s}


@dataclass
class Run:
    """Every call (in session order) and session of one replay, and its wall time."""

    calls: list[CallRecord]
    sessions: list[SessionRecord]
    wall_s: float


def arrivals(count: int, rate: float | None, seed: int) -> np.ndarray:
    """Session start offsets in seconds: all 0 without a rate, else a seeded Poisson process
    (exponential gaps of mean 1/rate), the first at 0."""
    if rate is None:
        return np.zeros(count)
    if rate <= 0:
        raise ValueError(f"session rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if count else gaps


Send = Callable[[Call, float], Awaitable[CallRecord]]  # (call, run origin) -> its record


async def run_sessions(sessions: Sequence[Session], send: Send, *, concurrency: int | None,
                       rate: float | None = None, seed: int = 0, think: float = 0.0,
                       progress: bool = False, label: str = "") -> Run:
    """Replay ``sessions`` through ``send``, each session's calls in order, a call sent
    ``think`` seconds after the previous reply (an agent's tools running; 0: at once); a bar
    on stderr counts finished calls."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if think < 0:
        raise ValueError(f"think time must be >= 0, got {think}")
    if rate is None and concurrency is None:
        raise ValueError("give a concurrency, a session rate, or both")
    offsets = arrivals(len(sessions), rate, seed)
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    records = [SessionRecord(s.name, i, len(s.calls), float(offsets[i]))
               for i, s in enumerate(sessions)]
    calls: list[list[CallRecord]] = [[] for _ in sessions]
    bar = tqdm(total=sum(len(s.calls) for s in sessions), desc=f"bench serve: {label}",
               unit=" call", disable=not progress, leave=False)
    origin = time.perf_counter()

    async def replay(i: int, session: Session) -> None:
        await asyncio.sleep(max(0.0, origin + offsets[i] - time.perf_counter()))
        async with limit or contextlib.nullcontext():
            records[i].start_s = time.perf_counter() - origin
            for j, call in enumerate(session.calls):
                if j and think:
                    await asyncio.sleep(think)
                calls[i].append(await send(call, origin))
                bar.update()  # after the call's clock stopped
            records[i].end_s = time.perf_counter() - origin

    try:
        await asyncio.gather(*(replay(i, s) for i, s in enumerate(sessions)))
    finally:
        bar.close()
    wall = time.perf_counter() - origin
    return Run([r for per_session in calls for r in per_session], records, wall)
