"""Workload characterisation (paper §3): where each prompt token could come from.

Every call's prompt tokens fall into exactly one class:

    exact_prefix  served by a radix cache holding every earlier prompt (unbounded)
    shifted       past the exact prefix, but inside a 64-token window seen before (anywhere, at any
                  position); split into *within*-session (the window first appeared in this session)
                  and *cross*-session (it first appeared in another)
    novel         the rest

Windows are found with sliding-window fingerprints (:func:`~irminsul.cache.cdc.window_fingerprints`).
Per-session fractions give the p50/p95 the paper reports; the shifted tokens are also counted by
the role of the message they sit in (where the shifted content comes from).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import repeat

import numpy as np

from ..cache.cdc import window_fingerprints
from ..cache.radix import PrefixMatch, RadixTree
from ..traffic.prompt import Prompt

WINDOW = 64
ROLES = ("system", "user", "assistant", "tool", "developer")  # a role's code: its index here


class Characterisation:
    """Streams prompts in log order; keeps the unbounded radix tree the other passes share."""

    def __init__(self) -> None:
        self.radix = RadixTree()
        # A match's node: the root (a node to lock; this tree is never locked, and the other
        # passes read a match's length alone).
        self._root = self.radix.match_prefix(np.zeros(0, dtype=np.int64)).node
        self._first_session: dict[int, int] = {}  # window fingerprint -> first session index
        self._sessions: dict[str, int] = {}
        # per session: [prompt, exact_prefix, within, cross] token counts
        self._per_session: dict[int, np.ndarray] = defaultdict(lambda: np.zeros(4, np.int64))
        # shifted tokens by the role of their message (a last slot: outside every message)
        self._by_role = np.zeros((2, len(ROLES) + 1), dtype=np.int64)  # within, cross

    def add(self, prompt: Prompt, roles: np.ndarray | None = None) -> PrefixMatch:
        """Classify one prompt's tokens, then remember it. Returns its exact-prefix match (its
        length and handles; its node is the tree's root).
        ``roles``: the role code (index in ROLES) of each message, for the shifted tokens' roles."""
        session = self._sessions.setdefault(prompt.session, len(self._sessions))
        tokens, n = prompt.tokens, prompt.size
        # One walk down the tree: inserting the prompt finds how much of it was there (the
        # exact prefix; LRU order does not matter in a tree that never evicts).
        length = self.radix.insert(tokens, np.zeros(n, dtype=np.int64))
        match = PrefixMatch(length, np.zeros(length, dtype=np.int64), self._root)  # zeros held
        first = max(0, match.length - WINDOW + 1)  # windows that reach past the prefix
        fps = window_fingerprints(tokens[first:], WINDOW)
        owner = self._first_session
        seen = np.fromiter(map(owner.get, fps.tolist(), repeat(-1)), dtype=np.int64,
                           count=fps.size)
        within = _covered(seen == session, n - first)[match.length - first:]
        cross = _covered((seen >= 0) & (seen != session), n - first)[match.length - first:]
        cross &= ~within
        # Windows first seen here: all of this session, so one update keeps "first" semantics.
        owner.update(zip(fps[seen < 0].tolist(), repeat(session)))
        self._per_session[session] += (n, match.length, int(within.sum()), int(cross.sum()))
        if roles is not None and (within.any() or cross.any()):
            # The message each shifted token sits in (before the first message: the last slot)
            message = np.searchsorted(prompt.message_starts, np.arange(match.length, n),
                                      side="right") - 1
            role = np.where(message >= 0, np.asarray(roles)[np.maximum(message, 0)], len(ROLES))
            for row, flags in enumerate((within, cross)):
                self._by_role[row] += np.bincount(role[flags], minlength=len(ROLES) + 1)
        return match

    def result(self) -> dict:
        """Fractions of all prompt tokens, and per-session p50/p95 of the shifted fractions."""
        counts = np.array(list(self._per_session.values()), dtype=np.int64).reshape(-1, 4)
        total = max(int(counts[:, 0].sum()), 1)
        prompt, prefix, within, cross = counts.sum(axis=0).tolist() if counts.size else [0] * 4
        per = counts[:, 1:] / np.maximum(counts[:, :1], 1)
        shifted = per[:, 1] + per[:, 2]

        def pct(values: np.ndarray) -> dict:
            if not values.size:
                return {"p50": 0.0, "p95": 0.0}
            return {"p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95))}

        names = list(self._sessions)
        by_role = {role: {"within": int(w), "cross": int(c)}
                   for role, w, c in zip([*ROLES, "other"], *self._by_role) if w or c}
        return {
            "sessions": int(counts.shape[0]),
            "exact_prefix": prefix / total,
            "shifted": (within + cross) / total,
            "shifted_within": within / total,
            "shifted_cross": cross / total,
            "novel": (prompt - prefix - within - cross) / total,
            "per_session": {"exact_prefix": pct(per[:, 0]), "shifted": pct(shifted),
                            "shifted_within": pct(per[:, 1]), "shifted_cross": pct(per[:, 2])},
            # shifted tokens by the role of their message ("other": outside every message)
            "shifted_by_role": by_role,
            # per session, in order of first appearance: prompt, exact-prefix, within, cross tokens
            "session_tokens": {"session": [names[i] for i in self._per_session],
                               "counts": counts.tolist()},
        }


def _covered(window_seen: np.ndarray, n: int) -> np.ndarray:
    """Tokens of [0, n) covered by at least one flagged window (window t covers [t, t + WINDOW))."""
    edges = np.zeros(n + 1, dtype=np.int32)
    starts = np.flatnonzero(window_seen)
    edges[starts] += 1  # distinct offsets: plain fancy indexing adds once each
    edges[starts + WINDOW] -= 1
    return np.cumsum(edges[:n]) > 0
