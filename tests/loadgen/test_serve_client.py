"""bench serve's client on a scripted SSE stream and a scripted clock: TTFT, TPOT and end-to-end
latency by their definitions, usage read, and failures recorded instead of raised."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx

from irminsul.loadgen.client import CallRecord, send_call
from irminsul.loadgen.sessions import Call
from irminsul.traffic.logs import Request

CALL = Call(session=1, index=2, request=Request("s", 5, [{"role": "user", "content": "hi"}],
                                                None, "test:1"),
            max_tokens=3, logged_reply=True)
USAGE = {"prompt_tokens": 100, "completion_tokens": 3, "total_tokens": 103,
         "prompt_tokens_details": {"cached_tokens": 60},
         "irminsul": {"prefix_cached_tokens": 20, "pic_cached_tokens": 40}}


def chunk(content: str | None = None, finish: str | None = None, role: bool = False) -> dict:
    delta = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    return {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode()
                    for e in events)


def clock(*times: float) -> Callable[[], float]:
    ticks = iter(times)
    return lambda: next(ticks)


def replay(body: bytes, status: int, ticks: Callable[[], float]) -> tuple[CallRecord, dict]:
    seen: dict = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        return httpx.Response(status, content=body,
                              headers={"content-type": "text/event-stream"})

    async def go() -> CallRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_call(client, "http://test", "m", CALL, origin=-0.5,
                                   cache_salt="salt", clock=ticks)

    return asyncio.run(go()), seen


def test_times_by_their_definitions() -> None:
    # sent at 0; the role chunk (empty content) at 1 is no token; text at 3 and 4; the chunk
    # with finish_reason (the last token, an end-of-turn that adds no text) at 6; usage at 7;
    # the stream ends at 8
    body = sse(chunk("", role=True), chunk("He"), chunk("llo"), chunk(None, "stop"),
               {"choices": [], "usage": USAGE}, "[DONE]")
    record, sent = replay(body, 200, clock(0, 1, 3, 4, 6, 7, 8))
    assert record.error is None
    assert (record.sent_s, record.ttft_ms, record.e2e_ms) == (0.5, 3000, 8000)
    assert record.tpot_ms == (6 - 3) / (3 - 1) * 1000
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (100, 3, 60)
    assert (record.prefix_cached_tokens, record.pic_cached_tokens) == (20, 40)
    assert record.finish_reason == "stop"
    assert (record.session, record.session_index, record.call_index, record.log_call) == (
        "s", 1, 2, 5)
    assert sent == {"model": "m", "messages": CALL.request.messages, "max_tokens": 3,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                    "cache_salt": "salt"}


def test_a_reply_that_stopped_at_once_has_its_first_token_at_the_finish() -> None:
    body = sse(chunk("", role=True), chunk(None, "stop"),
               {"choices": [], "usage": USAGE | {"completion_tokens": 1}}, "[DONE]")
    record, _ = replay(body, 200, clock(0, 1, 2, 3, 4))
    assert (record.ttft_ms, record.tpot_ms, record.e2e_ms) == (2000, None, 4000)


def test_failures_are_recorded() -> None:
    record, _ = replay(b'{"error": {"message": "bad"}}', 400, clock(0, 1))
    assert record.error.startswith("HTTP 400") and record.ttft_ms is None
    body = sse(chunk("a"), {"error": {"message": "engine failed"}}, "[DONE]")
    record, _ = replay(body, 200, clock(0, 1, 2, 3))
    assert record.error == "error event: engine failed"
    record, _ = replay(sse(chunk("a"), chunk(None, "stop"), "[DONE]"), 200, clock(0, 1, 2, 3))
    assert "no usage" in record.error


def test_a_reply_that_opens_with_a_tool_call_has_its_first_token_at_the_call() -> None:
    call = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {
        "tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                        "function": {"name": "search", "arguments": ""}}]},
        "finish_reason": None}]}
    body = sse(chunk("", role=True), call, chunk(None, "tool_calls"),
               {"choices": [], "usage": USAGE}, "[DONE]")
    record, _ = replay(body, 200, clock(0, 1, 2, 5, 6, 7))
    assert (record.ttft_ms, record.e2e_ms, record.finish_reason) == (2000, 7000, "tool_calls")


def test_a_reply_with_no_visible_token_has_no_tpot() -> None:
    """Four tokens generated, none of them text (special tokens the detokenizer drops): the
    first token's time was never seen, so there is no TPOT; (finish - finish) / 3 = 0 ms would
    be an invented figure that pulls the TPOT percentiles down."""
    body = sse(chunk("", role=True), chunk(None, "length"),
               {"choices": [], "usage": USAGE | {"completion_tokens": 4}}, "[DONE]")
    record, _ = replay(body, 200, clock(0, 1, 2, 3, 4))
    assert record.error is None
    assert (record.ttft_ms, record.tpot_ms, record.e2e_ms) == (2000, None, 4000)


def test_a_reply_without_a_finish_chunk_has_no_tpot() -> None:
    """A server that never sends finish_reason leaves the last token's time unknown: no TPOT
    rather than (first - first) / 2 = 0 ms."""
    body = sse(chunk("", role=True), chunk("He"), chunk("llo"),
               {"choices": [], "usage": USAGE}, "[DONE]")
    record, _ = replay(body, 200, clock(0, 1, 2, 3, 4, 5))
    assert record.error is None
    assert (record.ttft_ms, record.tpot_ms, record.e2e_ms) == (2000, None, 5000)


def test_a_reply_the_engine_aborted_is_a_failure() -> None:
    """vLLM (and SGLang) end a request their engine aborted or failed as if it completed: a
    finish chunk with finish_reason "abort" (or "error"), usage, [DONE] (vllm-project/vllm
    #57082). That is no reply of max_tokens: a failed call, not a fast success."""
    for reason in ("abort", "error"):
        body = sse(chunk("", role=True), chunk("He"), chunk(None, reason),
                   {"choices": [], "usage": USAGE | {"completion_tokens": 1}}, "[DONE]")
        record, _ = replay(body, 200, clock(0, 1, 2, 3, 4, 5))
        assert record.error == f"finish_reason: {reason}", reason
        assert record.finish_reason == reason
