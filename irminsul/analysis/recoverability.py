"""Recoverability probe (paper §4 and Appendix B): how much of the non-prefix part is findable.

Offline and unannotated, as in the paper: no resets, no carve-out, no capacity limit. For every
prompt, the tokens past the exact prefix (from the shared unbounded radix tree) are cut by each
strategy and looked up among everything that strategy registered before:

    fixed_block   128-token blocks aligned to absolute multiples of 128 (what a block-hash cache
                  could find without its parent chaining: same content at the same offset mod 128)
    cdc           content-defined chunks (k = 7)
    cdc_fallback  cdc, plus S1's 128-token sub-windows on a chunk miss
    mask_sweep    cdc for mask bits k = 5..16
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..cache.cdc import fingerprints
from ..cache.planner import Planner
from ..cache.radix import PrefixMatch
from ..config import ALGORITHM1
from ..traffic.prompt import Prompt

BLOCK = 128
MASK_SWEEP = range(5, 17)


class Recoverability:
    """Streams prompts with their exact-prefix match; counts recovered non-prefix tokens."""

    def __init__(self) -> None:
        self._blocks: set[int] = set()
        self._planners = {f"k{k}": Planner(replace(ALGORITHM1, mask_bits=k, carve_out=0, s1=False))
                          for k in MASK_SWEEP}
        self._planners["cdc_fallback"] = Planner(replace(ALGORITHM1, carve_out=0, s1=True))
        self._recovered = dict.fromkeys(["fixed_block", *self._planners], 0)
        self.non_prefix_tokens = 0

    def add(self, prompt: Prompt, prefix: PrefixMatch) -> None:
        tokens, start = prompt.tokens, prefix.length
        self.non_prefix_tokens += prompt.size - start
        self._recovered["fixed_block"] += self._fixed_blocks(tokens, start)
        handles = np.zeros(prompt.size, dtype=np.int64)  # offline: no KV behind the entries
        for name, planner in self._planners.items():
            plan = planner.plan_tail(tokens, prefix)
            self._recovered[name] += plan.tokens_of("hit")
            planner.register_misses(plan, handles)

    def _fixed_blocks(self, tokens: np.ndarray, start: int) -> int:
        first = start // BLOCK * BLOCK
        ends = np.arange(first + BLOCK, tokens.size + 1, BLOCK, dtype=np.int64)
        if not ends.size:
            return 0
        fps = fingerprints(tokens[first:ends[-1]], ends - first).tolist()
        recovered = 0
        for end, fp in zip(ends.tolist(), fps):
            if fp in self._blocks:
                recovered += min(BLOCK, end - start)
        self._blocks.update(fps)
        return recovered

    def result(self) -> dict:
        denom = max(self.non_prefix_tokens, 1)
        frac = {name: count / denom for name, count in self._recovered.items()}
        return {
            "non_prefix_tokens": self.non_prefix_tokens,
            "fixed_block": frac["fixed_block"],
            "cdc": frac["k7"],
            "cdc_fallback": frac["cdc_fallback"],
            "mask_sweep": {str(k): frac[f"k{k}"] for k in MASK_SWEEP},
        }
