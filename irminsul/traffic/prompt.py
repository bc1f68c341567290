"""A rendered request: prompt tokens plus the chunker resets its assembler knows about."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..cache.markers import find_markers
from .logs import read_requests
from .render import ChatRenderer, Rendered


@dataclass(frozen=True)
class Prompt:
    """Prompt tokens, where each chat message begins, and S2 marker edges found in them."""

    session: str
    tokens: np.ndarray  # int32 [n]
    message_starts: np.ndarray  # int64
    markers: np.ndarray  # int64 (empty when the prompt has none)
    rendered: Rendered | None = field(default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        return int(self.tokens.size)

    @cached_property
    def resets(self) -> np.ndarray:
        """The engine's default chunker restarts: every message start and every marker edge."""
        return np.union1d(self.message_starts, self.markers)


def render_prompt(renderer: ChatRenderer, messages: list[dict], tools: list[dict] | None = None,
                  *, session: str = "", remember: bool = True) -> Prompt:
    """Render a chat request (with the generation prompt) and find its resets. With
    ``remember=False`` the renderer keeps nothing until ``renderer.remember(prompt.rendered)``."""
    rendered = renderer.render(messages, tools, remember=remember)
    return Prompt(session, rendered.tokens, rendered.message_starts,
                  find_markers(rendered.tokens, renderer.marker), rendered)


def distinct_messages(renderer: ChatRenderer, logs: Iterable[str | os.PathLike]) -> list[np.ndarray]:
    """Every distinct rendered message of the logs, once, in order of first appearance (token ids
    of each): real agent text without the history that logs repeat on every call."""
    seen: set[bytes] = set()
    parts = []
    for log in logs:
        for request in read_requests(log):
            rendered = renderer.render(request.messages, request.tools)
            for start, end in rendered.spans.tolist():
                piece = rendered.tokens[start:end]
                if piece.tobytes() not in seen:
                    seen.add(piece.tobytes())
                    parts.append(piece)
    return parts


def message_tokens(renderer: ChatRenderer, logs: Iterable[str | os.PathLike]) -> np.ndarray:
    """:func:`distinct_messages` back to back (int64)."""
    return np.concatenate(distinct_messages(renderer, logs)).astype(np.int64)
