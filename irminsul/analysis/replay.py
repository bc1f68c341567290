"""Replay of the serve path (Algorithm 1) over a log, in order, under a cache-capacity budget.

Each strategy is a :class:`~irminsul.cache.planner.Planner` of its own (radix tree and registry,
each holding at most ``capacity`` tokens, LRU-evicted) fed every prompt in log order; a strategy
differs only in where the chunker restarts and whether S1 probes sub-windows on a miss:

    cdc        plain CDC of the tail, no resets
    s2         resets at S2 marker edges (where the log has markers)
    msg        resets at every chat-message start, and at S2 marker edges where present
    +s1        the same, with S1 sub-window probing on chunk misses

``msg+s1`` is what the engine does by default (message-aligned, markers honoured, S1 on).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..cache.planner import Planner
from ..config import ALGORITHM1, REPLAY_CAPACITY
from ..traffic.prompt import Prompt

STRATEGIES = ("cdc", "cdc+s1", "s2", "s2+s1", "msg", "msg+s1")
DEFAULT_STRATEGY = "msg+s1"


def resets_for(strategy: str, prompt: Prompt) -> np.ndarray:
    """The chunker restart offsets a strategy uses for a prompt."""
    base = strategy.split("+")[0]
    if base == "cdc":
        return np.zeros(0, dtype=np.int64)
    if base == "s2":
        return prompt.markers
    return prompt.resets


class Replay:
    """Streams prompts through one planner per strategy and counts served tokens."""

    def __init__(self, capacity: int | None = REPLAY_CAPACITY) -> None:
        self.capacity = capacity
        self._planners = {s: Planner(replace(ALGORITHM1, capacity=capacity, s1=s.endswith("+s1")))
                          for s in STRATEGIES}
        self._counts = {s: np.zeros(3, dtype=np.int64) for s in STRATEGIES}  # prefix, pic, carve
        self.prompt_tokens = 0
        self._next_handle = 0

    def add(self, prompt: Prompt) -> None:
        self.prompt_tokens += prompt.size
        # Distinct fake slot ids stand in for the KV slots an engine would allocate.
        handles = np.arange(self._next_handle, self._next_handle + prompt.size, dtype=np.int64)
        self._next_handle += prompt.size
        for strategy, planner in self._planners.items():
            plan = planner.plan(prompt.tokens, resets_for(strategy, prompt))
            self._counts[strategy] += (plan.prefix.length, plan.tokens_of("hit"),
                                       plan.tokens_of("carve_out"))
            planner.commit(plan, handles)

    def result(self) -> dict:
        denom = max(self.prompt_tokens, 1)
        out: dict = {"capacity": self.capacity}
        for strategy, (prefix, pic, carve) in self._counts.items():
            out[strategy] = {"exact_prefix": prefix / denom, "pic_unique": pic / denom,
                             "total": (prefix + pic) / denom, "carve_out": carve / denom}
        out["default"] = {"strategy": DEFAULT_STRATEGY, **out[DEFAULT_STRATEGY]}
        return out
