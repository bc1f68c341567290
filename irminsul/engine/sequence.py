"""A request's state in the engine: its tokens, the KV handles it holds, and its prefill.

A prompt is served in *stretches* (:class:`Stretch`): consecutive segments of its plan served one
way — the exact prefix (slots shared as they are), a reuse (live hits: c_KV slots shared, k_r
rotated by δ into slots of the request's own) or a computation (everything prefilled).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np

from ..cache.plan import Plan, Segment
from .kv_pool import unpack


@dataclass
class ServeStats:
    """Where a prompt's tokens came from."""

    prompt_tokens: int = 0
    prefix_tokens: int = 0  # served by the exact-prefix radix tree
    pic_tokens: int = 0  # served from the registry (live mode)
    would_be_pic_tokens: int = 0  # registry hits prefilled anyway (observer mode)
    prefilled_tokens: int = 0


@dataclass(eq=False)  # identity: two sequences with equal tokens are still two sequences
class Sequence:
    """A request's tokens and the pool handles of their KV rows (one reference each)."""

    tokens: np.ndarray  # int64: the prompt, then every token appended
    handles: np.ndarray
    namespace: int
    stats: ServeStats = field(default_factory=ServeStats)
    finished: bool = False
    # References the sequence holds that the pool has not counted yet: a prefill's cached
    # stretches are served without counting them, so that their forward is issued sooner, and
    # they are counted once it is (the plan's locks on the radix node and the registry entries
    # hold those slots meanwhile). Handles (both slots); c_KV slots alone.
    owed: list[np.ndarray] = field(default_factory=list)
    owed_ckv: list[np.ndarray] = field(default_factory=list)

    def append(self, tokens: np.ndarray) -> None:
        """Tokens whose rows were just computed (a decode step, a teacher-forced run)."""
        self.tokens = np.concatenate([self.tokens, np.asarray(tokens, dtype=np.int64)])

    def owed_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """The (c_KV, k_r) slots whose references this sequence is owed."""
        ckv, kr = (unpack(np.concatenate(self.owed)) if self.owed
                   else (np.zeros(0, np.int64),) * 2)
        return np.concatenate([ckv, *self.owed_ckv]), kr


class Stretch(NamedTuple):
    """Prompt tokens [start, end) served one way: "prefix" (the exact prefix), "reuse" (live
    hits, consecutive ones together: ``hits``) or "compute"."""

    kind: Literal["prefix", "reuse", "compute"]
    start: int
    end: int
    hits: list[Segment]


@dataclass
class Prefill:
    """A prompt being served: its plan and the stretches still to do."""

    seq: Sequence
    plan: Plan
    prompt: np.ndarray
    stretches: deque[Stretch]
    # Tokens of chunks this plan missed that prefills already in flight are computing and will
    # register: waiting for them would turn these into hits.
    awaited: int = 0

    def slots_to_come(self) -> tuple[int, int]:
        """(c_KV, k_r) slots the rest of this prefill allocates: a computed token one of each,
        a reused one a k_r slot alone, the exact prefix none."""
        served, ckv, kr = len(self.seq.handles), 0, 0
        for kind, start, end, _ in self.stretches:
            n = end - max(start, served)
            if n > 0 and kind != "prefix":
                kr += n
                ckv += n if kind == "compute" else 0
        return ckv, kr
