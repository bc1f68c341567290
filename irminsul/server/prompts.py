"""Requests to prompt tokens and chunker resets, and the model's stop tokens.

Chat messages are rendered by the model's chat template with :func:`render_prompt`, which gives
the engine's default resets: every message start and every S2 marker edge (markers are honoured
wherever the client put them). A completion prompt is plain text (or token ids) with no message
structure, so only marker edges reset the chunker there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..cache.markers import find_markers
from ..traffic.prompt import render_prompt
from ..traffic.render import ChatRenderer, Rendered, TemplateError
from .protocol import ChatCompletionRequest, CompletionRequest, RequestError
from .tool_calls import ToolSyntax


@dataclass(frozen=True)
class PromptTokens:
    """What the scheduler needs from a request's prompt."""

    tokens: list[int]
    resets: list[int]
    # What rendering added to the renderer's memo, kept there only once the engine accepts the
    # request (ChatRenderer.remember), so refused requests leave nothing behind.
    rendered: Rendered | None = field(default=None, repr=False, compare=False)


def chat_prompt(renderer: ChatRenderer, request: ChatCompletionRequest) -> PromptTokens:
    messages = [m.model_dump(exclude_none=True) for m in request.messages]
    # OpenAI's 'developer' messages are newer models' system messages: a template that would
    # drop them (it knows no such role) gets them as system messages.
    if any(m["role"] == "developer" for m in messages) and not renderer.shows_role("developer"):
        messages = [m | {"role": "system"} if m["role"] == "developer" else m for m in messages]
    try:
        prompt = render_prompt(renderer, messages, request.template_tools, remember=False)
    except TemplateError as err:
        raise RequestError(f"cannot render the messages: {err}", param="messages",
                           code="invalid_value") from err
    except (KeyError, TypeError, ValueError) as err:  # a shape the template cannot take
        raise RequestError(f"malformed messages: {err!r}", param="messages",
                           code="invalid_value") from err
    return PromptTokens(prompt.tokens.tolist(), prompt.resets.tolist(), prompt.rendered)


def open_forced_call(renderer: ChatRenderer, tool_syntax: ToolSyntax | None,
                     request: ChatCompletionRequest, prompt: PromptTokens) -> PromptTokens:
    """The prompt a chat request is served with: ``prompt`` (its :func:`chat_prompt`), and
    when the request requires a tool call, that call opened at its end, so the reply is one (a
    name the model then writes that is not a tool's is returned as content: nothing
    constrains decoding). The server and the router both call this, so the router cuts the
    prompt the engine plans. RequestError when a call is required of a template that writes
    none (``tool_syntax`` None)."""
    if request.forced_call is None:
        return prompt
    if tool_syntax is None:
        raise RequestError("this model's chat template writes no tool calls, so a call "
                           "cannot be required", param="tool_choice", code="invalid_value")
    opening = renderer.encode(tool_syntax.forced_opening(request.forced_call))
    return replace(prompt, tokens=prompt.tokens + opening.tolist())


def completion_prompt(renderer: ChatRenderer, request: CompletionRequest,
                      vocab_size: int) -> PromptTokens:
    if isinstance(request.prompt, str):
        try:
            tokens = renderer.encode(request.prompt)
        except TypeError as err:  # the tokenizer's word for text that is not valid Unicode
            raise RequestError(f"cannot tokenise the prompt: {err}", param="prompt",
                               code="invalid_value") from err
    else:
        tokens = np.asarray(request.prompt, dtype=np.int64)
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)]
        if bad.size:
            raise RequestError(f"token id {int(bad[0])} is outside the vocabulary "
                               f"[0, {vocab_size})", param="prompt", code="invalid_value")
    return PromptTokens(tokens.tolist(), find_markers(tokens, renderer.marker).tolist())


def stop_token_ids(model_dir: str | os.PathLike, renderer: ChatRenderer) -> tuple[int, ...]:
    """End-of-generation ids: generation_config.json's and config.json's ``eos_token_id``
    (an id or a list), and tokenizer_config.json's ``eos_token`` looked up in the tokenizer."""
    path = Path(model_dir)
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        value = _read_json(path / name).get("eos_token_id")
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int):
                ids.add(item)
    eos = _read_json(path / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str) and eos:
        token_id = renderer.tokenizer.token_to_id(eos)
        if token_id is not None:
            ids.add(token_id)
    return tuple(sorted(ids))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
