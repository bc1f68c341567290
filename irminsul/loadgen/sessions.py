"""Agent sessions from a request log: each session's calls in order, each with its reply length.

A log line is one LLM call carrying the session's whole history. The calls of a session are
replayed one after another; how long a reply to ask for is read from the log itself: the reply to
a call is the first assistant message of the *next* call that this call does not have yet (its
history only grows: a call with ``a`` assistant messages is answered by the next call's assistant
message number ``a``). Its length is what a model would generate for it: the tokens its rendering
adds after the generation prompt (content, tool calls and the end-of-turn token, by the model's
own chat template). A call with no such message (the last of a session, or a history that was
rewritten) gets a fixed length.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..traffic.logs import Request
from ..traffic.render import ChatRenderer


@dataclass(frozen=True)
class Call:
    """One call to replay: the request, where it sits, and how many tokens to ask for."""

    session: int  # index of its session in the replay
    index: int  # position in its session (0, 1, ...)
    request: Request
    max_tokens: int
    logged_reply: bool  # max_tokens is the logged reply's length (else the fixed default)


@dataclass(frozen=True)
class Session:
    name: str
    calls: tuple[Call, ...]


def group_sessions(requests: Iterable[Request]) -> list[list[Request]]:
    """Requests by session, sessions in order of first appearance, each session's calls by their
    ``call`` field (log order among equal ones)."""
    groups: dict[str, list[Request]] = {}
    for request in requests:
        groups.setdefault(request.session, []).append(request)
    return [sorted(calls, key=lambda r: r.call) for calls in groups.values()]


def reply_index(call: Request, following: Request) -> int | None:
    """Index in ``following.messages`` of the reply to ``call``: its first assistant message
    beyond the ones ``call`` already has; None when it has none."""
    seen = sum(m.get("role") == "assistant" for m in call.messages)
    assistant = [i for i, m in enumerate(following.messages) if m.get("role") == "assistant"]
    return assistant[seen] if seen < len(assistant) else None


def reply_tokens(renderer: ChatRenderer, request: Request, index: int) -> int:
    """Tokens a model generates for ``request.messages[index]`` (an assistant message): what
    rendering it adds to the conversation before it once the generation prompt is taken off
    (at least 1)."""
    before = request.messages[:index]
    prompt = renderer.render(before, request.tools, add_generation_prompt=True)
    answered = renderer.render(request.messages[:index + 1], request.tools,
                               add_generation_prompt=False)
    return max(1, answered.tokens.size - prompt.tokens.size)


def build_sessions(requests: Iterable[Request], renderer: ChatRenderer, *,
                   sessions: int | None = None, calls: int | None = None,
                   default_reply: int = 256, max_reply: int | None = None) -> list[Session]:
    """The first ``sessions`` sessions of a log (all if None), the first ``calls`` calls of each
    (all if None), each call's ``max_tokens`` the logged reply's length or ``default_reply``, cut
    to ``max_reply`` when given. The reply to a session's last kept call still comes from the
    log's next call when there is one."""
    out = []
    for s, group in enumerate(group_sessions(requests)[:sessions]):
        kept = []
        for i, request in enumerate(group[:calls]):
            length, logged = default_reply, False
            if i + 1 < len(group):
                index = reply_index(request, group[i + 1])
                if index is not None:
                    length, logged = reply_tokens(renderer, group[i + 1], index), True
            if max_reply is not None:
                length = min(length, max_reply)
            kept.append(Call(s, i, request, length, logged))
        out.append(Session(group[0].session, tuple(kept)))
    return out
