"""The router's choice among backends (pure functions: the numbers in, the backend out).

For a request of n prompt tokens each backend that is up gets

    score = cached / n  -  queue_weight * queue  -  kv_weight * kv_usage

``cached``: the prompt tokens its cache would serve (the exact prefix, then regions and chunks:
:meth:`IndexView.cached_tokens`; the prefix alone under the ``prefix`` policy); ``queue``: its
requests in flight (the most of what this router has sent it and not seen end, and what it
reported running and waiting); ``kv_usage``: the share of its KV pool in use. The highest score
wins. Scores within ``tie_margin`` of the best tie; among tied backends the session's last one
wins, else the one ranked first by rendezvous hashing of the session (or, without a session, of
the prompt) with the backend's URL: the same session or prompt goes to the same backend while
scores tie, and different ones spread evenly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from ..config import RouterConfig


@dataclass(frozen=True)
class Candidate:
    """A backend as the score sees it."""

    url: str
    cached: int  # prompt tokens its cache would serve
    queue: int  # requests in flight there
    kv_usage: float  # share of its KV pool in use, 0..1


def score(candidate: Candidate, prompt_tokens: int, config: RouterConfig) -> float:
    """The documented score (module docstring); a prompt of no tokens gains nothing from a
    cache."""
    hit = candidate.cached / prompt_tokens if prompt_tokens > 0 else 0.0
    return hit - config.queue_weight * candidate.queue - config.kv_weight * candidate.kv_usage


def rendezvous(url: str, key: int) -> int:
    """The rank of ``url`` for ``key`` in rendezvous (highest-random-weight) hashing."""
    return xxhash.xxh64_intdigest(url.encode("utf-8"), key & ((1 << 64) - 1))


def choose(candidates: Sequence[Candidate], prompt_tokens: int, config: RouterConfig, *,
           session_backend: str | None, tie_key: int) -> tuple[Candidate, str]:
    """The backend to send a request to and why: ``score`` (the best score alone),
    ``session`` (a tie the session's last backend won) or ``hash`` (a tie rendezvous hashing
    broke). ValueError if there is no candidate."""
    if not candidates:
        raise ValueError("no backend to choose from")
    scores = [score(c, prompt_tokens, config) for c in candidates]
    best = max(scores)
    tied = [c for c, s in zip(candidates, scores) if s >= best - config.tie_margin]
    if len(tied) == 1:
        return tied[0], "score"
    for c in tied:
        if c.url == session_backend:
            return c, "session"
    return max(tied, key=lambda c: rendezvous(c.url, tie_key)), "hash"
