"""The router in front of three real engines on loopback: content goes where it is held,
streams and errors pass through, a dead backend is skipped and taken back."""

from __future__ import annotations

import json
import secrets

import httpx
import numpy as np
from fixtures.raw_http import read_response
from router_servers import MODEL, backend, router

from irminsul.loadgen.server import free_port

WORDS = ("the river keeps a ledger of every stone it moved north of the old mill where "
         "lanterns hang over a quiet market selling salt copper wool and maps").split()


def _document(seed: int, words: int = 400) -> str:
    return " ".join(np.random.default_rng(seed).choice(WORDS, words))


def _ask(system: str, document: str, question: str, salt: str) -> dict:
    return {"model": MODEL, "max_tokens": 2, "temperature": 0, "cache_salt": salt,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": document},
                         {"role": "user", "content": question}]}


def _post(url: str, body: dict, **kw: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60, **kw)


def test_a_moved_documents_follow_up_goes_to_the_replica_that_holds_it(replicas) -> None:
    salt = secrets.token_hex(4)
    documents = [_document(seed) for seed in range(3)]
    # Each replica is sent one document directly: the router learns where each is only from
    # the replicas' published indexes.
    for url, document in zip(replicas, documents):
        answer = _post(url, _ask("You are agent A.", document, "What is sold?", salt))
        assert answer.status_code == 200
    with router(replicas) as r:
        r.wait(lambda states: all(s["index"]["chunks"] > 0 for s in states))
        for url, document in zip(replicas, documents):
            # Another agent's header moves the document: no exact prefix reaches it.
            body = _ask("You are agent B, who answers briefly and only from the document.",
                        document, "Where is the mill?", salt)
            answer = _post(r.url, body)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-irminsul-backend"] == url
            usage = answer.json()["usage"]
            assert usage["irminsul"]["pic_cached_tokens"] > 300
            assert usage["irminsul"]["prefix_cached_tokens"] < 64
    # The control: by exact prefix alone the three replicas are alike (none holds any of the
    # new headers, one per follow-up), so the router expects next to nothing from cache for
    # them, whatever replica holds each document: it routes by a tie-break or by load, not by
    # content. (Where they land depends on the replicas' random ports and load: asserting the
    # landing places differ from the documents' failed by chance about 1 run in 27.)
    with router(replicas, policy="prefix") as r:
        r.wait(lambda states: all(s["index"]["chunks"] > 0 for s in states))
        for i, document in enumerate(documents):
            answer = _post(r.url, _ask(f"You are agent J{i}, brief.", document,
                                       "Where is the mill?", salt))
            assert answer.status_code == 200, answer.text
        assert _counter(r.url, "irminsul:router_expected_cached_tokens_total") < 3 * 64


def _counter(url: str, name: str) -> float:
    """A counter of the router's /metrics, summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == name)


def test_a_sessions_next_call_follows_it_before_any_poll_shows_it(replicas) -> None:
    salt = secrets.token_hex(4)
    # Polled once at start only: what follows is known from what the router sent.
    with router(replicas, poll_interval_s=600) as r:
        for seed in range(3, 6):
            first = _ask("You are agent C.", _document(seed), "What is sold?", salt)
            answer = _post(r.url, first)
            assert answer.status_code == 200
            reply = answer.json()["choices"][0]["message"]["content"]
            follow = {**first, "messages": [*first["messages"],
                                            {"role": "assistant", "content": reply},
                                            {"role": "user", "content": "And the maps?"}]}
            again = _post(r.url, follow)
            assert again.headers["x-irminsul-backend"] == answer.headers["x-irminsul-backend"]
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 400


def _events(response: httpx.Response) -> list[str]:
    return [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]


def test_a_stream_passes_through_as_the_backend_sends_it(replicas) -> None:
    body = {**_ask("You are agent D.", _document(7, 60), "Say something.", ""), "stream": True,
            "max_tokens": 12, "stream_options": {"include_usage": True}}
    replies = []
    with router(replicas) as r:
        for url in (r.url, replicas[0]):
            # Salts of their own: both computed from scratch, so greedy outputs are equal.
            sent = {**body, "cache_salt": secrets.token_hex(4)}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=sent,
                              timeout=60) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                replies.append((response.headers.get("x-irminsul-backend"),
                                _events(response)))
    (via, routed), (_, direct) = replies
    assert via in replicas
    assert routed[-1] == direct[-1] == "[DONE]"

    def content(events: list[str]) -> tuple[list[str], str | None, dict]:
        parsed = [json.loads(e) for e in events[:-1]]
        deltas = [c["choices"][0]["delta"].get("content") or "" for c in parsed if c["choices"]]
        finish = [c["choices"][0]["finish_reason"] for c in parsed if c["choices"]][-1]
        return deltas, finish, parsed[-1]["usage"]

    deltas, finish, usage = content(routed)
    assert len([d for d in deltas if d]) > 1  # streamed piece by piece, not one lump
    assert (deltas, finish) == content(direct)[:2]
    assert usage["completion_tokens"] == content(direct)[2]["completion_tokens"]


def test_errors_pass_through_with_their_status_and_body(replicas) -> None:
    good = _ask("You are agent E.", "hello", "hi", "e")
    bad_bodies = [{**good, "temperature": 5}, {**good, "model": "nope"},
                  {**good, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}]
    with router(replicas, max_request_bytes=4096) as r:
        for bad in bad_bodies:
            routed, direct = _post(r.url, bad), _post(replicas[1], bad)
            assert routed.status_code == direct.status_code == 400
            assert routed.json() == direct.json()
        broken = httpx.post(f"{r.url}/v1/completions", content=b"{not json", timeout=60)
        assert broken.status_code == 400
        assert broken.json()["error"]["code"] == "invalid_json"
        # The router's own limit: 413 in OpenAI's shape, before the body is read whole.
        huge = _post(r.url, {**good, "messages": [{"role": "user", "content": "x" * 8000}]})
        assert huge.status_code == 413
        assert huge.json()["error"]["code"] == "request_too_large"
        assert _post(r.url, good).status_code == 200  # and the next request is served


def test_a_dead_backend_is_skipped_and_taken_back_when_it_returns(replicas) -> None:
    port = free_port()
    dead = f"http://127.0.0.1:{port}"
    with router([dead, replicas[2]], backoff_s=0.2, backoff_max_s=0.4) as r:
        r.wait(lambda states: not states[0]["up"])
        for i in range(3):
            answer = _post(r.url, _ask("You are agent F.", f"note {i}", "ok?", "f"))
            assert answer.status_code == 200
            assert answer.headers["x-irminsul-backend"] == replicas[2]
        metrics = httpx.get(f"{r.url}/metrics").text
        assert f'irminsul:router_backend_up{{backend="{dead}"}} 0.0' in metrics
        with backend(port):
            r.wait(lambda states: states[0]["up"], timeout=20)
            served = {_post(r.url, _ask("You are agent G.", f"note {i}", "ok?",
                                        secrets.token_hex(4))).headers["x-irminsul-backend"]
                      for i in range(8)}
            assert dead in served  # taken back: ties between the idle two spread over both
        # Gone again, mid-use: a refused connection sends the request to the other one.
        for i in range(3):
            answer = _post(r.url, _ask("You are agent H.", f"note {i}", "ok?", "h"))
            assert answer.status_code == 200
            assert answer.headers["x-irminsul-backend"] == replicas[2]


def test_with_no_backend_up_the_router_says_so() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with router([dead]) as r:
        r.wait(lambda states: not states[0]["up"])
        assert httpx.get(f"{r.url}/health").status_code == 503
        answer = _post(r.url, _ask("You are agent I.", "hello", "hi", "i"))
        assert answer.status_code == 503
        error = answer.json()["error"]
        assert error["code"] == "no_backend" and dead in error["message"]


def test_a_client_gone_before_its_answer_stops_the_backend_too(tmp_path) -> None:
    """A non-streaming request whose client leaves while the backend generates: the router
    stops forwarding it, closing the backend's connection, and the backend aborts it (as it
    does for a client of its own) instead of generating to max_tokens for nobody; the router's
    count of requests in flight there goes back to 0. (The tiny random model: it never picks
    an end token greedily, so only an abort ends the request early.)"""
    import socket
    import time

    from fixtures.openai_server import config, running
    from fixtures.served_app import served
    from fixtures.tiny_server_model import build

    from irminsul.config import RouterConfig
    from irminsul.router.app import build_router

    model_dir = build(tmp_path)
    with running(model_dir, config()) as server:
        routed = build_router(RouterConfig(backends=(server.url,), poll_interval_s=0.05),
                              model_dir)
        with served(routed) as url:
            body = json.dumps({"model": server.model, "prompt": "hello", "max_tokens": 2000,
                               "temperature": 0}).encode()
            before = server.metric('irminsul:requests_finished_total{reason="abort"}')
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as client:
                client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                               b"Content-Type: application/json\r\n"
                               + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                time.sleep(0.5)  # the backend is generating
            deadline = time.monotonic() + 10
            while (server.metric('irminsul:requests_finished_total{reason="abort"}') == before
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            assert server.metric('irminsul:requests_finished_total{reason="abort"}') == before + 1
            assert server.metric("irminsul:generation_tokens_total") < 2000
            states = httpx.get(f"{url}/irminsul/backends").json()["backends"]
            assert states[0]["in_flight"] == 0


def test_a_stalled_or_oversized_body_is_refused_before_any_backend() -> None:
    """A body not all sent within --body-timeout gets 408, one over --max-request-bytes 413,
    from the router itself (its backend is down: neither reaches one)."""
    import socket
    import time

    dead = f"http://127.0.0.1:{free_port()}"
    with router([dead], body_timeout_s=0.5, max_request_bytes=1000) as r:
        host, port = r.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mo")
            start = time.monotonic()
            reply = read_response(conn)
            waited = time.monotonic() - start
        assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply
        assert 0.4 < waited < 5
        big = _post(r.url, _ask("You are agent I.", "x" * 2000, "hi", "i"))
        assert big.status_code == 413 and "--max-request-bytes" in big.json()["error"]["message"]


def test_the_data_parallel_front_router_keeps_the_servers_limits() -> None:
    """Under --data-parallel the router reads each body before a rank does: it holds it to
    the server's --max-request-bytes and --body-timeout, not to its own defaults."""
    from irminsul.config import RouterConfig, ServerConfig
    from irminsul.parallel.data_serving import front_router

    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    front = front_router(ServerConfig(port=7000, max_request_bytes=4096, body_timeout_s=3.0),
                         urls)
    assert front.backends == tuple(urls) and front.port == 7000
    assert (front.max_request_bytes, front.body_timeout_s) == (4096, 3.0)
    unset = front_router(ServerConfig(), urls)
    assert unset.max_request_bytes == RouterConfig().max_request_bytes


def test_a_stream_that_reports_an_engine_error_counts_as_failed() -> None:
    """A backend's 200 stream that ends in the server's error event (the engine failed the
    request mid-way) is relayed as it is, and the router counts it as failed, so the prompt is
    not taken as cached there; the event's first bytes split over two chunks are found too. A
    stream without one is not failed."""
    import asyncio

    from irminsul.router.app import _relay

    class Upstream:
        def __init__(self, chunks: list[bytes]) -> None:
            self.chunks = chunks

        async def aiter_raw(self):  # noqa: ANN202
            for chunk in self.chunks:
                yield chunk

        async def aclose(self) -> None:
            pass

    def relayed(chunks: list[bytes]) -> tuple[bytes, bool]:
        outcome = {}

        async def run() -> bytes:
            out = [c async for c in _relay(None, None, Upstream(chunks),
                                           lambda *, failed: outcome.update(failed=failed),
                                           False)]
            return b"".join(out)

        return asyncio.run(run()), outcome["failed"]

    ok = [b'data: {"choices": []}\n\n', b"data: [DONE]\n\n"]
    assert relayed(ok) == (b"".join(ok), False)
    error = [b'data: {"choices": []}\n\ndata: {"err', b'or": {"message": "engine step failed"}}'
             b"\n\n", b"data: [DONE]\n\n"]
    assert relayed(error) == (b"".join(error), True)
