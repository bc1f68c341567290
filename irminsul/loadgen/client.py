"""One chat call over HTTP, streamed, timed as it arrives.

The body is the logged request (messages, tools) with ``max_tokens`` the reply's length,
temperature 0, ``stream`` and ``stream_options.include_usage``; it is encoded before the clock
starts. Times, from the moment the request is handed to the connection:

    TTFT   until the first chunk with non-empty content or a tool call (a reply with neither,
           one that stopped at once, until the chunk that carries ``finish_reason``)
    E2E    until the stream ends ([DONE])
    TPOT   (last token - first token) / (completion tokens - 1), the last token's time being
           that of the chunk that carries ``finish_reason`` (sent as soon as the last token is
           out, also when that token adds no text, as an end-of-turn token does); none for a
           reply of one token, one with no content or tool call, or one without that chunk

Prompt and completion tokens and where the prompt came from are the server's ``usage``:
``prompt_tokens_details.cached_tokens`` and Irminsul's ``usage.irminsul`` split of it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import httpx

from .sessions import Call

# Finish reasons of a request the server's engine aborted or failed, which vLLM and SGLang
# end like a reply (finish chunk, usage, [DONE]) instead of with an error event.
FAILED_FINISH = frozenset({"abort", "error"})


@dataclass
class CallRecord:
    """What one call took and got; times in ms from its own send, ``sent_s`` from the run's
    start. Figures a failed call never reached stay None."""

    session: str
    session_index: int
    call_index: int
    log_call: int  # the log's "call" field
    max_tokens: int
    logged_reply: bool
    sent_s: float = 0.0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    prefix_cached_tokens: int | None = None  # usage.irminsul; None from other servers
    pic_cached_tokens: int | None = None
    derived_prefix_cached_tokens: int | None = None  # radix rows derived from reuse (not exact)
    finish_reason: str | None = None
    error: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


def request_body(call: Call, model: str, cache_salt: str | None = None) -> bytes:
    """The JSON body of a call's streamed, greedy chat completion."""
    body: dict = {"model": model, "messages": call.request.messages,
                  "max_tokens": call.max_tokens, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if call.request.tools:
        body["tools"] = call.request.tools
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return json.dumps(body, ensure_ascii=False).encode("utf-8")


async def send_call(client: httpx.AsyncClient, url: str, model: str, call: Call, *,
                    origin: float, cache_salt: str | None = None,
                    clock: Callable[[], float] = time.perf_counter) -> CallRecord:
    """Stream one call to ``url``/v1/chat/completions; ``origin`` is the run's start on
    ``clock`` (seconds). A failure (HTTP status, error event, broken stream, a finish_reason
    of FAILED_FINISH) is recorded in ``error``, never raised."""
    record = CallRecord(call.request.session, call.session, call.index, call.request.call,
                        call.max_tokens, call.logged_reply)
    content = request_body(call, model, cache_salt)
    first = last = None
    usage: dict | None = None
    sent = clock()
    record.sent_s = sent - origin
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", content=content,
                                 headers={"Content-Type": "application/json"}) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {response.status_code}: {text[:300]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                now = clock()
                if "error" in event:
                    error = event["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    record.error = f"error event: {message}"
                    return record
                for choice in event.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if first is None and (delta.get("content") or delta.get("tool_calls")):
                        first = now
                    if choice.get("finish_reason") is not None:
                        record.finish_reason, last = choice["finish_reason"], now
                usage = event.get("usage") or usage
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        record.error = f"{type(err).__name__}: {err}"
        return record
    done = clock()
    record.e2e_ms = 1e3 * (done - sent)
    if record.finish_reason in FAILED_FINISH:
        record.error = f"finish_reason: {record.finish_reason}"
        if usage is not None:
            _read_usage(record, usage)
        return record
    if usage is None:
        record.error = "no usage in the stream (the server ignored stream_options.include_usage)"
        return record
    _read_usage(record, usage)
    n = record.completion_tokens or 0
    if first is not None and last is not None and n > 1:
        # Both ends seen: without a visible token the first one's time is unknown, without a
        # finish chunk the last one's; either way 0 ms would be an invented TPOT.
        record.tpot_ms = 1e3 * (last - first) / (n - 1)
    if first is None:
        first = last
    if first is not None:
        record.ttft_ms = 1e3 * (first - sent)
    return record


def _read_usage(record: CallRecord, usage: dict) -> None:
    record.prompt_tokens = usage.get("prompt_tokens")
    record.completion_tokens = usage.get("completion_tokens")
    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    split = usage.get("irminsul")
    if isinstance(split, dict):
        record.prefix_cached_tokens = split.get("prefix_cached_tokens")
        record.pic_cached_tokens = split.get("pic_cached_tokens")
        record.derived_prefix_cached_tokens = split.get("derived_prefix_cached_tokens", 0)
