"""The router against fake backends that misbehave at the HTTP level: a keep-alive connection
closed as a request arrives on it, a body cut short after its header, and an index poll
answered only after the router's timeout."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
from router_servers import MODEL, router

BODY = b'{"id": "x", "object": "text_completion", "choices": []}'


class FakeBackend:
    """A raw HTTP/1.1 server on loopback. ``/irminsul/index`` answers 404 (up, no index); a
    POST answers 200 with BODY, keeping the connection alive. ``drop_reused``: the first POST
    that arrives on a connection which already served a request is read and the connection
    closed without an answer (what uvicorn does when its keep-alive timeout fires as a request
    arrives). ``truncate``: POSTs get a 200 header announcing BODY's length and half of it.
    ``index_delay``: seconds an index poll waits for its answer (a server whose engine thread
    is busy with a long step: the poll is read between steps)."""

    def __init__(self, *, drop_reused: bool = False, truncate: bool = False,
                 index_delay: float = 0.0) -> None:
        self.drop_reused, self.truncate = drop_reused, truncate
        self.index_delay = index_delay
        self.polls = 0  # index polls received
        self.posts = 0  # POSTs answered
        self.heads: list[bytes] = []  # the head (request line and headers) of each POST read
        self.dropped = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer, served = b"", 0
        with conn:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                need = int(length.group(1)) if length else 0
                while len(buffer) < need:
                    buffer += conn.recv(65536)
                buffer = buffer[need:]
                method, path = head.split(b" ")[:2]
                if path.startswith(b"/irminsul/index"):
                    with self._lock:
                        self.polls += 1
                    time.sleep(self.index_delay)
                    try:  # the router may have given up on it meanwhile
                        conn.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    except OSError:
                        return
                elif method == b"POST":
                    with self._lock:
                        self.heads.append(head)
                        drop = self.drop_reused and served > 0 and not self.dropped
                        self.dropped += drop
                    if drop:
                        conn.shutdown(socket.SHUT_RDWR)
                        return
                    with self._lock:
                        self.posts += 1
                    header = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                              + f"content-length: {len(BODY)}\r\n\r\n".encode())
                    if self.truncate:
                        conn.sendall(header + BODY[:len(BODY) // 2])
                        conn.shutdown(socket.SHUT_RDWR)
                        return
                    conn.sendall(header + BODY)
                else:
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                served += 1


@contextlib.contextmanager
def fake(**kw: bool | float) -> Iterator[FakeBackend]:
    backend = FakeBackend(**kw)
    try:
        yield backend
    finally:
        backend.close()


def _complete(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "hello", "max_tokens": 2})


def _requests_metric(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {status: float(value) for status, value in re.findall(
        r'^irminsul:router_requests_total\{backend="[^"]*",status="(\d+)"\} (\S+)$', text,
        re.MULTILINE)}


def test_a_header_value_outside_ascii_is_forwarded_as_sent() -> None:
    """HTTP allows bytes 0x80-0xFF in a header value (obs-text; a client's UTF-8 name, say),
    and the server ignores headers it does not read. The repro: the router passed the values
    to httpx as text, which encodes them as ASCII, so such a request got a plain-text 500 and
    never reached a backend."""
    note = "Zoë’s agent".encode()  # UTF-8, two bytes of it above 0x7F
    with fake() as backend, router([backend.url]) as r:
        response = httpx.post(f"{r.url}/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": "hello", "max_tokens": 2},
                              headers={"x-note": note})
        assert response.status_code == 200, response.text
        assert response.content == BODY
        assert backend.posts == 1
        # The backend got the value byte for byte, not re-encoded.
        assert b"\r\nx-note: " + note + b"\r\n" in backend.heads[0] + b"\r\n"


def test_a_pooled_connection_closed_as_the_request_arrives_is_retried() -> None:
    """The router's first poll leaves a keep-alive connection in its pool; the backend closes
    it as the next request arrives on it, before any byte of an answer (the race between
    httpx's and uvicorn's keep-alive timeouts, both 5 s). The backend never processed that
    request, so the client must get the backend's answer, not a 502."""
    with fake(drop_reused=True) as backend, router([backend.url], poll_interval_s=3600) as r:
        r.wait(lambda states: states[0]["up"])
        answer = _complete(r.url)
        assert backend.dropped == 1  # the race happened
        assert answer.status_code == 200, answer.text
        assert answer.content == BODY
        assert backend.posts == 1
        assert r.backends()[0]["up"]  # a dropped idle connection is not a dead backend


def test_the_client_keep_alive_expiry_is_shorter_than_uvicorns() -> None:
    """An idle pooled connection must be given up by the router before uvicorn's keep-alive
    timeout (its default, 5 s, what irminsul serve runs with) closes it at the other end."""
    import uvicorn

    from irminsul.config import RouterConfig
    from irminsul.model.default import default_model_dir
    from irminsul.router.app import build_router

    app = build_router(RouterConfig(backends=("http://127.0.0.1:1",)), default_model_dir())
    client = app.state.router.client
    expiry = client._transport._pool._keepalive_expiry
    assert expiry is not None
    assert expiry < uvicorn.Config(app).timeout_keep_alive


def test_a_body_cut_short_is_counted_as_the_502_the_client_got() -> None:
    with fake(truncate=True) as backend, router([backend.url], poll_interval_s=3600) as r:
        r.wait(lambda states: states[0]["up"])
        answer = _complete(r.url)
        assert answer.status_code == 502
        assert answer.json()["error"]["code"] == "upstream_error"
        assert _requests_metric(r.url) == {"502": 1.0}


def test_a_backend_whose_index_goes_404_is_balanced_by_load_alone() -> None:
    """A backend that published an index (its content and a busy load) and then answers 404
    at /irminsul/index (restarted as a server without one) is, as documented, up with an
    empty index: neither the old process's content nor its last reported load may still
    count, since nothing vouches for them any more."""
    import asyncio

    import numpy as np

    from irminsul.config import RouterConfig
    from irminsul.router.backends import Backends
    from irminsul.router.digest import Chunking, Digest, Load
    from irminsul.router.keys import request_keys
    from irminsul.router.metrics import RouterMetrics

    chunking = Chunking(7, 32, 512, 32, True)
    tokens = np.random.default_rng(0).integers(100, 8000, 200).astype(np.int64)
    keys = request_keys(tokens, np.array([0]), 7, {chunking})
    # The old process held the request's 3 whole blocks (192 tokens) and ran 7 requests.
    published = Digest("g", 1, True, chunking, Load(5, 2, 0.5), set(keys.prefix), set(), set(),
                       set()).to_json()
    answers = [httpx.Response(200, json=published), httpx.Response(404)]

    async def polled() -> tuple[int, int, int, int]:
        transport = httpx.MockTransport(lambda _: answers.pop(0))
        async with httpx.AsyncClient(transport=transport) as client:
            backends = Backends(RouterConfig(backends=("http://a",)), client, RouterMetrics())
            (backend,) = backends.all
            await backends.poll(backend)
            before = (backend.view.cached_tokens(keys), backend.queue)
            await backends.poll(backend)
            assert backend.up
            return (*before, backend.view.cached_tokens(keys), backend.queue)

    assert asyncio.run(polled()) == (192, 7, 0, 0)


def test_an_empty_user_is_no_session_that_sessionless_requests_follow() -> None:
    """A body with ``"user": ""`` names no session (as an empty session header does not):
    after one, requests without a session still tie-break by rendezvous hashing of their
    prompt between idle backends with empty indexes, each going where the hash ranks it first
    (hashed here by the documented definition), not all to the backend the empty user got."""
    import numpy as np
    import xxhash

    from irminsul.cache.cdc import namespace_seed
    from irminsul.model.default import default_model_dir
    from irminsul.traffic.render import ChatRenderer

    renderer = ChatRenderer.from_dir(default_model_dir())
    with fake() as a, fake() as b, router([a.url, b.url], poll_interval_s=3600) as r:
        r.wait(lambda states: all(s["up"] for s in states))
        first = httpx.post(f"{r.url}/v1/completions", timeout=30,
                           json={"model": MODEL, "prompt": "hello", "user": ""})
        assert first.status_code == 200
        for i in range(16):
            prompt = f"question number {i}"
            answer = httpx.post(f"{r.url}/v1/completions", timeout=30,
                                json={"model": MODEL, "prompt": prompt})
            tokens = np.asarray(renderer.encode(prompt), dtype="<u4").tobytes()
            key = xxhash.xxh64_intdigest(tokens, namespace_seed(MODEL))
            expected = max((a.url, b.url), key=lambda u: xxhash.xxh64_intdigest(u.encode(), key))
            assert answer.headers["x-irminsul-backend"] == expected, i


def test_a_backend_slow_to_answer_its_index_poll_still_serves() -> None:
    """A backend that takes the index poll's connection but answers after the router's
    timeout (a server's poll waits for its engine thread's step: a long prefill) and serves
    requests is busy, not dead: it stays up, its timed-out polls counted, and requests reach
    it. Its only poller's two polls (the start's and the poll loop's first) both time out."""
    with fake(index_delay=1.0) as backend, \
            router([backend.url], timeout_s=0.2, poll_interval_s=3600) as r:
        deadline = time.monotonic() + 10
        while backend.polls < 2:
            assert time.monotonic() < deadline, f"polled {backend.polls} times"
            time.sleep(0.02)
        time.sleep(0.5)  # past the second poll's timeout
        (state,) = r.backends()
        assert state["up"], state
        assert state["stale_polls"] == 2, state
        answer = _complete(r.url)
        assert answer.status_code == 200, answer.text
        assert answer.content == BODY and backend.posts == 1
        text = httpx.get(f"{r.url}/metrics").text
        assert re.search(r'router_index_polls_total\{backend="[^"]*",outcome="timeout"\} 2\.0',
                         text), text


def test_index_polls_that_time_out_keep_the_last_index_until_the_limit() -> None:
    """A poll that times out after connecting leaves the backend up with its last index and
    load; ``poll_timeouts`` (3) in a row mark it down; the next poll answered brings it back
    with the count cleared; a refused connection marks it down at once."""
    import asyncio

    import numpy as np

    from irminsul.config import RouterConfig
    from irminsul.router.backends import Backends
    from irminsul.router.digest import Chunking, Digest, Load
    from irminsul.router.keys import request_keys
    from irminsul.router.metrics import RouterMetrics

    chunking = Chunking(7, 32, 512, 32, True)
    tokens = np.random.default_rng(0).integers(100, 8000, 200).astype(np.int64)
    keys = request_keys(tokens, np.array([0]), 7, {chunking})
    # The backend holds the request's 3 whole blocks (192 tokens) and runs 7 requests.
    published = Digest("g", 1, True, chunking, Load(5, 2, 0.5), set(keys.prefix), set(), set(),
                       set()).to_json()
    answers: list = [httpx.Response(200, json=published), httpx.ReadTimeout,
                     httpx.ReadTimeout, httpx.ReadTimeout, httpx.ReadTimeout,
                     httpx.Response(200, json=published), httpx.ReadTimeout, httpx.ConnectError]

    def answer(request: httpx.Request) -> httpx.Response:
        a = answers.pop(0)
        if isinstance(a, httpx.Response):
            return a
        raise a("scripted", request=request)

    async def polled() -> list[tuple[bool, int, int, int]]:
        seen = []
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            config = RouterConfig(backends=("http://a",))
            backends = Backends(config, client, RouterMetrics())
            (backend,) = backends.all
            while answers:
                await backends.poll(backend)
                seen.append((backend.up, backend.stale, backend.view.cached_tokens(keys),
                             backend.queue))
        return seen

    assert RouterConfig().poll_timeouts == 3
    assert asyncio.run(polled()) == [
        (True, 0, 192, 7),
        (True, 1, 192, 7), (True, 2, 192, 7),  # stale, still routed by what it last said
        (False, 3, 192, 7),  # the third in a row: down
        (False, 4, 192, 7),  # down stays down while its polls time out
        (True, 0, 192, 7),  # answered: back
        (True, 1, 192, 7),
        (False, 1, 192, 7),  # refused: down at once
    ]
