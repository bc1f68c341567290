"""Tool calls read out of a reply, in the syntax the model's own chat template writes them.

An agent sends ``tools`` and expects a reply that calls one to come back as ``tool_calls``, not
as text. The syntax differs per model:

    DeepSeek-V3     <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                    ```json\\nARGS\\n```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>
    DeepSeek-V3.1   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>…
    Qwen style      <tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>
    embedded model  <|tool_call|>NAME\\nARGS<|tool_call|>NAME\\nARGS

The chat template is the definition: it writes an assistant message's ``tool_calls`` into the
prompt in the syntax the model learned to produce. :meth:`ToolSyntax.learn` renders the template
with one call and with two (sentinel names and arguments) and reads the syntax off the text, so
no table of per-model parsers is kept.

:class:`ToolCallReader` takes a reply's token ids. Until the calls open, ids pass through as
content (the server detokenizes them and applies stop strings as for any reply). The opening is
recognised by its token ids: its first token alone where that is one of the tokenizer's added
tokens (a marker, as in every template above), else the opening's ids as the tokenizer encodes
it alone, but the last (a plain-text opening is only found where the model's reply tokenises it
the same way). From there the reply is decoded with special tokens kept and read as calls,
streamed as OpenAI streams them: a call is announced once its whole name has arrived, and its
arguments follow as they are generated (held back only where they could be the start of the
call's end). Whitespace a template writes around calls (before the first only after content, or
between calls) is not part of the syntax. Arguments are not checked to be JSON, as OpenAI does
not check them without ``strict``; a name that is not one of the request's tools, or text that
does not follow the syntax, ends the reading and the rest of the reply (from the opening, or
from the broken call on) is returned as content, so nothing is lost.

A call that ``tool_choice`` requires is forced by ending the prompt with the opening
(:meth:`ToolSyntax.forced_opening`), after a "</think>" where the template's generation prompt
leaves a reasoning block open (R1-style templates end it with "<think>\n").
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from ..traffic.render import ChatRenderer
from .detokenizer import IncrementalDetokenizer

# Sentinels rendered through the template to find the syntax around them.
_CONTENT, _NAMES, _ARGS = "IrminsulContent", ("irminsul_one", "irminsul_two"), \
    ('{"irminsul": 1}', '{"irminsul": 2}')
MAX_NAME_CHARS = 256  # a name not ended by then is not a name: the reading stops


@dataclass(frozen=True)
class ToolSyntax:
    """How a template writes calls: ``begin``, then per call ``call_begin`` NAME ``name_end``
    ARGS ``call_end``, then ``end``. ``begin``, ``call_end`` and ``end`` may be empty (then a
    call's arguments run to the next ``call_begin`` or the end of the reply)."""

    begin: str
    call_begin: str
    name_end: str
    call_end: str
    end: str
    trigger: tuple[int, ...]  # token ids that open the calls
    # What closes a reasoning block the generation prompt leaves open (R1-style templates end
    # it with "<think>\n"): a call forced into the prompt comes after it, not inside it.
    think_close: str = ""

    @classmethod
    def learn(cls, renderer: ChatRenderer) -> ToolSyntax | None:
        """The syntax ``renderer``'s template writes calls in; None when it writes none (or in
        a shape this reading does not cover)."""
        def after_content(calls: int) -> str:
            """The assistant message's text after its content, with ``calls`` calls."""
            message: dict = {"role": "assistant", "content": _CONTENT}
            if calls:
                message["tool_calls"] = [
                    {"id": f"call_{i}", "type": "function",
                     "function": {"name": _NAMES[i], "arguments": _ARGS[i]}}
                    for i in range(calls)]
            text = renderer.render_text([{"role": "user", "content": "hi"}, message])
            return text[text.index(_CONTENT) + len(_CONTENT):]

        try:
            tail = after_content(0)  # what ends the message
            parts = _split(after_content(1), [_NAMES[0], _ARGS[0]])
            parts2 = _split(after_content(2), [_NAMES[0], _ARGS[0], _NAMES[1], _ARGS[1]])
        # No calls written, or not around the sentinels (ValueError); or a template that cannot
        # take the sample call at all (one iterating arguments as a mapping raises TypeError):
        # either way the server serves on, returning replies as text.
        except Exception:  # noqa: BLE001
            return None
        opening, name_end, close = parts
        between = parts2[2]
        if not (name_end and close.endswith(tail) and parts2[0] == opening
                and parts2[3] == name_end and parts2[4] == close):
            return None
        close = close[:len(close) - len(tail)]
        # call_begin is what the first call's opening and the second's share at their ends;
        # compared in tokens, so a marker is never cut inside its text.
        tokenizer = renderer.tokenizer
        added = tokenizer.get_added_tokens_decoder()
        shared = _common_suffix(renderer.encode(opening).tolist(),
                                renderer.encode(between).tolist())
        call_begin = tokenizer.decode(shared, skip_special_tokens=False) if shared else ""
        if not call_begin or not opening.endswith(call_begin) or not between.endswith(call_begin):
            return None
        # Whitespace before a marker is not the opening's: Qwen3's template writes "\n" before
        # <tool_call> only after content, and a reply merges it with the text before ("check.\n"
        # is one token), so a trigger starting with it is never seen.
        stripped = opening.lstrip()
        if stripped != opening and stripped and int(renderer.encode(stripped)[0]) in added:
            opening = stripped
            if len(call_begin) > len(opening):
                call_begin = opening
        begin = opening[:len(opening) - len(call_begin)]
        call_end = between[:len(between) - len(call_begin)]
        if not close.startswith(call_end):
            # Whitespace between calls (DeepSeek-V3 writes "\n" before all but the first): the
            # call ends before it.
            if call_end.rstrip() == call_end or not close.startswith(call_end.rstrip()):
                return None
            call_end = call_end.rstrip()
        opening_ids = renderer.encode(opening).tolist()
        # A marker opens the calls alone. A plain-text opening is its run of ids but the last,
        # which may merge with the name that follows (" [[call " + "search" tokenises as
        # " [[", "call", " search"); the text read after it must then follow the syntax.
        trigger = tuple(opening_ids[:1] if opening_ids[0] in added else
                        opening_ids[:max(1, len(opening_ids) - 1)])
        return cls(begin, call_begin, name_end, call_end, close[len(call_end):], trigger,
                   _think_close(renderer))

    def opening(self, name: str = "") -> str:
        """The text that opens a reply's first call (of ``name``, if given, up to its
        arguments): put at the end of the prompt, it makes the reply a call."""
        return self.begin + self.call_begin + (name + self.name_end if name else "")

    def forced_opening(self, name: str = "") -> str:
        """What a prompt ends with to make the reply a call (of ``name``, if given): the
        :meth:`opening`, after closing the reasoning block the generation prompt opened."""
        return self.think_close + self.opening(name)


def _think_close(renderer: ChatRenderer) -> str:
    """"</think>" (and the blank line R1-style replies put after it, where the prompt's
    "<think>" is followed by a newline) when the template's generation prompt leaves a
    reasoning block open; else ""."""
    try:
        text = renderer.render_text([{"role": "user", "content": _CONTENT}], generation=True)
        tail = text[text.rindex(_CONTENT) + len(_CONTENT):]
    except Exception:  # noqa: BLE001  (a template that needs more than one user message)
        return ""
    if tail.rfind("<think>") <= tail.rfind("</think>"):  # none opened, or closed again
        return ""
    return "</think>\n\n" if tail.endswith("\n") else "</think>"


@dataclass(frozen=True)
class ToolCallDelta:
    """One step of a call: ``name`` (and ``id``) when it is announced, else more ``arguments``."""

    index: int
    arguments: str = ""
    name: str | None = None
    id: str | None = None

    def to_json(self) -> dict:
        """The OpenAI stream shape of this step (an element of ``delta.tool_calls``)."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallReader:
    """One reply's ids in (:meth:`push`, then :meth:`finish` at its end), content ids back;
    :meth:`take` gives what was read since, in order: call steps, and text that is content
    after all (a block that does not follow the syntax, text after the block)."""

    def __init__(self, syntax: ToolSyntax, tokenizer: Tokenizer, names: Collection[str],
                 stop_token_ids: Collection[int], *, request_id: str,
                 forced: str | None = None, max_calls: int | None = None) -> None:
        """``forced``: the prompt ends with :meth:`ToolSyntax.opening` of this name (``''``:
        the opening without a name), so the reply starts inside the call. ``max_calls``: the
        reading is :attr:`done` once that many calls are complete (OpenAI's
        ``parallel_tool_calls: false`` is 1); None: no limit."""
        self._syntax, self._names, self._stops = syntax, frozenset(names), set(stop_token_ids)
        self._tokenizer = tokenizer
        self._request_id = request_id
        self._held: list[int] = []  # ids that may be the start of the trigger
        self._raw: IncrementalDetokenizer | None = None  # the calls' text, markers kept
        self._buf = ""  # text read but not yet consumed
        self._text = ""  # all of the calls' text so far (returned as content on a failure)
        self._state = "begin"
        self._mark = 0  # where in _text the call being read began (content from here on a failure)
        self.calls = 0  # calls announced
        self._out: list[str | ToolCallDelta] = []
        self.named = bool(forced)
        self._max_calls = max_calls
        if forced is not None:
            self._raw = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
            self._state = "name"
            if forced:
                self._announce(forced)
                self._state = "args"

    @property
    def done(self) -> bool:
        """``max_calls`` calls are complete: the rest of the reply is not wanted."""
        return self._state == "done"

    @property
    def reading(self) -> bool:
        """The calls have opened: nothing more passes as content ids."""
        return self._raw is not None

    def push(self, ids: Sequence[int]) -> list[int]:
        """Add output ids; return those that are content (the others are held or read)."""
        if self._raw is not None:
            self._read(self._raw.push(t for t in ids if t not in self._stops))
            return []
        trigger = self._syntax.trigger
        buf = self._held + list(ids)
        at = _find(buf, trigger)
        if at >= 0:
            self._held = []
            self._raw = IncrementalDetokenizer(self._tokenizer, skip_special_tokens=False)
            self._read(self._raw.push(t for t in buf[at:] if t not in self._stops))
            return buf[:at]
        keep = next((k for k in range(min(len(trigger) - 1, len(buf)), 0, -1)
                     if buf[-k:] == list(trigger[:k])), 0)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def take(self) -> list[str | ToolCallDelta]:
        """What was read since the last call, in order."""
        out, self._out = self._out, []
        return out

    def finish(self) -> list[int]:
        """The reply has ended: return the held ids that are content after all, and flush the
        calls' text (arguments still held back are sent; a block cut short is content)."""
        held, self._held = self._held, []
        if self._raw is not None:
            self._read(self._raw.flush(), final=True)
        return held

    def _read(self, text: str, *, final: bool = False) -> None:
        if self._state == "done":  # the rest of the reply is not wanted
            return
        self._text += text
        self._buf += text
        s = self._syntax
        while self._state not in ("failed", "after", "done"):
            buf = self._buf
            if self._state == "begin":
                opening = s.begin + s.call_begin
                if buf.startswith(opening):
                    self._consume(len(opening), "name")
                elif final or not opening.startswith(buf):
                    self._fail()
                else:
                    return
            elif self._state == "name":
                at = buf.find(s.name_end)
                if at < 0:
                    if final or len(buf) > MAX_NAME_CHARS:
                        self._fail()
                    return
                name = buf[:at].strip()
                if name not in self._names:
                    self._fail()
                    return
                self._announce(name)
                self._consume(at + len(s.name_end), "args")
            elif self._state == "args":
                ends = [s.call_end] if s.call_end else [e for e in (s.call_begin, s.end) if e]
                hits = [(i, e) for e in ends if (i := buf.find(e)) >= 0]
                if not hits:
                    send = len(buf) if final else max(0, len(buf) - max(map(len, ends)) + 1)
                    self._arguments(buf[:send])
                    self._buf = buf[send:]
                    return
                at, end = min(hits)
                self._arguments(buf[:at])
                if s.call_end:
                    self._consume(at + len(end), "between")
                else:  # the next call's opening, or the block's end
                    self._consume(at + (len(end) if end == s.end else 0),
                                  "after" if end == s.end else "between")
            else:  # between calls (whitespace between them skipped)
                texts = [buf] if buf == buf.lstrip() else [buf, buf.lstrip()]
                skip = {t: len(buf) - len(t) for t in texts}
                if (t := next((t for t in texts if t.startswith(s.call_begin)), None)) is not None:
                    self._consume(skip[t] + len(s.call_begin), "name")
                elif s.end and (t := next((t for t in texts if t.startswith(s.end)), None)) \
                        is not None:
                    self._consume(skip[t] + len(s.end), "after")
                elif not final and any(s.call_begin.startswith(t) or s.end.startswith(t)
                                       for t in texts):
                    return
                else:
                    self._state = "after"
        if self._state == "done":
            self._buf = ""
        elif self._buf:  # after the block (or a failure) the text is content again
            self._content(self._buf)
            self._buf = ""

    def _announce(self, name: str) -> None:
        self._out.append(ToolCallDelta(
            self.calls, name=name, id=f"call_{self._request_id[-24:]}_{self.calls}"))
        self.calls += 1

    def _consume(self, chars: int, state: str) -> None:
        self._buf, self._state = self._buf[chars:], state
        if state == "between":  # the next call, if any, starts here
            self._mark = len(self._text) - len(self._buf)
            if self._max_calls is not None and self.calls >= self._max_calls:
                self._state = "done"

    def _arguments(self, text: str) -> None:
        if text:
            self._out.append(ToolCallDelta(self.calls - 1, arguments=text))

    def _content(self, text: str) -> None:
        if text:
            self._out.append(text)

    def _fail(self) -> None:
        """The text does not follow the syntax: from the last call boundary on, it is content."""
        self._content(self._text[self._mark:])
        self._buf, self._state = "", "failed"


def _split(text: str, pieces: list[str]) -> list[str]:
    """``text`` cut around each of ``pieces`` in order: the len(pieces) + 1 texts between them
    (ValueError when a piece is missing, or appears twice)."""
    out, at = [], 0
    for piece in pieces:
        if text.count(piece) != 1:
            raise ValueError(piece)
        i = text.index(piece, at)
        out.append(text[at:i])
        at = i + len(piece)
    out.append(text[at:])
    return out


def _common_suffix(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n:]


def _find(ids: list[int], sub: tuple[int, ...]) -> int:
    for i in range(len(ids) - len(sub) + 1):
        if tuple(ids[i:i + len(sub)]) == sub:
            return i
    return -1

