"""Recoverability probe (paper §4 and Appendix B): how much of the non-prefix part is findable.

Offline and unannotated, as in the paper: no resets, no carve-out, no capacity limit. For every
prompt, the tokens past the exact prefix (from the shared unbounded radix tree) are cut by each
strategy and looked up among everything that strategy registered before:

    fixed_block   128-token blocks aligned to absolute multiples of 128 (what a block-hash cache
                  could find without its parent chaining: same content at the same offset mod 128)
    cdc           content-defined chunks (k = 7)
    cdc_fallback  cdc, plus S1's 128-token sub-windows on a chunk miss (the planner's own probe)
    mask_sweep    cdc for mask bits k = 5..16

Blocks and chunks are looked up by fingerprint alone (xxHash64; with ~10^8 distinct chunks a
collision has odds under 10^-3): an estimate of what is findable, where the engine's planner,
which serves KV, verifies every hit token by token. What a prompt registers is found only by later
prompts, as in the planner (registration happens at commit).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..cache.cdc import chunk_boundaries_sweep, fingerprints
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
        self._chunks = {k: set() for k in MASK_SWEEP}  # fingerprints of chunks cut with k bits
        self._fallback = Planner(replace(ALGORITHM1, carve_out=0, s1=True))
        self._recovered = dict.fromkeys(["fixed_block", "cdc_fallback", *MASK_SWEEP], 0)
        self.non_prefix_tokens = 0

    def add(self, prompt: Prompt, prefix: PrefixMatch) -> None:
        tokens, start = prompt.tokens, prefix.length
        self.non_prefix_tokens += prompt.size - start
        self._recovered["fixed_block"] += self._fixed_blocks(tokens, start)
        tail = tokens[start:]
        if tail.size:
            config = self._fallback.config
            sweep = chunk_boundaries_sweep(tail, MASK_SWEEP, min_size=config.min_chunk,
                                           max_size=config.max_chunk)
            for k, seen in self._chunks.items():
                ends = sweep[k].tolist()
                fps = fingerprints(tail, sweep[k]).tolist()
                self._recovered[k] += sum(end - begin for begin, end, fp
                                          in zip([0] + ends, ends, fps) if fp in seen)
                seen.update(fps)
        plan = self._fallback.plan_tail(tokens, prefix)
        self._recovered["cdc_fallback"] += plan.tokens_of("hit")
        self._fallback.register_misses(plan, np.zeros(prompt.size, dtype=np.int64))

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
            "cdc": frac[7],
            "cdc_fallback": frac["cdc_fallback"],
            "mask_sweep": {str(k): frac[k] for k in MASK_SWEEP},
        }
