"""A soak (bounded, loopback only): thousands of requests of random sizes, salts and kinds, with
client disconnects and bad input mixed in, at 16 clients at once. Afterwards the pool's slot
counts are exact, memory is back within a margin of its warm level, every error a client saw
was counted, and a normal request is still served."""

from __future__ import annotations

import asyncio
import gc
import json
import random
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from fixtures.openai_server import Server, config, running
from fixtures.tiny_server_model import sentences

CLIENTS = 16
WARM, SOAK = 400, 2000  # requests in the warm-up and in the soak proper
RSS_MARGIN = 48 << 20  # bytes the process may grow by from its warm level
MEMO_BYTES = 2 << 20

BAD = [b'{"model": "tiny", "messages": [', b"[" * 20_000, b'{"model": "tiny"}',
       b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": NaN}',
       b'{"model": "tiny", "prompt": [[99999999999999999999999]]}',
       b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "8"}',
       b'{"model": "tiny", "messages": [{"role": "tool", "tool_calls": "oops"}]}',
       b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
       b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999}']


def _rss() -> int:
    gc.collect()
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _request(rng: random.Random) -> tuple[str, str, bytes | dict]:
    """(kind, path, body) of one random request."""
    roll = rng.random()
    if roll < 0.15:
        return "bad", "/v1/chat/completions", rng.choice(BAD)
    salt = rng.choice([None, "a", "b", "c", f"one-off-{rng.random()}"])
    fields = {"model": "tiny", "max_tokens": rng.randint(1, 12), "stream": rng.random() < 0.5,
              "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randint(0, 1000)}
    if salt is not None:
        fields["cache_salt"] = salt
    if roll < 0.25:
        return "completion", "/v1/completions", fields | {
            "prompt": [rng.randint(3, 250) for _ in range(rng.randint(1, 300))]}
    messages = [{"role": "system", "content": " ".join(sentences(rng.randint(1, 5),
                                                                 rng.randint(0, 40)))}]
    for turn in range(rng.randint(0, 4)):
        messages.append({"role": ("user", "assistant")[turn % 2],
                         "content": " ".join(sentences(rng.randint(1, 3), rng.randint(0, 400)))})
    messages.append({"role": "user", "content": f"question {rng.randint(0, 10**6)}?"})
    kind = "disconnect" if roll > 0.9 else "chat"
    return kind, "/v1/chat/completions", fields | {"messages": messages}


async def _one(client: httpx.AsyncClient, kind: str, path: str, body, seen: Counter) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if kind == "disconnect":  # hang up after the first bytes of the answer
        async with client.stream("POST", path, content=raw, headers=headers) as response:
            async for _ in response.aiter_bytes():
                break
        seen["disconnect"] += 1
        return
    response = await client.post(path, content=raw, headers=headers)
    seen[response.status_code] += 1
    if response.status_code >= 400:
        assert "error" in response.json()  # JSON in OpenAI's shape
    elif body.get("stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in response.text
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


async def _load(server: Server, count: int, seed: int) -> Counter:
    rng = random.Random(seed)
    requests = [_request(rng) for _ in range(count)]
    seen: Counter = Counter()
    queue: asyncio.Queue = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        async def worker() -> None:
            while not queue.empty():
                await _one(client, *queue.get_nowait(), seen)

        await asyncio.gather(*(worker() for _ in range(CLIENTS)))
    return seen


@pytest.fixture(scope="module")
def soak_server(model_dir) -> Iterator[Server]:
    with running(model_dir, config(render_memo_bytes=MEMO_BYTES)) as served:
        yield served


@pytest.mark.slow
def test_soak_holds_memory_and_slot_counts(soak_server: Server) -> None:
    server = soak_server
    warm = asyncio.run(_load(server, WARM, seed=1))
    server.check(timeout=60)
    rss_warm = _rss()
    errors_before = sum(server.errors(status) for status in (400, 413, 429, 500))
    seen = asyncio.run(_load(server, SOAK, seed=2))
    server.check(timeout=60)  # slot counts exact: nothing leaked by disconnects or errors
    rss_after = _rss()
    errors_after = sum(server.errors(status) for status in (400, 413, 429, 500))
    print(f"warm {dict(warm)}; soak {dict(seen)}; RSS warm {rss_warm / 2**20:.0f} MiB, after "
          f"{rss_after / 2**20:.0f} MiB")
    assert sum(seen.values()) == SOAK
    assert seen[200] > SOAK // 2 and seen[400] > SOAK // 20 and seen["disconnect"] > 50
    assert not any(status >= 500 for status in seen if isinstance(status, int))
    # Every error a client saw was counted (disconnected clients saw none).
    assert errors_after - errors_before == sum(n for s, n in seen.items()
                                               if isinstance(s, int) and s >= 400)
    assert rss_after - rss_warm < RSS_MARGIN
    assert server.app.state.server.renderer.memo.bytes <= MEMO_BYTES
    reply = server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "still there?"}], max_tokens=4,
        temperature=0)  # greedy: the tiny model never picks a stop token so
    assert reply.usage.completion_tokens == 4
