"""Request fields of OpenAI's chat and text completion APIs: those OpenAI documents as nullable
take their defaults when null, and those that change the answer are never silently ignored."""

from __future__ import annotations

import httpx
from fixtures.openai_server import Server

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "What leaves at noon?"}]


def _post(server: Server, path: str, **change) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0}
    body |= {"messages": MESSAGES} if path == CHAT else {"prompt": "hello"}
    return httpx.post(f"{server.url}{path}", json=body | change, timeout=60)


def test_fields_openai_documents_as_nullable_accept_null(server: Server) -> None:
    """OpenAI: ``n``, ``stream`` (both endpoints) and ``echo`` are "integer or null" / "boolean
    or null" with defaults 1 and false; the openai client sends null for a None argument."""
    reply = server.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                                  n=None, stream=None)
    assert len(reply.choices) == 1 and reply.choices[0].finish_reason == "length"
    text = server.client.completions.create(model="tiny", prompt="hello", max_tokens=3, n=None,
                                            stream=None, echo=None)
    assert len(text.choices) == 1 and text.choices[0].finish_reason == "length"
    server.check()
