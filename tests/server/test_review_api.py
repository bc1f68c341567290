"""Request fields of OpenAI's chat and text completion APIs: those OpenAI documents as nullable
take their defaults when null, and those that change the answer are never silently ignored."""

from __future__ import annotations

import httpx
import pytest
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


@pytest.mark.parametrize("change", [
    {"functions": [{"name": "get_time", "parameters": {"type": "object", "properties": {}}}]},
    {"functions": [{"name": "get_time"}], "function_call": {"name": "get_time"}},
])
def test_legacy_functions_are_not_silently_ignored(server: Server, change: dict) -> None:
    """OpenAI's (deprecated) ``functions`` / ``function_call`` offer functions to call; served
    as if absent, the model never saw them and the client gets text where it expects a call."""
    response = _post(server, CHAT, **change)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "functions"


def test_function_call_without_functions_is_neutral_or_refused(server: Server) -> None:
    assert _post(server, CHAT, function_call="auto").status_code == 200
    response = _post(server, CHAT, function_call={"name": "get_time"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "function_call"


@pytest.mark.parametrize("change, param", [
    ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
     "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
])
def test_audio_output_is_not_silently_ignored(server: Server, change: dict, param: str) -> None:
    """Asked for an audio reply, a text-only server must say so, not answer text alone."""
    response = _post(server, CHAT, **change)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert _post(server, CHAT, modalities=["text"]).status_code == 200


def test_completion_logprobs_zero_is_not_silently_ignored(server: Server) -> None:
    """OpenAI's /v1/completions ``logprobs``: "the API will always return the logprob of the
    sampled token", so ``logprobs: 0`` asks for the sampled tokens' logprobs; answering
    ``"logprobs": null`` ignores it."""
    response = _post(server, TEXT, logprobs=0)
    if response.status_code == 200:
        assert response.json()["choices"][0]["logprobs"] is not None
    else:
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "logprobs"
    assert _post(server, TEXT, logprobs=None).status_code == 200
    assert _post(server, CHAT, logprobs=False).status_code == 200


@pytest.mark.parametrize("path", [CHAT, TEXT])
@pytest.mark.parametrize("change, neutral", [
    ({"min_p": 0.1}, {"min_p": 0}),
    ({"repetition_penalty": 1.3}, {"repetition_penalty": 1}),
    ({"min_tokens": 2}, {"min_tokens": 0}),
    ({"ignore_eos": True}, {"ignore_eos": False}),
    ({"stop_token_ids": [5]}, {"stop_token_ids": []}),
    ({"include_stop_str_in_output": True}, {"include_stop_str_in_output": False}),
])
def test_vllm_sampling_extensions_are_not_silently_ignored(server: Server, path: str,
                                                           change: dict, neutral: dict) -> None:
    """The server takes vLLM's ``top_k`` extension, so a client written for vLLM sends its
    siblings too (the openai client's ``extra_body``); served as if absent, the reply is sampled
    or cut otherwise than asked. Each is refused with a 400 naming it, unless neutral."""
    response = _post(server, path, **change)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == next(iter(change))
    assert _post(server, path, **neutral).status_code == 200


# DeepSeek-V2's chat template (as in its tokenizer_config.json): it knows no 'developer' role.
DEEPSEEK_V2_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'User: ' + message['content'] + '\n\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}"
    "{{ message['content'] + '\n\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def test_developer_messages_reach_a_template_that_knows_only_system(model_dir) -> None:
    """OpenAI's 'developer' messages are the system prompt of newer models; a model whose
    template knows no such role must still see them (as system), not have them dropped."""
    from irminsul.server.prompts import chat_prompt
    from irminsul.server.protocol import ChatCompletionRequest
    from irminsul.traffic.render import ChatRenderer

    renderer = ChatRenderer(ChatRenderer.from_dir(model_dir).tokenizer, DEEPSEEK_V2_TEMPLATE)
    request = ChatCompletionRequest.model_validate({"model": "tiny", "messages": [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "hello"}]})
    text = renderer.tokenizer.decode(chat_prompt(renderer, request).tokens)
    assert "Answer in French." in text
