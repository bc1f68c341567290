"""The OpenAI-compatible server, end to end through the official ``openai`` client.

A tiny model directory is built offline (tests/tiny_server_model.py); the server runs in-process
(uvicorn in a thread) in live PIC mode, so the tests can reach its engine thread to verify slot
accounting with ``Engine.check``. One test starts ``irminsul serve`` as a subprocess.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from fixtures.openai_server import SLOTS, Server
from fixtures.tiny_server_model import END, EOS, sentences
from openai import OpenAI

from irminsul.cache.markers import MARKER_TEXT
from irminsul.config import EngineConfig
from irminsul.engine import Engine, SamplingParams, Scheduler
from irminsul.loadgen.server import free_port
from irminsul.model import load_model
from irminsul.server import AsyncEngine, EngineError
from irminsul.server.detokenizer import IncrementalDetokenizer, StopStrings
from irminsul.server.prompts import chat_prompt, stop_token_ids
from irminsul.server.protocol import ChatCompletionRequest
from irminsul.traffic.render import ChatRenderer


def _chat(server: Server, messages: list[dict], **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 16)
    return server.client.chat.completions.create(model=server.model, messages=messages, **kw)


def _messages(seed: int, question: str = "What leaves at noon?") -> list[dict]:
    return [{"role": "system", "content": " ".join(sentences(4, seed))},
            {"role": "user", "content": question}]


def _salt() -> dict:
    """A fresh cache namespace, so a test sees only its own cache entries."""
    return {"extra_body": {"cache_salt": uuid.uuid4().hex}}


# -- the API -----------------------------------------------------------------------------------


def test_models_and_health(server: Server) -> None:
    assert [m.id for m in server.client.models.list().data] == ["tiny"]
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_chat_streamed_equals_non_streamed(server: Server) -> None:
    messages = _messages(1)
    full = _chat(server, messages, max_tokens=24, **_salt())
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason == "length" and len(text) > 5
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    stream = _chat(server, messages, max_completion_tokens=24, stream=True,
                   stream_options={"include_usage": True}, **_salt())
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    server.check()


def test_completions(server: Server) -> None:
    prompt = "The flight from boston leaves at noon."
    by_text = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                               temperature=0, **_salt())
    assert by_text.object == "text_completion" and by_text.usage.completion_tokens == 12
    ids = ChatRenderer.from_dir(server.model_dir).encode(prompt).tolist()
    by_ids = server.client.completions.create(model="tiny", prompt=ids, max_tokens=12,
                                              temperature=0, **_salt())
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    streamed = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                                temperature=0, stream=True, **_salt())
    assert "".join(c.choices[0].text for c in streamed) == by_text.choices[0].text


def test_concurrent_requests_are_batched(server: Server) -> None:
    """Twelve clients at once, half of them streaming: all served, slot accounting exact."""

    async def main() -> list[int]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

        async def one(i: int) -> int:
            kw = dict(model="tiny", messages=_messages(20 + i % 3), max_tokens=10 + i,
                      temperature=0)
            if i % 2:
                reply = await client.chat.completions.create(**kw)
                return reply.usage.completion_tokens
            stream = await client.chat.completions.create(
                **kw, stream=True, stream_options={"include_usage": True})
            return [chunk async for chunk in stream][-1].usage.completion_tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(12)))
        finally:
            await client.close()

    assert asyncio.run(main()) == [10 + i for i in range(12)]
    server.check()


def test_shared_prefix_is_reported_cached(server: Server) -> None:
    salt = _salt()
    first = _chat(server, _messages(2), **salt)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    follow_up = _messages(2) + [{"role": "assistant", "content": "Noon."},
                                {"role": "user", "content": "And the evening one?"}]
    second = _chat(server, follow_up, **salt)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1  # the whole first prompt but its last token
    assert second.usage.irminsul == {"prefix_cached_tokens": cached, "pic_cached_tokens": 0,
                                     "derived_prefix_cached_tokens": 0}
    server.check()


def test_shifted_document_is_served_by_pic(server: Server) -> None:
    doc = " ".join(sentences(10, seed=3))  # ~500 tokens: several content-defined chunks
    salt = _salt()
    _chat(server, [{"role": "system", "content": " ".join(sentences(2, 4))},
                   {"role": "user", "content": doc},
                   {"role": "user", "content": "Summarise."}], **salt)
    # The same document after a longer system prompt and another message: shifted, not a prefix.
    messages = [{"role": "system", "content": " ".join(sentences(5, 5))},
                {"role": "user", "content": "Here is a file."},
                {"role": "user", "content": doc},
                {"role": "user", "content": "Which gate?"}]
    later = _chat(server, messages, **salt)
    pic = later.usage.irminsul["pic_cached_tokens"]
    assert pic > 100
    assert later.usage.prompt_tokens_details.cached_tokens == (
        pic + later.usage.irminsul["prefix_cached_tokens"])
    # Its next turn matches it in the radix tree; the rows from the reused document on are not
    # a full prefill's, and are not reported as an exact prefix.
    again = _chat(server, messages + [{"role": "user", "content": "And then?"}], **salt)
    split = again.usage.irminsul
    assert split["derived_prefix_cached_tokens"] >= pic
    assert split["prefix_cached_tokens"] < later.usage.prompt_tokens - pic
    assert again.usage.prompt_tokens_details.cached_tokens == sum(split.values())
    server.check()


def test_cache_salt_isolates_tenants(server: Server) -> None:
    messages = _messages(6)
    salt_a, salt_b = _salt(), _salt()
    _chat(server, messages, **salt_a)
    assert _chat(server, messages, **salt_a).usage.prompt_tokens_details.cached_tokens > 0
    other = _chat(server, messages, **salt_b)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.usage.irminsul == {"prefix_cached_tokens": 0, "pic_cached_tokens": 0,
                                    "derived_prefix_cached_tokens": 0}


def test_stop_string_truncates_and_frees(server: Server) -> None:
    messages = _messages(7)
    text = _chat(server, messages, max_tokens=40).choices[0].message.content
    stop = text[len(text) // 2: len(text) // 2 + 2]
    expected = text[:text.find(stop)]
    response = _chat(server, messages, max_tokens=40, stop=[stop, "never-seen"])
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens < 40  # aborted at the stop string, not at the limit
    streamed = _chat(server, messages, max_tokens=40, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected
    server.check()


def test_stop_token_ends_generation(server: Server) -> None:
    """The model's eos ids (generation_config.json) stop sampling: at OpenAI's highest
    temperature some seed soon draws one (the tiny model never picks them greedily)."""
    for seed in range(20):
        reply = _chat(server, _messages(14), max_tokens=300, temperature=2.0, seed=seed)
        if reply.choices[0].finish_reason == "stop":
            assert reply.usage.completion_tokens < 300
            break
    else:
        pytest.fail("no stop token drawn in 20 seeded requests")
    server.check()


@pytest.mark.parametrize("change, needle", [
    ({"model": "gpt-4o"}, "does not exist"),
    ({"temperature": -1}, "greater than or equal to 0 (temperature)"),
    ({"top_p": 0}, "greater than 0 (top_p)"),
    ({"max_tokens": 0}, "greater than or equal to 1 (max_tokens)"),
    ({"n": 2}, "only n=1"),
    ({"stop": [f"s{i}" for i in range(17)]}, "at most 16 stop strings"),
    ({"stop": "x" * 513}, "stop string of 513 characters"),
    ({"presence_penalty": 2.0}, "penalties are not supported (only 0) (presence_penalty)"),
    ({"frequency_penalty": -1}, "penalties are not supported (only 0) (frequency_penalty)"),
    ({"logit_bias": {"65": 10}}, "logit_bias is not supported"),
    ({"top_logprobs": 3}, "logprobs are not supported (top_logprobs)"),
    ({"stream_options": {"include_usage": True}}, "only allowed when stream is true"),
    ({"tool_choice": "required"}, "tool_choice 'required' needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "not among the tools"),
    ({"response_format": {"type": "json_object"}}, "only response_format"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
])
def test_bad_requests_answer_400(server: Server, change: dict, needle: str) -> None:
    errors = server.errors(400)
    body = {"model": "tiny", "messages": _messages(8), **change}
    with pytest.raises(openai.BadRequestError) as err:
        server.client.chat.completions.create(**body)
    assert err.value.status_code == 400 and needle in err.value.message
    assert server.errors(400) == errors + 1


def test_neutral_values_of_unsupported_fields_are_served(server: Server) -> None:
    """What the engine does not apply is accepted at its neutral value: the answer is the same."""
    reply = _chat(server, _messages(8), presence_penalty=0, frequency_penalty=0, logit_bias={},
                  tool_choice="auto", response_format={"type": "text"},
                  stop=[f"never{i}" for i in range(16)])
    assert reply.choices[0].finish_reason == "length"
    for change, needle in (({"best_of": 2}, "best_of=1"), ({"suffix": "end"}, "suffix")):
        with pytest.raises(openai.BadRequestError, match=needle):
            server.client.completions.create(model="tiny", prompt="hello", max_tokens=2,
                                             **change)
    assert server.client.completions.create(model="tiny", prompt="hello", max_tokens=2,
                                            best_of=1).choices[0].finish_reason == "length"
    server.check()


def test_overlong_prompts_answer_400(server: Server) -> None:
    for length, where in ((5000, "context of 4096"), (SLOTS, f"KV pool of {SLOTS}")):
        with pytest.raises(openai.BadRequestError, match=re.escape(where)):
            server.client.completions.create(model="tiny", prompt=[65] * length, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="exceeds"):
        _chat(server, [{"role": "user", "content": "word " * 1500}])
    server.check()


def test_malformed_and_incomplete_bodies_answer_400(server: Server) -> None:
    url = f"{server.url}/v1/chat/completions"
    for content, needle in ((b'{"model": "tiny", "messages": [', "malformed JSON"),
                            (b'["not", "an", "object"]', "JSON object"),
                            (b'{"model": "tiny"}', "'messages' is a required property")):
        response = httpx.post(url, content=content, headers={"Content-Type": "application/json"})
        assert response.status_code == 400
        error = response.json()["error"]
        assert needle in error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/v1/nowhere").json()["error"]["message"] == "Not Found"


def test_metrics_count_tokens_and_latency(server: Server) -> None:
    names = ("irminsul:prompt_tokens_total", "irminsul:prefix_cached_tokens_total",
             "irminsul:generation_tokens_total", "irminsul:time_to_first_token_seconds_count")
    before = {name: server.metric(name) for name in names}
    salt = _salt()
    _chat(server, _messages(9), **salt)
    second = _chat(server, _messages(9), **salt)
    after = {name: server.metric(name) for name in names}
    assert after["irminsul:prompt_tokens_total"] - before["irminsul:prompt_tokens_total"] == (
        2 * second.usage.prompt_tokens)
    assert after["irminsul:prefix_cached_tokens_total"] > before[
        "irminsul:prefix_cached_tokens_total"]
    assert after["irminsul:generation_tokens_total"] - before[
        "irminsul:generation_tokens_total"] == 32
    assert after["irminsul:time_to_first_token_seconds_count"] == before[
        "irminsul:time_to_first_token_seconds_count"] + 2
    text = httpx.get(f"{server.url}/metrics").text
    assert "irminsul:pic_cached_tokens_total" in text
    assert "irminsul:derived_prefix_cached_tokens_total" in text
    usage = server.metric("irminsul:kv_pool_usage_ratio")
    assert 0 < usage <= 1  # the indexes keep what was served
    assert server.metric("irminsul:kv_pool_capacity_slots") == SLOTS
    assert server.metric("irminsul:cuda_graph_replays") == 0  # exported; no graphs on a CPU


# -- clients that leave, engines that fail ----------------------------------------------------


def _aborted(server: Server) -> float:
    return server.metric('irminsul:requests_finished_total{reason="abort"}')


def test_client_disconnect_mid_stream_aborts(server: Server) -> None:
    aborted = _aborted(server)
    body = {"model": "tiny", "messages": _messages(10), "max_tokens": 1500, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        events = (line for line in response.iter_lines() if line)
        assert next(events).startswith("data: ")  # the role chunk
        assert '"content"' in next(events)  # generation is under way: now hang up
    server.check(timeout=5)  # idle long before 1500 tokens: the request was aborted
    assert _aborted(server) == aborted + 1
    assert _chat(server, _messages(10)).choices[0].finish_reason == "length"  # still serving
    server.check()


def test_client_disconnect_while_waiting_aborts(server: Server) -> None:
    aborted = _aborted(server)
    body = {"model": "tiny", "messages": _messages(11), "max_tokens": 1500, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=0.3)
    server.check(timeout=5)
    assert _aborted(server) == aborted + 1


def test_engine_error_fails_the_request_and_serving_goes_on(server: Server) -> None:
    engine = server.engine.scheduler.engine
    real = engine.run_batch
    calls = []

    def failing_once(work):
        if not calls:
            calls.append(1)
            raise RuntimeError("injected fault")
        return real(work)

    engine.run_batch = failing_once
    try:
        with pytest.raises(openai.InternalServerError, match="injected fault"):
            _chat(server, _messages(12))
    finally:
        del engine.run_batch
    server.check()
    assert _chat(server, _messages(12)).choices[0].finish_reason == "length"
    server.check()


# -- the pieces ---------------------------------------------------------------------------------


def test_async_engine_generate_abort_and_shutdown(model_dir: Path) -> None:
    """Directly, without HTTP: a request's outputs, an early exit that aborts, a prompt the pool
    can never hold, and shutdown failing what is in flight."""
    engine = AsyncEngine(Scheduler(Engine(load_model(model_dir), EngineConfig(slots=512))))
    engine.start()

    async def main() -> None:
        params = SamplingParams(max_tokens=8)
        outs = [out async for out in engine.generate(list(range(10, 60)), params)]
        assert sum(len(o.new_tokens) for o in outs) == 8 and outs[-1].finish_reason == "length"
        async for _ in engine.generate(list(range(10, 60)), SamplingParams(max_tokens=400)):
            break  # leaving early aborts the request
        with pytest.raises(ValueError, match="KV pool"):
            await engine.submit(list(range(600)), params)
        handle = await engine.submit(list(range(10, 60)), SamplingParams(max_tokens=400))
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineError, match="shutting down"):
            async for _ in handle:
                pass

    asyncio.run(main())
    engine.scheduler.check()  # the thread is gone: check from here
    assert not engine.scheduler.has_work()


def test_a_submit_that_saw_the_engine_alive_as_it_stopped_is_refused(model_dir: Path,
                                                                     monkeypatch) -> None:
    """A submit passes its alive check, then the engine stops and answers its last commands
    before the submit's command is queued: the submit gets EngineError, not a wait forever
    (run_in_engine_thread alike)."""
    engine = AsyncEngine(Scheduler(Engine(load_model(model_dir), EngineConfig(slots=512))))
    engine.start()
    engine.shutdown()
    assert engine.join(10)
    monkeypatch.setattr(AsyncEngine, "alive", property(lambda self: True))  # checked too early

    async def main() -> None:
        with pytest.raises(EngineError, match="shutting down"):
            await asyncio.wait_for(engine.submit(list(range(10, 20)), SamplingParams()), 10)
        with pytest.raises(EngineError, match="shutting down"):
            await asyncio.wait_for(asyncio.wrap_future(engine.run_in_engine_thread(len)), 10)

    asyncio.run(main())


def test_a_failed_step_keeps_none_of_its_requests_decoded_rows(model_dir: Path) -> None:
    """A step that raises outside the per-request handlers fails the running requests; their
    decoded rows (the failed step may not have written them all) stay out of the prefix index:
    a prompt continuing the failed request matches only its prompt, which its prefill
    committed. Serving goes on."""
    engine = AsyncEngine(Scheduler(Engine(load_model(model_dir), EngineConfig(slots=512))))
    scheduler = engine.scheduler
    real = scheduler.step
    fail = threading.Event()  # set by the test, read by the engine's thread

    def step():
        if fail.is_set():
            fail.clear()
            raise RuntimeError("injected step fault")
        return real()

    scheduler.step = step
    prompt = list(range(10, 60))
    engine.start()

    async def main() -> list[int]:
        output: list[int] = []
        with pytest.raises(EngineError, match="injected step fault"):
            async for out in engine.generate(prompt, SamplingParams(max_tokens=400)):
                output += out.new_tokens
                if len(output) >= 4:
                    fail.set()
        outs = [o async for o in engine.generate(list(range(70, 90)), SamplingParams(max_tokens=2))]
        assert outs[-1].finish_reason == "length"
        return output

    output = asyncio.run(main())
    engine.shutdown()
    scheduler.check()
    match = scheduler.engine.cache.planner.radix.match_prefix(np.array(prompt + output))
    assert len(output) >= 4 and match.length == len(prompt)


def test_a_request_finished_by_a_step_that_then_raised_is_not_left_waiting(
        model_dir: Path) -> None:
    """A step that finished a request (it left the queues) and then raised lost that request's
    outputs with it: its consumer gets the step's error instead of waiting forever."""
    engine = AsyncEngine(Scheduler(Engine(load_model(model_dir), EngineConfig(slots=512))))
    scheduler = engine.scheduler
    real = scheduler.step

    def step():
        outputs = real()
        if any(o.finished for o in outputs):
            raise RuntimeError("injected fault after finishing")
        return outputs

    scheduler.step = step
    engine.start()

    async def main() -> None:
        async def consume() -> None:
            async for _ in engine.generate(list(range(10, 40)), SamplingParams(max_tokens=1)):
                pass

        with pytest.raises(EngineError, match="injected fault after finishing"):
            await asyncio.wait_for(consume(), timeout=30)

    asyncio.run(main())
    engine.shutdown()
    scheduler.check()


def test_detokenizer_and_stop_strings(model_dir: Path) -> None:
    tokenizer = ChatRenderer.from_dir(model_dir).tokenizer
    text = "Gate B7 ✈ départ à midi — 東京."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi ").ids)
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)

    stops = StopStrings(["STOP", "xy"])
    # Three characters (the longest stop but one) are held back while they could start a stop.
    shown = [stops.push(piece) for piece in ("abcS", "TO", "P tail", "more")]
    assert shown == ["a", "bc", "", ""] and stops.stopped and stops.text == "abc"
    loose = StopStrings(["zz"])
    assert loose.push("az") == "a" and loose.push("b", final=True) == "zb"


def test_stop_tokens_and_marker_resets(model_dir: Path) -> None:
    renderer = ChatRenderer.from_dir(model_dir)
    ids = [renderer.tokenizer.token_to_id(t) for t in (EOS, END)]
    assert stop_token_ids(model_dir, renderer) == tuple(sorted(ids))
    request = ChatCompletionRequest(model="tiny", messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"Read this.{MARKER_TEXT}A shared file.{MARKER_TEXT}"}])
    prompt = chat_prompt(renderer, request)
    marker = renderer.marker.tolist()
    starts = [i for i in range(len(prompt.tokens)) if prompt.tokens[i:i + len(marker)] == marker]
    assert len(starts) == 2
    for start in starts:  # both edges of both markers, plus the two message starts
        assert {start, start + len(marker)} <= set(prompt.resets)
    assert len(prompt.resets) == 6


def test_cli_serve_subprocess(model_dir: Path) -> None:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, "-m", "irminsul.cli", "serve", "--model",
                             str(model_dir), "--port", str(port), "--pic", "observer",
                             "--slots", "1024", "--kr-slots", "4096"], env=env,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "irminsul serve did not come up"
            time.sleep(0.1)
        client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        name = client.models.list().data[0].id
        assert name == model_dir.name
        reply = client.chat.completions.create(model=name, messages=_messages(13), max_tokens=4,
                                               temperature=0)
        assert reply.usage.completion_tokens == 4 and reply.choices[0].finish_reason == "length"
    finally:
        proc.terminate()
        proc.wait(10)
