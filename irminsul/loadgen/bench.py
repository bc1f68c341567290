"""``irminsul bench serve``: replay agent sessions against a server per PIC mode.

For each workload and each mode a fresh ``irminsul serve --pic MODE`` is started (so every mode
starts from an empty cache and sees the same sessions, replies and arrival times), or one running
server is replayed against (``url``; each replay then sends its own ``cache_salt``, so what an
earlier run left in the server's cache is not reused by it).

Before the clock starts, ``warmup`` calls (the first call of each of the first sessions, replies
cut to a few tokens) are sent at once under a cache salt of their own: kernels compile and graphs
load on them, at the batch shapes the load will bring (prefill chunks beside decodes, batched
decode), and nothing they leave in the cache is reused by the measured calls. Sent one after
another they left the batched shapes to compile on the clock, and only in the mode that ran
first: Triton keeps compiled kernels on disk, so the next mode's server found them there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from .client import CallRecord, send_call
from .report import compare, summarize
from .runner import Run, run_sessions
from .server import ServerError, spawn_server
from .sessions import Call, Session

WARMUP_TOKENS = 16


@dataclass(frozen=True)
class Load:
    """How sessions are offered: ``concurrency`` at a time, or arriving at ``rate`` per second
    (seeded by ``seed``), capped at ``concurrency`` when both are given."""

    concurrency: int | None = 4
    rate: float | None = None
    seed: int = 0
    warmup: int | None = None  # None: as many as run at once (the concurrency, else 4)
    think_s: float = 0.0  # a session's pause between a reply and its next call (tools run)

    def warmup_calls(self) -> int:
        """How many warm-up calls are sent at once before the clock starts."""
        if self.warmup is not None:
            return self.warmup
        return self.concurrency or 4

    def describe(self) -> str:
        think = f", {self.think_s:g} s between a reply and the next call" if self.think_s else ""
        if self.rate is None:
            return f"{self.concurrency} sessions at a time{think}"
        cap = f", at most {self.concurrency} at a time" if self.concurrency else ""
        return f"sessions arriving at {self.rate:g}/s (Poisson, seed {self.seed}){cap}{think}"


def _client() -> httpx.AsyncClient:
    # No connection cap (a call never waits for a free connection on its clock), no read
    # timeout (a long prefill on a CPU is a slow answer, not a failure), no proxies.
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0),
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=None),
                             trust_env=False)


async def model_id(client: httpx.AsyncClient, url: str) -> str:
    """The model id the server serves (its first in /v1/models)."""
    response = await client.get(f"{url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def warm_up(sessions: Sequence[Session], calls: int,
                  send: Callable[[Call], Awaitable[CallRecord]]) -> str | None:
    """Send the first call of each of the first ``calls`` sessions at once, replies cut to
    WARMUP_TOKENS; the first error, if any."""
    first = [dataclasses.replace(s.calls[0], max_tokens=min(s.calls[0].max_tokens, WARMUP_TOKENS))
             for s in sessions[:calls] if s.calls]
    records = await asyncio.gather(*(send(call) for call in first))
    return next((r.error for r in records if r.error), None)


async def _replay(url: str, sessions: Sequence[Session], load: Load, *, label: str,
                  cache_salt: str | None, progress: bool) -> tuple[str, Run]:
    async with _client() as client:
        try:
            model = await model_id(client, url)
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
            raise ServerError(f"{url}: no model id from /v1/models ({err!r})") from err
        warm = f"irminsul-bench-warmup-{secrets.token_hex(8)}"

        async def send_warm(call: Call) -> CallRecord:
            return await send_call(client, url, model, call, origin=time.perf_counter(),
                                   cache_salt=warm)

        failed = await warm_up(sessions, load.warmup_calls(), send_warm)
        if failed:
            raise ServerError(f"{url}: a warm-up call failed: {failed}")

        async def send(call: Call, origin: float) -> CallRecord:
            return await send_call(client, url, model, call, origin=origin, cache_salt=cache_salt)

        run = await run_sessions(sessions, send, concurrency=load.concurrency, rate=load.rate,
                                 seed=load.seed, think=load.think_s, progress=progress,
                                 label=label)
    return model, run


def replay_mode(sessions: Sequence[Session], load: Load, *, label: str,
                serve_args: Sequence[str] | None = None, url: str | None = None,
                progress: bool = False) -> dict:
    """One replay: against a fresh ``irminsul serve SERVE_ARGS`` or the server at ``url``."""
    if (serve_args is None) == (url is None):
        raise ValueError("give either the server's arguments or its URL")
    if url is not None:
        salt = f"irminsul-bench-{secrets.token_hex(8)}"
        model, run = asyncio.run(_replay(url.rstrip("/"), sessions, load, label=label,
                                         cache_salt=salt, progress=progress))
        server = {"url": url, "cache_salt": salt}
    else:
        with tempfile.TemporaryDirectory(prefix="irminsul-bench-serve-") as tmp, \
                spawn_server(serve_args, Path(tmp) / "serve.log") as served:
            model, run = asyncio.run(_replay(served.url, sessions, load, label=label,
                                             cache_salt=None, progress=progress))
        server = {"command": ["irminsul", "serve", *serve_args],
                  "startup_line": served.startup_line}
    return {"server": server, "model": model, "summary": summarize(run),
            "sessions": [s.to_json() for s in run.sessions],
            "calls": [c.to_json() for c in run.calls]}


def bench_serve(workload: str, sessions: Sequence[Session], load: Load, *,
                modes: Sequence[str] = ("off", "live"), serve_args: Sequence[str] | None = None,
                url: str | None = None, progress: bool = False) -> dict:
    """Replay ``sessions`` once per mode (``--pic MODE`` added to ``serve_args``), or once
    against ``url``; the report of every replay, and live against off when both ran."""
    calls = sum(len(s.calls) for s in sessions)
    if not calls:
        raise ValueError(f"{workload}: no calls to replay")
    report: dict = {"workload": workload, "sessions": len(sessions), "calls": calls,
                    "load": load.describe(),
                    "config": {**dataclasses.asdict(load), "warmup": load.warmup_calls()},
                    "modes": {}}
    if url is not None:
        report["modes"]["server"] = replay_mode(sessions, load, label="server", url=url,
                                                progress=progress)
    else:
        for mode in modes:
            report["modes"][mode] = replay_mode(sessions, load, label=mode,
                                                serve_args=[*(serve_args or ()), "--pic", mode],
                                                progress=progress)
    found = report["modes"]
    if "off" in found and "live" in found:
        report["live_vs_off"] = compare(found["off"]["summary"], found["live"]["summary"])
    return report
