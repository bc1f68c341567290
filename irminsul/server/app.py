"""The OpenAI-compatible HTTP API over an :class:`AsyncEngine`.

    POST /v1/chat/completions   chat messages rendered by the model's template (resets at message
                                starts and S2 marker edges); streaming (SSE) or not
    POST /v1/completions        a text prompt (or token ids); streaming or not
    GET  /v1/models             the one served model
    GET  /health                200 while the engine thread serves, 503 otherwise
    GET  /metrics               Prometheus text (see metrics.py)

Extensions to the OpenAI schema: ``top_k``; ``cache_salt`` (a tenant's private cache namespace:
requests with different salts never share KV, by prefix or by content); and in ``usage`` an
``irminsul`` block splitting ``prompt_tokens_details.cached_tokens`` into exact-prefix and
position-independent hits.

Bodies are parsed by hand, not by FastAPI's signature binding, so malformed JSON and every
invalid field answer HTTP 400 with an OpenAI-style error rather than FastAPI's 422.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..cache.cdc import namespace_seed
from ..config import ServerConfig
from ..traffic.render import ChatRenderer
from .async_engine import AsyncEngine, EngineError, RequestHandle
from .generation import Generation
from .metrics import CONTENT_TYPE, ServerMetrics
from .prompts import PromptTokens, chat_prompt, completion_prompt
from .protocol import ChatCompletionRequest, CompletionRequest, RequestError, parse

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class _Server:
    """What the routes share."""

    engine: AsyncEngine
    renderer: ChatRenderer
    model_name: str
    stop_token_ids: tuple[int, ...]
    metrics: ServerMetrics
    default_max_tokens: int
    context: int  # the model's context, in tokens
    pool_capacity: int  # KV pool slots
    vocab_size: int
    created: int

    def namespace(self, salt: str | None) -> int:
        """The cache namespace: the model, and the tenant's salt when one is given."""
        return (namespace_seed(self.model_name) if salt is None
                else namespace_seed(self.model_name, salt))

    def max_tokens(self, asked: int | None, prompt_tokens: int, default: int) -> int:
        """What the client asked for; by default ``default``, cut to what the context and the
        pool leave after the prompt (at least 1, so an overlong prompt fails with its own
        message)."""
        if asked is not None:
            return asked
        room = min(self.context, self.pool_capacity) - prompt_tokens
        return max(1, min(default, room))


def create_app(async_engine: AsyncEngine, renderer: ChatRenderer, model_name: str, *,
               stop_token_ids: tuple[int, ...] = (),
               default_max_tokens: int = ServerConfig.default_max_tokens,
               manage_engine: bool = True) -> FastAPI:
    """The app. With ``manage_engine`` its lifespan starts the engine thread and shuts it down."""
    limits = async_engine.limits
    server = _Server(async_engine, renderer, model_name, tuple(stop_token_ids),
                     ServerMetrics(lambda: async_engine.snapshot), default_max_tokens,
                     limits.context, limits.pool_capacity, limits.vocab_size, int(time.time()))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            async_engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="irminsul", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(RequestError)
    async def request_error(_: Request, err: RequestError) -> JSONResponse:
        server.metrics.request_errors.labels(status=str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        body = RequestError(str(err.detail), status=err.status_code).body()
        return JSONResponse(body, status_code=err.status_code, headers=err.headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse(ChatCompletionRequest, await _json(request))
        return await _complete(server, request, body, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse(CompletionRequest, await _json(request))
        return await _complete(server, request, body, chat=False)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": server.created,
            "owned_by": "irminsul", "max_model_len": server.context}]}

    @app.get("/health")
    async def health() -> Response:
        if async_engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine not running"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(f"malformed JSON body: {err}") from err


async def _complete(server: _Server, request: Request,
                    body: ChatCompletionRequest | CompletionRequest, *, chat: bool) -> Response:
    """Validate, submit, and answer one request (a stream or one JSON object)."""
    if body.model != server.model_name:
        raise RequestError(f"the model '{body.model}' does not exist; this server serves "
                           f"'{server.model_name}'", param="model", code="model_not_found")
    prompt = (chat_prompt(server.renderer, body) if chat else
              completion_prompt(server.renderer, body, server.vocab_size))
    limit = server.max_tokens(body.token_limit, len(prompt.tokens),
                              server.default_max_tokens if chat else COMPLETION_MAX_TOKENS)
    params = body.sampling_params(max_tokens=limit, stop_token_ids=server.stop_token_ids)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    handle = await _submit(server, prompt, params, body.cache_salt, request_id, chat)
    generation = Generation(handle, server.renderer.tokenizer, prompt.tokens,
                            body.stop_strings, server.metrics)
    shape = _Shape(request_id, server.model_name, int(time.time()), chat)
    if body.stream:
        return StreamingResponse(_sse(generation, shape, body.include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.create_task(_abort_on_disconnect(request, handle))
    try:
        text = "".join([piece async for piece in generation.text_deltas()])
    except EngineError as err:
        raise RequestError(str(err), status=500, kind="server_error") from err
    finally:
        watcher.cancel()
    return JSONResponse(shape.response(text, generation.finish_reason,
                                       generation.usage().to_json()))


async def _submit(server: _Server, prompt: PromptTokens, params: Any, salt: str | None,
                  request_id: str, chat: bool) -> RequestHandle:
    try:
        return await server.engine.submit(prompt.tokens, params, resets=prompt.resets,
                                          namespace=server.namespace(salt),
                                          request_id=request_id)
    except ValueError as err:  # the scheduler's verdict: too long for the context or the pool
        raise RequestError(str(err), param="messages" if chat else "prompt",
                           code="context_length_exceeded") from err
    except EngineError as err:
        raise RequestError(str(err), status=503, kind="server_error") from err


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

    def response(self, text: str, finish_reason: str | None, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
            out = self._envelope("chat.completion", choice)
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            out = self._envelope("text_completion", choice)
        return out | {"usage": usage}

    def chunk(self, text: str | None, finish_reason: str | None = None, *,
              role: bool = False) -> dict:
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
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


async def _sse(generation: Generation, shape: _Shape, include_usage: bool) -> AsyncIterator[str]:
    """The stream: (chat) a role chunk, text chunks, a finish chunk, optionally a usage chunk,
    then [DONE]. An engine failure is sent as an error event. Cancellation (the client left)
    propagates through ``text_deltas``, whose ``finally`` aborts the request."""
    try:
        if shape.chat:
            yield _event(shape.chunk("", role=True))
        async for piece in generation.text_deltas():
            yield _event(shape.chunk(piece))
        yield _event(shape.chunk(None if shape.chat else "", generation.finish_reason))
        if include_usage:
            yield _event(shape.usage_chunk(generation.usage().to_json()))
    except EngineError as err:
        yield _event(RequestError(str(err), status=500, kind="server_error").body())
    finally:
        generation.handle.abort()  # also when the stream never reached text_deltas
    yield _event("[DONE]")
