"""A server in front of untrusted clients: each repro of issue #18 as a test that failed before
the fix. Bad input gets a JSON error naming what was wrong, on a connection that stays usable;
one request never fails, blocks or grows the memory of another."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
import uuid
from urllib.parse import urlparse

import httpx
import pytest
from fixtures.openai_server import Server, config, running
from fixtures.raw_http import read_response
from fixtures.tiny_server_model import sentences

import irminsul.engine.scheduler as scheduler_module
import irminsul.server.app as app_module
from irminsul.config import EngineConfig
from irminsul.engine.sampler import sample

CHAT = "/v1/chat/completions"


def _messages(seed: int, question: str = "Which train leaves first?") -> list[dict]:
    return [{"role": "system", "content": " ".join(sentences(4, seed))},
            {"role": "user", "content": question}]


def _body(**fields) -> dict:
    return {"model": "tiny", "messages": _messages(1), "max_tokens": 4, "temperature": 0} | fields


class Connection:
    """One keep-alive HTTP/1.1 connection; ``post`` fails if the server closed it in between."""

    def __init__(self, server: Server) -> None:
        url = urlparse(server.url)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        self.sock = None

    def post(self, path: str, raw: bytes) -> tuple[int, dict]:
        self.conn.request("POST", path, raw, {"Content-Type": "application/json"})
        if self.sock is None:
            self.sock = self.conn.sock
        assert self.conn.sock is self.sock, "the server dropped the connection"
        response = self.conn.getresponse()
        payload = response.read()
        assert response.getheader("content-type", "").startswith("application/json"), payload
        assert (response.getheader("connection") or "").lower() != "close"
        return response.status, json.loads(payload)

    def close(self) -> None:
        self.conn.close()


# -- one request never fails another's -------------------------------------------------------


async def _streams(server: Server, bodies: list[dict]) -> list[tuple[str, str | None]]:
    """Stream every body at once; each one's text and its error event, if any."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        async def one(body: dict) -> tuple[str, str | None]:
            text, error = [], None
            async with client.stream("POST", CHAT, json=body | {"stream": True}) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]["message"]
                    else:
                        text.append(event["choices"][0]["delta"].get("content") or "")
            return "".join(text), error

        return await asyncio.gather(*(one(b) for b in bodies))


def _innocent(run: str) -> list[dict]:
    """Four greedy 200-token streams, each in its own cache namespace for this run (so runs do
    not reuse each other's KV: outputs compare exactly)."""
    return [_body(messages=_messages(20 + i), max_tokens=200, cache_salt=f"{run}-{i}")
            for i in range(4)]


def test_extreme_sampling_parameters_leave_other_streams_untouched(server: Server) -> None:
    """The repro: a temperature of 1e-40 (or a top_p of 1e-45) used to crash the shared engine
    step and fail every stream in the batch. Now it samples greedily, and the streams beside it
    produce what they produce without it."""
    alone = asyncio.run(_streams(server, _innocent("alone")))
    assert all(error is None and text for text, error in alone)
    poisons = [_body(temperature=1e-40, max_tokens=4, cache_salt="p1"),
               _body(temperature=1.0, top_p=1e-45, max_tokens=4, cache_salt="p2")]
    mixed = asyncio.run(_streams(server, _innocent("mixed") + poisons))
    assert mixed[:4] == alone
    assert all(error is None for _, error in mixed[4:])
    server.check()


def test_a_failing_request_fails_alone_among_streams(server: Server, monkeypatch) -> None:
    """An error while sampling one request (injected) ends that request with an error event;
    the four streams beside it are identical to a run without it."""
    alone = asyncio.run(_streams(server, _innocent("solo")))

    def faulty(logits, params, generator):
        if params.seed == 4242:
            raise RuntimeError("injected sampling fault")
        return sample(logits, params, generator)

    monkeypatch.setattr(scheduler_module, "sample", faulty)
    poisoned = _body(seed=4242, temperature=0.5, max_tokens=50, cache_salt="poisoned")
    mixed = asyncio.run(_streams(server, _innocent("beside") + [poisoned]))
    assert mixed[:4] == alone
    assert "injected sampling fault" in mixed[4][1]
    assert server.metric("irminsul:engine_request_failures") >= 1
    server.check()


# -- bounded resources ------------------------------------------------------------------------


def test_oversized_bodies_are_refused_before_parsing(server: Server) -> None:
    limit = server.app.state.server.max_request_bytes
    huge = json.dumps(_body(messages=[{"role": "user", "content": "x" * limit}])).encode()
    errors = server.errors(413, "request_too_large")
    response = httpx.post(f"{server.url}{CHAT}", content=huge,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "exceeds the limit" in response.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit holds while reading
        for i in range(0, len(huge), 1 << 16):
            yield huge[i:i + (1 << 16)]

    response = httpx.post(f"{server.url}{CHAT}", content=chunks(),
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert server.errors(413, "request_too_large") == errors + 2


def test_stalled_and_abandoned_uploads_give_back_their_places(server: Server,
                                                              monkeypatch) -> None:
    """A body that stops arriving gets 408 once the body timeout passes, and its place among
    the requests waiting for a first token is given back; a client that disconnects mid-body
    is counted as its own doing (499), not as a server error."""
    import dataclasses
    import socket

    state = server.app.state.server
    monkeypatch.setattr(state, "config", dataclasses.replace(state.config, body_timeout_s=0.5))
    url = urlparse(server.url)
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n{\"model\"").encode()
    internal, gone = server.errors(500), server.errors(499, "client_disconnected")
    with socket.create_connection((url.hostname, url.port), timeout=10) as stalled:
        stalled.sendall(head)
        start = time.monotonic()
        reply = read_response(stalled)
        assert reply.startswith("HTTP/1.1 408") and "not received within 0.5 s" in reply
        assert time.monotonic() - start < 5
    assert state.unstarted == 0
    with socket.create_connection((url.hostname, url.port), timeout=10) as abandoned:
        abandoned.sendall(head)
        time.sleep(0.1)
    deadline = time.monotonic() + 5
    while server.errors(499, "client_disconnected") == gone and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.errors(499, "client_disconnected") == gone + 1
    assert server.errors(500) == internal and state.unstarted == 0
    assert httpx.post(f"{server.url}{CHAT}", json=_body()).status_code == 200


def test_rendering_never_blocks_the_event_loop(server: Server, monkeypatch) -> None:
    """A request whose rendering takes long (a large prompt) leaves /health and other clients
    answering meanwhile: rendering runs on the worker pool."""
    real = app_module.chat_prompt

    def slow(renderer, body):
        time.sleep(2.0)
        return real(renderer, body)

    monkeypatch.setattr(app_module, "chat_prompt", slow)
    slow_request = threading.Thread(
        target=lambda: httpx.post(f"{server.url}{CHAT}", json=_body(), timeout=30))
    slow_request.start()
    time.sleep(0.3)  # the slow request is rendering now
    start = time.monotonic()
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert time.monotonic() - start < 1.0
    slow_request.join()


def test_refused_requests_leave_nothing_in_the_renderer_memo(server: Server) -> None:
    memo = server.app.state.server.renderer.memo
    before = (len(memo), memo.bytes)
    for i in range(20):  # distinct 50 KB messages, each too long for its max_tokens
        body = _body(messages=[{"role": "user", "content": f"{i} " + "lorem ipsum " * 4000}],
                     max_tokens=10**6)
        response = httpx.post(f"{server.url}{CHAT}", json=body)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
    assert (len(memo), memo.bytes) == before
    httpx.post(f"{server.url}{CHAT}", json=_body(messages=_messages(31))).raise_for_status()
    assert len(memo) > before[0]  # an accepted request's rendering is kept


def test_too_many_waiting_requests_get_429(model_dir) -> None:
    """With one running place and no waiting ones, a request beyond them is refused with 429
    and Retry-After while the first waits (its engine thread is held), then served."""
    cfg = config(max_waiting=0, engine=EngineConfig(mode="live", slots=2048, max_running=1))
    with running(model_dir, cfg) as server:
        gate = threading.Event()
        held = server.engine.run_in_engine_thread(lambda _: gate.wait(30))
        first: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: first.append(
            httpx.post(f"{server.url}{CHAT}", json=_body(), timeout=30)))
        waiter.start()
        deadline = time.monotonic() + 10
        while server.app.state.server.unstarted == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        refused = httpx.post(f"{server.url}{CHAT}", json=_body())
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        gate.set()
        held.result(10)
        waiter.join(30)
        assert first[0].status_code == 200
        httpx.post(f"{server.url}{CHAT}", json=_body()).raise_for_status()
        server.check()


# -- every error is JSON, counted, on a connection that stays usable -------------------------


BAD_BODIES = [
    # (raw body, path, needle in the message, param, code)
    (_body(messages=[{"role": "assistant", "content": "x", "tool_calls": "oops"}]), CHAT,
     "messages.0.tool_calls", "messages", "invalid_type"),
    (_body(messages=[{"role": "assistant", "content": "x", "tool_calls": [1, 2]}]), CHAT,
     "messages.0.tool_calls.0", "messages", "invalid_type"),
    ({"model": "tiny", "prompt": [2**70]}, "/v1/completions", "prompt.0", "prompt",
     "invalid_value"),
    ({"model": "tiny", "prompt": [[2**70]]}, "/v1/completions", "prompt.0.0", "prompt",
     "invalid_value"),
    ("[" * 50_000, CHAT, "nested too deeply", None, "invalid_json"),
    (_body(seed=2**64), CHAT, "(seed)", "seed", "invalid_value"),
    (_body(max_tokens="8"), CHAT, "(max_tokens)", "max_tokens", "invalid_type"),
    (_body(max_tokens=True), CHAT, "(max_tokens)", "max_tokens", "invalid_type"),
    (_body(temperature="0.5"), CHAT, "(temperature)", "temperature", "invalid_type"),
    ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
     CHAT, "NaN is not valid JSON", None, "invalid_json"),
    ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
     CHAT, "Infinity is not valid JSON", None, "invalid_json"),
    ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}',
     CHAT, "finite number (temperature)", "temperature", "invalid_value"),
    (_body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), CHAT,
     "'image_url' part (messages.0.content.1)", "messages", "invalid_value"),
    ('{"model": "tiny", "messages": [{"role": "user", "content": "lone \\ud800 half"}]}', CHAT,
     "lone UTF-16 surrogate is not valid Unicode (messages.0.content)", "messages",
     "invalid_value"),
    ('{"model": "tiny", "prompt": "lone \\udc00 half"}', "/v1/completions",
     "lone UTF-16 surrogate", "prompt", "invalid_value"),
    (_body(tools=[{"type": "function", "function": {"description": "no name"}}]), CHAT,
     "tools.0.function.name", "tools", "missing_required_parameter"),
    # A tool result must say which call it answers (OpenAI refuses it without): the id is what
    # pairs results with parallel calls.
    (_body(messages=[{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42"}]), CHAT,
     "'messages.2.tool_call_id' is a required property", "messages",
     "missing_required_parameter"),
    (_body(messages=[{"role": "user", "content": "hi"},
                     {"role": "tool", "content": "42", "tool_call_id": None}]), CHAT,
     "'messages.1.tool_call_id' is a required property", "messages",
     "missing_required_parameter"),
    # A tool named "" is no name (OpenAI refuses it): a tool_choice naming it would read as
    # "required", a call of any tool.
    (_body(tools=[{"type": "function", "function": {"name": "", "parameters": {}}}],
           tool_choice={"type": "function", "function": {"name": ""}}), CHAT,
     "tools.0.function.name", "tools", "invalid_value"),
]


@pytest.mark.parametrize("raw, path, needle, param, code", BAD_BODIES)
def test_bad_input_is_a_json_400_on_a_live_connection(server: Server, raw, path: str,
                                                       needle: str, param, code: str) -> None:
    payload = raw.encode() if isinstance(raw, str) else json.dumps(raw).encode()
    errors = server.errors(400, code)
    connection = Connection(server)
    try:
        status, body = connection.post(path, payload)
        assert status == 400, body
        error = body["error"]
        assert needle in error["message"] and error["param"] == param and error["code"] == code
        assert error["type"] == "invalid_request_error"
        status, body = connection.post(CHAT, json.dumps(_body()).encode())  # same connection
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    finally:
        connection.close()
    assert server.errors(400, code) == errors + 1


def test_an_unexpected_failure_is_a_json_500(server: Server, monkeypatch) -> None:
    def broken(renderer, body):
        raise RuntimeError("a bug in rendering")

    monkeypatch.setattr(app_module, "chat_prompt", broken)
    errors = server.errors(500, "internal_error")
    connection = Connection(server)
    try:
        status, body = connection.post(CHAT, json.dumps(_body()).encode())
        assert status == 500 and "a bug in rendering" in body["error"]["message"]
        assert body["error"]["type"] == "server_error"
        monkeypatch.undo()
        status, body = connection.post(CHAT, json.dumps(_body()).encode())
        assert status == 200
    finally:
        connection.close()
    assert server.errors(500, "internal_error") == errors + 1


def test_a_seed_out_of_range_is_not_a_context_length_error(server: Server) -> None:
    """The repro: seed 2**64 came back as context_length_exceeded on 'messages'."""
    response = httpx.post(f"{server.url}{CHAT}", json=_body(seed=2**64,
                                                            cache_salt=uuid.uuid4().hex))
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "seed"
    assert error["code"] != "context_length_exceeded"


def test_an_index_poll_since_a_version_of_thousands_of_digits_gets_the_whole_index(
        server: Server) -> None:
    """The repro: ``since`` of 5,000 digits passed the digits check, and int() refuses a
    string of more than 4,300 (Python's limit): a plain-text 500 and a traceback in the log.
    It names no version the server holds, so the answer is the whole index, as for any such
    version."""
    internal = server.errors(500)
    base = httpx.get(f"{server.url}/irminsul/index").json()
    response = httpx.get(f"{server.url}/irminsul/index",
                         params={"generation": base["generation"], "since": "9" * 5000})
    assert response.status_code == 200, response.text
    digest = response.json()
    assert digest["generation"] == base["generation"] and digest["full"] is True
    assert server.errors(500) == internal
