"""Replay of the serve path over a log, in order, under a cache-capacity budget.

Each strategy is a :class:`~irminsul.cache.planner.Planner` (its registry holding at most
``capacity`` tokens, LRU-evicted) fed every prompt in log order:

    engine     the engine's own planner with the engine's default :class:`CacheConfig`
               (message-aligned, markers honoured, regions, head probe, S1 with extension):
               what ``irminsul serve`` would have served; ``default`` in the report
    cdc        the paper's Algorithm 1 over plain CDC of the tail, no resets
    s2         Algorithm 1, resets at S2 marker edges (where the log has markers)
    msg        Algorithm 1, resets at every chat-message start and at S2 marker edges
    +s1        the same, with S1 sub-window probing on chunk misses

``msg+s1`` is the paper's Algorithm 1 as the engine chunks (``algorithm1`` in the report).

All strategies share one exact-prefix radix tree: a radix tree's contents depend only on the
prompts inserted and on its own LRU order (it is evicted to its own capacity, never across
indexes here), which are the same for every strategy, so one tree gives each strategy exactly the
prefix its own would. Likewise, until a prompt with S2 markers arrives, ``s2`` resets nowhere and
is ``cdc`` exactly; its planners are copied from ``cdc``'s at the first marker.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np

from ..cache.planner import Planner
from ..cache.radix import RadixTree
from ..config import ALGORITHM1, REPLAY_CAPACITY, CacheConfig
from ..traffic.prompt import Prompt

STRATEGIES = ("engine", "cdc", "cdc+s1", "s2", "s2+s1", "msg", "msg+s1")
DEFAULT_STRATEGY = "engine"
ALGORITHM1_STRATEGY = "msg+s1"
TIMELINE_POINTS = 200  # at most this many points of the served share over the log


def config_for(strategy: str, capacity: int | None) -> CacheConfig:
    """The planner configuration a strategy replays with."""
    if strategy == "engine":
        return replace(CacheConfig(), capacity=capacity)
    return replace(ALGORITHM1, capacity=capacity, s1=strategy.endswith("+s1"))


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
        self._radix = RadixTree()
        self._planners = {s: Planner(config_for(s, capacity)) for s in STRATEGIES
                          if not s.startswith("s2")}
        self._counts = {s: np.zeros(3, dtype=np.int64) for s in STRATEGIES}  # prefix, pic, carve
        self.prompt_tokens = 0
        self._next_handle = 0
        # Per prompt of the default strategy: prompt, prefix and PIC tokens (the timeline)
        self._served: list[tuple[int, int, int]] = []

    def add(self, prompt: Prompt) -> None:
        self.prompt_tokens += prompt.size
        if prompt.markers.size and "s2" not in self._planners:
            for s in ("s2", "s2+s1"):  # s2 was cdc up to here, exactly (no marker, no reset)
                self._planners[s] = copy.deepcopy(self._planners[s.replace("s2", "cdc")])
        # Distinct fake slot ids stand in for the KV slots an engine would allocate.
        handles = np.arange(self._next_handle, self._next_handle + prompt.size, dtype=np.int64)
        self._next_handle += prompt.size
        prefix = self._radix.match_prefix(prompt.tokens)
        for strategy, planner in self._planners.items():
            plan = planner.plan_tail(prompt.tokens, prefix, resets_for(strategy, prompt))
            counts = (prefix.length, plan.tokens_of("hit"), plan.tokens_of("carve_out"))
            self._counts[strategy] += counts
            if strategy == DEFAULT_STRATEGY:
                self._served.append((prompt.size, counts[0], counts[1]))
            planner.register_misses(plan, handles)
            planner.registry.evict_to_capacity()
        if "s2" not in self._planners:
            for s in ("s2", "s2+s1"):
                self._counts[s] = self._counts[s.replace("s2", "cdc")].copy()
        self._radix.insert(prompt.tokens, handles)
        if self.capacity is not None and self._radix.total_tokens > self.capacity:
            self._radix.evict(self._radix.total_tokens - self.capacity)

    def timeline(self) -> dict:
        """The default strategy's served shares over the log, in at most TIMELINE_POINTS buckets
        of consecutive requests: warm-up, then steady state."""
        served = np.array(self._served, dtype=np.int64).reshape(-1, 3)
        edges = np.unique(np.linspace(0, len(served), TIMELINE_POINTS + 1).astype(int))
        sums = np.add.reduceat(served, edges[:-1], axis=0) if len(served) else served
        tokens = np.maximum(sums[:, 0], 1)
        return {"request_end": edges[1:].tolist(),
                "exact_prefix": (sums[:, 1] / tokens).tolist(),
                "pic_unique": (sums[:, 2] / tokens).tolist()}

    def result(self) -> dict:
        denom = max(self.prompt_tokens, 1)
        out: dict = {"capacity": self.capacity}
        for strategy, (prefix, pic, carve) in self._counts.items():
            out[strategy] = {"exact_prefix": prefix / denom, "pic_unique": pic / denom,
                             "total": (prefix + pic) / denom, "carve_out": carve / denom}
        out["default"] = {"strategy": DEFAULT_STRATEGY, **out[DEFAULT_STRATEGY]}
        out["algorithm1"] = {"strategy": ALGORITHM1_STRATEGY, **out[ALGORITHM1_STRATEGY]}
        out["timeline"] = self.timeline()
        return out
