"""A server's published index (GET /irminsul/index): what it holds, checked against hashes of
the served prompt computed here, and its incremental polling."""

from __future__ import annotations

import base64
import secrets

import httpx
import numpy as np
import xxhash
from router_servers import MODEL

from irminsul.cache.cdc import namespace_seed
from irminsul.model.default import default_model_dir
from irminsul.router.digest import public
from irminsul.traffic.prompt import render_prompt
from irminsul.traffic.render import ChatRenderer


def _index(url: str, **params: object) -> dict:
    answer = httpx.get(f"{url}/irminsul/index", params=params)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _set(text: str) -> set[int]:
    return set(np.frombuffer(base64.b64decode(text), dtype="<u8").tolist())


def test_the_index_holds_the_served_prompt_and_polls_incrementally(replicas) -> None:
    url, salt = replicas[0], secrets.token_hex(4)
    before = _index(url)
    assert before["full"] and before["block_tokens"] == 64
    words = "copper salt wool maps lanterns river ledger stone mill market".split()
    # A system prompt past the carve-out (32 tokens): the user message after it is a region.
    messages = [{"role": "system", "content": "You are the indexer. " * 12},
                {"role": "user", "content": " ".join(np.random.default_rng(0).choice(words,
                                                                                    200))}]
    answer = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": 2, "cache_salt": salt})
    assert answer.status_code == 200

    after = _index(url, generation=before["generation"], since=before["version"])
    assert not after["full"] and after["version"] > before["version"]
    # The prompt as the engine rendered it, hashed here by the format's definition.
    prompt = render_prompt(ChatRenderer.from_dir(default_model_dir()), messages)
    tokens, namespace = prompt.tokens.astype("<u4"), namespace_seed(MODEL, salt)
    chain, h = [], namespace
    for k in range(tokens.size // 64):
        h = xxhash.xxh64_intdigest(tokens[64 * k:64 * (k + 1)].tobytes(), h)
        chain.append(public(h))
    assert len(chain) >= 4 and set(chain) <= _set(after["prefix"]["added"])
    # The last message and the generation prompt after it: the last region, registered whole.
    start = prompt.rendered.spans[1][0]
    assert start >= 32
    region = public(xxhash.xxh64_intdigest(tokens[start:].tobytes(), namespace))
    assert region in _set(after["chunks"]["added"])
    assert after["load"]["kv_usage"] > 0

    same = _index(url, generation=after["generation"], since=after["version"])
    assert not same["full"] and same["version"] == after["version"]
    assert same["prefix"]["added"] == same["chunks"]["added"] == ""  # nothing changed
    # Another process's generation (a restarted server) gets everything.
    fresh = _index(url, generation="another", since=after["version"])
    assert fresh["full"] and set(chain) <= _set(fresh["prefix"]["added"])

    for since in ("latest", "\u00b2", "\u0661"):  # a word, a superscript two, an Arabic one
        bad = httpx.get(f"{url}/irminsul/index", params={"since": since})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"
