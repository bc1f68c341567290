"""The OpenAI-compatible HTTP API over an :class:`AsyncEngine`.

    POST /v1/chat/completions   chat messages rendered by the model's template (resets at message
                                starts and S2 marker edges); streaming (SSE) or not
    POST /v1/completions        a text prompt (or token ids); streaming or not
    GET  /v1/models             the one served model
    GET  /health                200 while the engine thread serves, 503 otherwise
    GET  /metrics               Prometheus text (see metrics.py)
    GET  /irminsul/index        the cache's published index for routers (see index.py), since
                                ``?generation=G&since=V`` when given; with
                                ``ServerConfig.index_token``, to its bearer only

Extensions to the OpenAI schema: ``top_k``; ``cache_salt`` (a tenant's private cache namespace:
requests with different salts never share KV, by prefix or by content); and in ``usage`` an
``irminsul`` block splitting ``prompt_tokens_details.cached_tokens`` into exact-prefix and
position-independent hits.

One client never hurts another. A body larger than the limit is refused (413) before it is read
whole; parsing, validation, rendering and tokenising run on a pool of worker threads, so a large
request never blocks /health or the other clients; too many requests waiting for their first
token get 429 with ``Retry-After``. Bodies are parsed by hand, not by FastAPI's signature
binding, so every invalid field answers 400 with an OpenAI-style error naming it; every error,
an unexpected one included, is JSON in that shape and counted in
``irminsul:request_errors_total`` by status and code.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..cache.cdc import request_namespace
from ..config import ServerConfig
from ..engine import Limits, PromptTooLong
from ..traffic.render import ChatRenderer
from .async_engine import AsyncEngine, EngineError, RequestHandle
from .generation import Generation
from .index import IndexPublisher
from .metrics import CONTENT_TYPE, ServerMetrics
from .prompts import PromptTokens, chat_prompt, completion_prompt, open_forced_call
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    decode_json,
    parse,
    read_body,
)
from .tool_calls import ToolCallDelta, ToolCallReader, ToolSyntax

if TYPE_CHECKING:
    from ..quality import GateResult
    from ..store.stats import StoreStats

log = logging.getLogger(__name__)

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
RETRY_AFTER_S = 1  # what a 429 tells the client to wait
VERSION_DIGITS = 20  # the most digits of an index version the server may hold (2**64 - 1)


@dataclass
class _Server:
    """What the routes share."""

    engine: AsyncEngine
    renderer: ChatRenderer
    model_name: str
    stop_token_ids: tuple[int, ...]
    metrics: ServerMetrics
    config: ServerConfig
    max_request_bytes: int
    max_unstarted: int  # requests without a first token, beyond which new ones get 429
    workers: ThreadPoolExecutor
    tool_syntax: ToolSyntax | None  # how the template writes tool calls (None: it writes none)
    created: int = field(default_factory=lambda: int(time.time()))
    unstarted: int = 0  # requests accepted that have not had their first token (event loop only)

    @property
    def limits(self) -> Limits:
        return self.engine.limits

    def namespace(self, salt: str | None) -> int:
        """The cache namespace: the model, and the tenant's salt when one is given."""
        return request_namespace(self.model_name, salt)

    def max_tokens(self, asked: int | None, prompt_tokens: int, default: int) -> int:
        """What the client asked for; by default ``default``, cut to what the context and the
        pool leave after the prompt (at least 1, so an overlong prompt fails with its own
        message)."""
        if asked is not None:
            return asked
        room = min(self.limits.context, self.limits.pool_capacity) - prompt_tokens
        return max(1, min(default, room))

    def admit(self) -> _Ticket:
        """A place among the requests waiting for their first token, or 429."""
        if self.unstarted >= self.max_unstarted:
            raise RequestError(f"too many requests waiting ({self.unstarted}); retry later",
                               status=429, kind="rate_limit_error", code="rate_limit_exceeded",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        self.unstarted += 1
        return _Ticket(self)


class _Ticket:
    """One request's place among those waiting for a first token; given back once."""

    def __init__(self, server: _Server) -> None:
        self._server: _Server | None = server

    def release(self) -> None:
        if self._server is not None:
            self._server.unstarted -= 1
            self._server = None


def _store_stats(async_engine: AsyncEngine) -> StoreStats | None:
    """The shared store's counters, when the engine has a store (irminsul.store.attach)."""
    store = async_engine.scheduler.engine.cache.store
    return None if store is None else store.stats


def create_app(async_engine: AsyncEngine, renderer: ChatRenderer, model_name: str, *,
               stop_token_ids: tuple[int, ...] = (), config: ServerConfig | None = None,
               manage_engine: bool = True, gate: GateResult | None = None) -> FastAPI:
    """The app. With ``manage_engine`` its lifespan starts the engine thread and shuts it down.
    ``config`` gives the request limits and the worker pool (ServerConfig's defaults if None).
    ``gate``: the PIC gate's result at start, exported as ``irminsul:pic_gate_*`` (None: the
    gate did not run, and those metrics are absent)."""
    config = config or ServerConfig()
    limits = async_engine.limits
    server = _Server(async_engine, renderer, model_name, tuple(stop_token_ids),
                     ServerMetrics(lambda: async_engine.snapshot, _store_stats(async_engine),
                                   async_engine.scheduler.audit.stats),
                     config,
                     config.request_bytes_for(limits.context),
                     async_engine.scheduler.max_running + config.max_waiting,
                     ThreadPoolExecutor(config.render_workers, thread_name_prefix="irminsul-render"),
                     ToolSyntax.learn(renderer))
    if server.tool_syntax is None:
        log.info("the chat template writes no tool calls: replies to requests with tools are "
                 "returned as text")
    if gate is not None:
        server.metrics.pic_gate(gate)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            async_engine.start()
        try:
            yield
        finally:
            server.workers.shutdown(wait=False, cancel_futures=True)
            if manage_engine:
                await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="irminsul", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(RequestError)
    async def request_error(_: Request, err: RequestError) -> JSONResponse:
        server.metrics.error(err.status, err.code)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        server.metrics.error(err.status_code, None)
        body = RequestError(str(err.detail), status=err.status_code).body()
        return JSONResponse(body, status_code=err.status_code, headers=err.headers)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest, model_name))
    async def chat_completions(request: Request) -> Response:
        return await _handle(server, request, chat=True)

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest, model_name))
    async def completions(request: Request) -> Response:
        return await _handle(server, request, chat=False)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": server.created,
            "owned_by": "irminsul", "max_model_len": limits.context}]}

    @app.get("/health")
    async def health() -> Response:
        if async_engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine not running"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    index = IndexPublisher(async_engine)

    @app.get("/irminsul/index")
    async def published_index(request: Request) -> Response:
        token = config.index_token
        if token is not None and not hmac.compare_digest(
                request.headers.get("authorization", "").encode(), f"Bearer {token}".encode()):
            raise RequestError("the index needs the router's token (Authorization: Bearer)",
                               status=401, code="invalid_index_token",
                               headers={"WWW-Authenticate": "Bearer"})
        since = request.query_params.get("since")
        if since is not None and not (since.isascii() and since.isdigit()):
            raise RequestError(f"since must be a version number, got {since!r}", param="since",
                               code="invalid_value")
        # A version is a count of changes: a number of more digits than 2**64 has is none this
        # process holds, and is answered as one (the whole index), not read (int() refuses a
        # string of over 4,300 digits).
        version = None if since is None or len(since) > VERSION_DIGITS else int(since)
        try:
            digest = await index.digest(request.query_params.get("generation"), version)
        except EngineError as err:
            raise RequestError(str(err), status=503, kind="server_error",
                               code="engine_unavailable") from err
        return JSONResponse(digest.to_json())

    return app


def _body_schema(model: type, model_name: str) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses its body by hand (for /docs and for
    schema-driven clients and fuzzers): the pydantic model's JSON schema with its definitions
    inlined, and the one model id this server accepts."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    schema = inline(schema)
    schema["properties"]["model"] = {"type": "string", "enum": [model_name]}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


async def _handle(server: _Server, request: Request, *, chat: bool) -> Response:
    """One generation request from its bytes to its response; any failure is answered as an
    OpenAI error (a RequestError), never as a dropped connection."""
    ticket = server.admit()
    streaming = False
    try:
        raw = await read_body(request, server.max_request_bytes, "--max-request-bytes",
                              server.config.body_timeout_s)
        body, prompt = await asyncio.get_running_loop().run_in_executor(
            server.workers, _prepare, server, raw, chat)
        response = await _complete(server, request, body, prompt, ticket, chat)
        streaming = isinstance(response, StreamingResponse)
        return response
    except RequestError:
        raise
    except Exception as err:
        log.exception("request failed")
        raise RequestError(f"internal error: {err!r}", status=500, kind="server_error",
                           code="internal_error") from err
    finally:
        if not streaming:  # a stream gives its place back at its first token
            ticket.release()


def _prepare(server: _Server, raw: bytes, chat: bool
             ) -> tuple[ChatCompletionRequest | CompletionRequest, PromptTokens]:
    """Decode, validate and render a body (on a worker thread)."""
    body = parse(ChatCompletionRequest if chat else CompletionRequest, decode_json(raw))
    if body.model != server.model_name:
        raise RequestError(f"the model '{body.model}' does not exist; this server serves "
                           f"'{server.model_name}'", param="model", code="model_not_found")
    if not chat:
        return body, completion_prompt(server.renderer, body, server.limits.vocab_size)
    prompt = chat_prompt(server.renderer, body)
    return body, open_forced_call(server.renderer, server.tool_syntax, body, prompt)


async def _complete(server: _Server, request: Request,
                    body: ChatCompletionRequest | CompletionRequest, prompt: PromptTokens,
                    ticket: _Ticket, chat: bool) -> Response:
    """Submit a prepared request and answer it (a stream or one JSON object)."""
    default = server.config.default_max_tokens if chat else COMPLETION_MAX_TOKENS
    limit = server.max_tokens(body.token_limit, len(prompt.tokens), default)
    params = body.sampling_params(max_tokens=limit, stop_token_ids=server.stop_token_ids)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    handle = await _submit(server, prompt, params, body.cache_salt, request_id, chat)
    if prompt.rendered is not None:  # accepted: its rendering is worth keeping
        server.renderer.remember(prompt.rendered)
    generation = Generation(handle, server.renderer.tokenizer, prompt.tokens,
                            body.stop_strings, server.metrics, on_start=ticket.release,
                            tool_calls=_tool_reader(server, body, request_id))
    shape = _Shape(request_id, server.model_name, int(time.time()), chat)
    if body.stream:
        return StreamingResponse(_sse(generation, shape, body.include_usage, server.metrics.error),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.create_task(_abort_on_disconnect(request, handle))
    try:
        text, calls = await generation.reply()
    except EngineError as err:
        raise RequestError(str(err), status=500, kind="server_error",
                           code="engine_error") from err
    finally:
        watcher.cancel()
    return JSONResponse(shape.response(text, generation.finish_reason,
                                       generation.usage().to_json(), calls))


def _tool_reader(server: _Server, body: ChatCompletionRequest | CompletionRequest,
                 request_id: str) -> ToolCallReader | None:
    """A reader of the reply's tool calls, for a chat request offering tools to call."""
    if (server.tool_syntax is None or not isinstance(body, ChatCompletionRequest)
            or not body.tools or body.tool_choice == "none"):
        return None
    return ToolCallReader(server.tool_syntax, server.renderer.tokenizer,
                          [tool.function.name for tool in body.tools], server.stop_token_ids,
                          request_id=request_id, forced=body.forced_call,
                          max_calls=1 if body.parallel_tool_calls is False else None)


async def _submit(server: _Server, prompt: PromptTokens, params: Any, salt: str | None,
                  request_id: str, chat: bool) -> RequestHandle:
    try:
        return await server.engine.submit(prompt.tokens, params, resets=prompt.resets,
                                          namespace=server.namespace(salt),
                                          request_id=request_id)
    except PromptTooLong as err:  # the scheduler's verdict: too long for the context or the pool
        raise RequestError(str(err), param="messages" if chat else "prompt",
                           code="context_length_exceeded") from err
    except ValueError as err:
        raise RequestError(str(err), param="messages" if chat else "prompt",
                           code="invalid_value") from err
    except EngineError as err:
        raise RequestError(str(err), status=503, kind="server_error",
                           code="engine_unavailable") from err


async def _abort_on_disconnect(request: Request, handle: RequestHandle) -> None:
    """Abort a non-streaming request whose client went away (streams are cancelled by
    Starlette itself, which aborts them through the generation's ``finally``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.abort()
            return


@dataclass(frozen=True)
class _Shape:
    """The OpenAI JSON shapes of one response (chat or text completion)."""

    id: str
    model: str
    created: int
    chat: bool

    def _envelope(self, obj: str, choice: dict) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice]}

    def response(self, text: str, finish_reason: str | None, usage: dict,
                 tool_calls: list[dict] | None = None) -> dict:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message["content"], message["tool_calls"] = text or None, tool_calls
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": finish_reason}
            out = self._envelope("chat.completion", choice)
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            out = self._envelope("text_completion", choice)
        return out | {"usage": usage}

    def chunk(self, text: str | ToolCallDelta | None, finish_reason: str | None = None, *,
              role: bool = False) -> dict:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if isinstance(text, ToolCallDelta):
                delta["tool_calls"] = [text.to_json()]
            elif text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", choice)
        choice = {"index": 0, "text": text or "", "logprobs": None,
                  "finish_reason": finish_reason}
        return self._envelope("text_completion", choice)

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [], "usage": usage}


def _event(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def _sse(generation: Generation, shape: _Shape, include_usage: bool,
               count_error: Callable[[int, str | None], None]) -> AsyncIterator[str]:
    """The stream: (chat) a role chunk, text chunks, a finish chunk, optionally a usage chunk,
    then [DONE]. A failure mid-stream is sent as an error event (and counted). Cancellation (the
    client left) propagates through ``deltas``, whose ``finally`` aborts the request."""
    try:
        if shape.chat:
            yield _event(shape.chunk("", role=True))
        async for piece in generation.deltas():
            yield _event(shape.chunk(piece))
        yield _event(shape.chunk(None if shape.chat else "", generation.finish_reason))
        if include_usage:
            yield _event(shape.usage_chunk(generation.usage().to_json()))
    except Exception as err:
        if not isinstance(err, EngineError):
            log.exception("stream failed")
        error = RequestError(str(err), status=500, kind="server_error", code="engine_error")
        count_error(error.status, error.code)
        yield _event(error.body())
    finally:
        generation.handle.abort()  # also when the stream never reached deltas
        generation.started()  # a stream that never reached its first token
    yield _event("[DONE]")
