"""Token ids to text, a few tokens at a time, and stop strings over that text.

Byte-level BPE splits a multi-byte character over several tokens, so decoding token by token would
emit replacement characters; and some decoders (SentencePiece-style) drop a leading space when a
token is decoded alone. :class:`IncrementalDetokenizer` therefore decodes a short window that
starts a few tokens back (seeded with the end of the prompt) and emits only the text that window
adds, holding it back while it ends in an incomplete character.

:class:`StopStrings` truncates the text at the first stop string and holds back the last
``len(longest stop) - 1`` characters until they cannot start one, so a streamed response never
shows the beginning of a stop string it then takes back — and streamed text equals non-streamed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, for decoders that look back


class IncrementalDetokenizer:
    """Feed output ids with :meth:`push`, get the new text; :meth:`flush` at the end."""

    def __init__(self, tokenizer: Tokenizer, prompt: Sequence[int] = (), *,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = [int(t) for t in prompt[-CONTEXT_TOKENS:]]
        if REPLACEMENT in self._decode(context):
            context = []  # the prompt ends mid-character: it would garble the first output
        self._ids = context
        self._prefix_offset = 0  # the decode window starts here
        self._read_offset = len(context)  # text of ids before this has been emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, ids: Iterable[int]) -> str:
        """Append output token ids; return the text they complete (possibly empty)."""
        self._ids.extend(int(t) for t in ids)
        before = self._decode(self._ids[self._prefix_offset:self._read_offset])
        after = self._decode(self._ids[self._prefix_offset:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end, as decoded)."""
        before = self._decode(self._ids[self._prefix_offset:self._read_offset])
        after = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return after[len(before):] if len(after) > len(before) else ""


class StopStrings:
    """Cuts generated text at the first of the stop strings (the stop string itself excluded)."""

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything accepted so far (truncated at a stop once one is seen)
        self._emitted = 0
        self.stopped = False

    def push(self, delta: str, *, final: bool = False) -> str:
        """Add generated text; return what may be shown now. After a stop string is seen,
        ``stopped`` is True, the returned text ends just before it, and later calls return ''."""
        if self.stopped:
            return ""
        # A new match must end inside the delta, so it starts at most hold characters earlier;
        # any earlier match would have been found on a previous call.
        start = max(0, len(self.text) - self._hold)
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True
            final = True
        limit = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        out, self._emitted = self.text[self._emitted:limit], limit
        return out
