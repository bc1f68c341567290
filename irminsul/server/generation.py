"""One request's token stream turned into text and tool calls: detokenized, cut at stop strings,
accounted.

Both endpoints, streaming or not, consume :meth:`Generation.deltas`; the non-streaming answer is
the concatenation of what a stream would have sent, so the two are equal by construction. A chat
request with tools reads its calls out of the reply (:mod:`.tool_calls`); stop strings apply to
the content before them. When a stop string appears the request is aborted with reason "stop" (its slots
are freed at once, not after ``max_tokens``); when the consumer goes away (a disconnected client
cancels it) the request is aborted too.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from ..engine import ServeStats
from .async_engine import EngineError, RequestHandle
from .detokenizer import IncrementalDetokenizer, StopStrings
from .metrics import ServerMetrics
from .tool_calls import ToolCallDelta, ToolCallReader


@dataclass
class Usage:
    """Token counts for the response's ``usage`` block."""

    prompt_tokens: int
    completion_tokens: int
    stats: ServeStats | None  # where the prompt came from; None if it was never served

    def to_json(self) -> dict:
        prefix = self.stats.prefix_tokens if self.stats else 0
        derived = self.stats.derived_prefix_tokens if self.stats else 0
        pic = self.stats.pic_tokens if self.stats else 0
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": prefix + derived + pic},
                "irminsul": {"prefix_cached_tokens": prefix, "pic_cached_tokens": pic,
                             "derived_prefix_cached_tokens": derived}}


class Generation:
    """Iterate :meth:`deltas`; afterwards ``finish_reason`` and :meth:`usage` are set."""

    def __init__(self, handle: RequestHandle, tokenizer: Tokenizer, prompt: Sequence[int],
                 stops: Sequence[str], metrics: ServerMetrics, *,
                 on_start: Callable[[], None] | None = None,
                 tool_calls: ToolCallReader | None = None) -> None:
        """``on_start`` is called once: at the first output, or when the generation ends
        without one. ``tool_calls`` reads calls out of the reply (None: the reply is text)."""
        self.handle = handle
        self._calls = tool_calls
        self._on_start = on_start
        self.finish_reason: str | None = None
        self._detok = IncrementalDetokenizer(tokenizer, prompt)
        self._stops = StopStrings(stops)
        self._after = StopStrings(stops)  # over the content the tool-call reader returns
        self._metrics = metrics
        self._generated = 0
        self._stats: ServeStats | None = None
        self._start = time.perf_counter()

    def started(self) -> None:
        """The request has its first output (or will never have one): call ``on_start``."""
        if self._on_start is not None:
            on_start, self._on_start = self._on_start, None
            on_start()

    def usage(self) -> Usage:
        return Usage(self.handle.prompt_tokens, self._generated, self._stats)

    async def reply(self) -> tuple[str, list[dict]]:
        """The whole reply: its text, and its tool calls in the shape of a message's
        ``tool_calls`` (the concatenation of what :meth:`deltas` streams)."""
        text: list[str] = []
        calls: list[dict] = []
        async for piece in self.deltas():
            if isinstance(piece, str):
                text.append(piece)
            elif piece.name is not None:
                call = piece.to_json()
                del call["index"]  # a stream's field, not a message's
                calls.append(call)
            else:
                calls[piece.index]["function"]["arguments"] += piece.arguments
        return "".join(text), calls

    async def deltas(self) -> AsyncIterator[str | ToolCallDelta]:
        """Non-empty pieces of the completion text and steps of its tool calls, in order."""
        calls = self._calls
        try:
            async for out in self.handle:
                self.started()
                if out.stats is not None:
                    self._stats = out.stats
                    self._metrics.prompt_served(out.stats, out.ttft)
                self._generated += len(out.new_tokens)
                ids = out.new_tokens if calls is None else calls.push(out.new_tokens)
                if calls is not None and out.finished:
                    ids = [*ids, *calls.finish()]
                text = self._stops.push(self._detok.push(ids)) if ids else ""
                if not self._stops.stopped and (out.finished or calls is not None
                                                and calls.reading):
                    # The content ends here: at the reply's end, or where its calls open.
                    text += self._stops.push(self._detok.flush(), final=True)
                steps: list[str | ToolCallDelta] = []
                if calls is not None and not self._stops.stopped:
                    # Text the reader returns as content (after the block, or a block that
                    # broke the syntax) is content: stop strings apply to it too.
                    for step in calls.take():
                        if isinstance(step, str):
                            step = self._after.push(step)
                        steps.append(step)
                        if self._after.stopped:
                            break
                    if out.finished and not self._after.stopped:
                        steps.append(self._after.push("", final=True))
                if self._stops.stopped or self._after.stopped:
                    self.handle.abort("stop")  # frees the slots now, not at max_tokens
                    self.finish_reason = "stop"
                elif calls is not None and calls.done:  # the calls asked for are complete
                    self.handle.abort("stop")
                    self.finish_reason = "stop" if calls.named else "tool_calls"
                elif out.finished:
                    self.finish_reason = out.finish_reason or "stop"
                    # OpenAI's word for a reply that called tools by choice; a reply made to
                    # call a named tool stops as any other.
                    if (calls is not None and calls.calls and not calls.named
                            and self.finish_reason == "stop"):
                        self.finish_reason = "tool_calls"
                if text:
                    yield text
                for step in steps:
                    if step:
                        yield step
                if self.finish_reason is not None:
                    break
        except EngineError:
            self.finish_reason = "error"
            raise
        finally:
            self.started()
            self.handle.abort()  # a consumer that left early: free the request's slots
            self._metrics.finished(self.finish_reason or "abort", self._generated,
                                   time.perf_counter() - self._start)

