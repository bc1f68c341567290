"""The router's HTTP API: an OpenAI-compatible proxy in front of ``irminsul serve`` backends.

    POST /v1/chat/completions, /v1/completions
                          rendered and chunked as the backends do (the engine's renderer and
                          chunker), sent to the backend with the best score (score.py); the
                          answer, a stream included, passed through as the backend sent it,
                          its status and error bodies too, with ``x-irminsul-backend`` added
    GET  /v1/models       a backend's
    GET  /health          200 while a backend is up, 503 when none is
    GET  /metrics         the router's Prometheus metrics (metrics.py)
    GET  /irminsul/backends  each backend's state: up, load, index version and size

A body the router cannot parse or render is still forwarded (routed by load alone): the backend
answers it with the error it would give anyway, so clients see one validation, the engine's. A
backend that refuses the connection is marked down and the request goes to the next best one;
one that drops a kept-alive connection before answering (its keep-alive timeout firing as the
request arrived) is sent the request once more; once a backend has the request, what it
answers is the answer (a stream that breaks off ends with an error event, as the server's own
do). Rendering and chunking run on worker threads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import xxhash
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..cache.cdc import request_namespace
from ..config import RouterConfig
from ..server.prompts import chat_prompt, completion_prompt, open_forced_call
from ..server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    decode_json,
    parse,
    read_body,
)
from ..server.tool_calls import ToolSyntax
from ..traffic.render import ChatRenderer, Rendered
from .backends import Backend, Backends
from .digest import Chunking
from .keys import RequestKeys, request_keys
from .metrics import RouterMetrics
from .score import Candidate, choose

log = logging.getLogger(__name__)

# Headers that describe one connection, not the message: never forwarded either way.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade", "host",
                        "content-length"})
BACKEND_HEADER = "x-irminsul-backend"
ERROR_EVENT = b'data: {"error"'  # how the server's streams report a failure after their 200
# Idle pooled connections are given up after this long: before uvicorn's keep-alive timeout
# (5 s by default, what ``irminsul serve`` runs with) closes them at the other end, so a request
# is rarely sent on a connection the backend is closing.
KEEPALIVE_EXPIRY_S = 2.0
# A request that fails with one of these before any byte of an answer was sent on a kept-alive
# connection the backend closed as it arrived (that race, narrowed by KEEPALIVE_EXPIRY_S): the
# backend never read it, so it is sent once more.
DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


@dataclass(frozen=True)
class _Analysis:
    """What routing needs of a request body."""

    keys: RequestKeys | None  # None: the router could not render it
    session: str | None
    tie_key: int
    rendered: Rendered | None = None


@dataclass
class _Router:
    config: RouterConfig
    renderer: ChatRenderer
    backends: Backends
    client: httpx.AsyncClient
    metrics: RouterMetrics
    workers: ThreadPoolExecutor
    # How the backends' template writes tool calls: a request that requires one is served
    # with the call opened at its prompt's end (server.prompts.open_forced_call).
    tool_syntax: ToolSyntax | None = None
    sessions: OrderedDict[str, str] = field(default_factory=OrderedDict)  # session -> URL

    def remember(self, session: str | None, url: str) -> None:
        if session is None:
            return
        self.sessions[session] = url
        self.sessions.move_to_end(session)
        while len(self.sessions) > self.config.sessions:
            self.sessions.popitem(last=False)


def create_router_app(config: RouterConfig, renderer: ChatRenderer) -> FastAPI:
    """The router over ``config.backends``; ``renderer``: the backends' model's tokenizer and
    chat template (irminsul serve renders with the model directory's own)."""
    if not config.backends:
        raise ValueError("the router needs at least one backend (--backend URL)")
    metrics = RouterMetrics()
    # No read timeout: a long prefill is a slow answer, not a dead backend.
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=config.timeout_s),
                               limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=64,
                                                   keepalive_expiry=KEEPALIVE_EXPIRY_S),
                               trust_env=False)
    router = _Router(config, renderer, Backends(config, client, metrics), client, metrics,
                     ThreadPoolExecutor(config.render_workers,
                                        thread_name_prefix="irminsul-router"),
                     ToolSyntax.learn(renderer))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.backends.start()
        try:
            yield
        finally:
            await router.backends.stop()
            await client.aclose()
            router.workers.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="irminsul router", lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(RequestError)
    async def request_error(_: Request, err: RequestError) -> JSONResponse:
        router.metrics.errors.labels(err.code or "none").inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _proxy(router, request, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _proxy(router, request, "/v1/completions", chat=False)

    @app.get("/v1/models")
    async def models() -> Response:
        for backend in router.backends.up():
            try:
                answer = await client.get(f"{backend.url}/v1/models")
            except httpx.TransportError as err:
                backend.mark_down(f"/v1/models: {err!r}", config)
                continue
            return Response(answer.content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type"))
        raise _no_backend(router)

    @app.get("/health")
    async def health() -> Response:
        up = len(router.backends.up())
        return JSONResponse({"status": "ok" if up else "no backend up", "backends_up": up,
                             "backends": len(router.backends.all)},
                            status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        from prometheus_client.exposition import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/irminsul/backends")
    async def backends() -> dict:
        return {"policy": config.policy, "backends": [b.to_json() for b in router.backends]}

    return app


def _no_backend(router: _Router) -> RequestError:
    down = "; ".join(f"{b.url}: {b.last_error}" for b in router.backends)
    return RequestError(f"no backend is up ({down})", status=503, kind="server_error",
                        code="no_backend")


def _analyse(router: _Router, raw: bytes, chat: bool, session: str | None,
             chunkings: set[Chunking]) -> _Analysis:
    """Render and chunk a body as the backends will (on a worker thread); a body that does
    not parse or render gives no keys (the backend will say what is wrong with it)."""
    try:
        value = decode_json(raw)
        # An empty user names no session, as an empty session header does not.
        if session is None and isinstance(value, dict) and isinstance(value.get("user"), str):
            session = value["user"] or None
        body = parse(ChatCompletionRequest if chat else CompletionRequest, value)
        vocab = router.renderer.tokenizer.get_vocab_size(with_added_tokens=True)
        prompt = (open_forced_call(router.renderer, router.tool_syntax, body,
                                   chat_prompt(router.renderer, body)) if chat else
                  completion_prompt(router.renderer, body, vocab))
    except RequestError:
        tie = xxhash.xxh64_intdigest(session.encode("utf-8") if session else raw)
        return _Analysis(None, session, tie)
    keys = request_keys(np.asarray(prompt.tokens, dtype=np.int64),
                        np.asarray(prompt.resets, dtype=np.int64),
                        request_namespace(body.model, body.cache_salt), chunkings)
    tie = xxhash.xxh64_intdigest(session.encode("utf-8")) if session else keys.prompt_hash
    return _Analysis(keys, session, tie, prompt.rendered)


def _pick(router: _Router, analysis: _Analysis, tried: set[str]) -> tuple[Backend, str, int]:
    """The backend for a request, why, and the tokens its index says it would serve."""
    config, backends = router.config, router.backends
    up = backends.up(tried)
    if not up:
        raise _no_backend(router)
    if config.policy == "round_robin":
        chosen = backends.next_in_turn(tried)
        assert chosen is not None
        return chosen, "round_robin", 0
    keys = analysis.keys
    content = config.policy == "content"
    candidates = [Candidate(b.url, 0 if keys is None else b.view.cached_tokens(keys,
                                                                               content=content),
                            b.queue, b.load.kv_usage) for b in up]
    size = 0 if keys is None else keys.size
    best, reason = choose(candidates, size, config,
                          session_backend=(None if analysis.session is None
                                           else router.sessions.get(analysis.session)),
                          tie_key=analysis.tie_key)
    chosen = next(b for b in up if b.url == best.url)
    return chosen, ("unparsed" if keys is None else reason), best.cached


async def _proxy(router: _Router, request: Request, path: str, *, chat: bool) -> Response:
    """Forward a request to the best backend and relay its answer. A client that goes away
    before the answer starts (a non-streaming reply comes whole at the end) cancels the
    forwarding, which closes the backend's connection: the backend aborts the request, as it
    does for a client of its own, instead of generating for nobody."""
    raw = await read_body(request, router.config.max_request_bytes,
                          "the router's --max-request-bytes", router.config.body_timeout_s)
    forward = asyncio.ensure_future(_forward(router, request, path, raw, chat))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({forward, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()  # a stream's own disconnect watch is Starlette's, from here on
        if not forward.done():
            forward.cancel()
            await asyncio.gather(forward, return_exceptions=True)  # its counts put back
    if forward.cancelled():
        router.metrics.errors.labels("client_gone").inc()
        return Response(status_code=499)  # nobody reads it
    return forward.result()


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (its body was read whole before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _forward(router: _Router, request: Request, path: str, raw: bytes,
                   chat: bool) -> Response:
    start = time.perf_counter()
    chunkings = {b.view.chunking for b in router.backends if b.view.chunking is not None}
    session = request.headers.get(router.config.session_header) or None
    analysis = await asyncio.get_running_loop().run_in_executor(
        router.workers, _analyse, router, raw, chat, session, chunkings)
    # As the client sent them, in bytes: HTTP allows bytes above 0x7F in a value (obs-text, a
    # client's UTF-8 name, say), which httpx refuses in a value given as text (it encodes text
    # as ASCII); repeated headers stay repeated.
    headers = [(k, v) for k, v in request.headers.raw
               if k.decode("latin-1").lower() not in HOP_BY_HOP]
    tried: set[str] = set()
    resent = False
    while True:  # until a backend takes the request (each refused connection: the next best)
        backend, reason, cached = _pick(router, analysis, tried)
        ticket = None if analysis.keys is None else backend.view.route(analysis.keys)
        backend.in_flight += 1
        try:
            upstream = await router.client.send(
                router.client.build_request("POST", backend.url + path, content=raw,
                                            headers=headers), stream=True)
            break
        except BaseException as err:  # an HTTP error, or the client gone (cancelled)
            backend.in_flight -= 1
            if ticket is not None:
                backend.view.done(ticket, time.monotonic(), failed=True)
            if not isinstance(err, httpx.HTTPError):
                raise
            if isinstance(err, httpx.ConnectError | httpx.ConnectTimeout):
                backend.mark_down(f"connect: {err!r}", router.config)
                tried.add(backend.url)
                continue
            if isinstance(err, DROPPED) and not resent:
                resent = True  # once: a backend that keeps dropping requests gets its 502
                continue
            raise RequestError(f"backend {backend.url} failed before answering: {err!r}",
                               status=502, kind="server_error", code="upstream_error") from err
    router.metrics.route_seconds.observe(time.perf_counter() - start)
    router.metrics.decisions.labels(reason).inc()
    if analysis.keys is not None:
        router.metrics.prompt_tokens.inc(analysis.keys.size)
        router.metrics.expected_cached.inc(cached)
    if analysis.rendered is not None:
        router.renderer.remember(analysis.rendered)  # the next turn renders only what is new
    router.remember(analysis.session, backend.url)

    def finish(*, failed: bool) -> None:
        backend.in_flight -= 1
        if ticket is not None:
            backend.view.done(ticket, time.monotonic(), failed=failed)

    failed = upstream.status_code != 200  # an error enters no index
    reply_headers = {k: v for k, v in upstream.headers.items()
                     if k.lower() not in HOP_BY_HOP | {"date", "server"}}
    reply_headers[BACKEND_HEADER] = backend.url
    if upstream.headers.get("content-type", "").startswith("text/event-stream"):
        router.metrics.requests.labels(backend.url, str(upstream.status_code)).inc()
        return StreamingResponse(_relay(router, backend, upstream, finish, failed),
                                 status_code=upstream.status_code, headers=reply_headers)
    status = str(upstream.status_code)  # counted as what the client gets
    try:
        content = b"".join([chunk async for chunk in upstream.aiter_raw()])
    except httpx.HTTPError as err:
        finish(failed=True)
        status = "502"
        raise RequestError(f"backend {backend.url} broke off its answer: {err!r}", status=502,
                           kind="server_error", code="upstream_error") from err
    except BaseException:  # the client gone (cancelled)
        finish(failed=True)
        raise
    finally:
        router.metrics.requests.labels(backend.url, status).inc()
        await upstream.aclose()
    finish(failed=failed)
    return Response(content, status_code=upstream.status_code, headers=reply_headers)


async def _relay(router: _Router, backend: Backend, upstream: httpx.Response,
                 finish: Callable[..., None], failed: bool) -> AsyncIterator[bytes]:
    """A backend's stream, chunk by chunk as it comes; one that breaks off ends with an error
    event and ``[DONE]``. A client that goes away closes the backend's stream with it. A
    stream that carries an error event (the engine failed the request after its 200) counts as
    failed: its prompt entered no index there."""
    tail = b""  # the end of the chunk before: an event may be cut between two chunks
    try:
        async for chunk in upstream.aiter_raw():
            seen = tail + chunk
            if ERROR_EVENT in seen:
                failed = True
            tail = seen[-len(ERROR_EVENT):]
            yield chunk
    except httpx.HTTPError as err:
        failed = True
        router.metrics.errors.labels("upstream_broken").inc()
        error = RequestError(f"backend {backend.url} broke off the stream: {err!r}", status=502,
                             kind="server_error", code="upstream_broken")
        yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
    finally:
        await upstream.aclose()
        finish(failed=failed)


def build_router(config: RouterConfig, model_dir: str | os.PathLike) -> FastAPI:
    """The router app, rendering with ``model_dir``'s tokenizer and chat template (the
    backends' model: irminsul serve renders with its directory's own)."""
    renderer = ChatRenderer.from_dir(Path(model_dir), memo_bytes=config.render_memo_bytes)
    return create_router_app(config, renderer)


def serve_router(config: RouterConfig, model_dir: str | os.PathLike) -> None:
    """Run the router with uvicorn until interrupted."""
    import uvicorn

    logging.getLogger("irminsul").setLevel(logging.INFO)
    app = build_router(config, model_dir)
    log.info("irminsul router: %s routing over %s on %s:%d", config.policy,
             ", ".join(config.backends), config.host, config.port)
    uvicorn.run(app, host=config.host, port=config.port, log_level="info")
