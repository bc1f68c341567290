"""What the cache manager hands the model runner: the typed interface between the two.

The cache manager decides which slots every row lives in; the model runner only moves rows. A
:class:`Reuse` is the device work of live hits (k_r rows rotated by δ into fresh slots), a
:class:`ForwardBatch` one forward over the pool. Both are plain host arrays, so a worker per GPU
can receive them as they are.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Reuse(NamedTuple):
    """k_r slots ``dst`` of every layer := slots ``src`` rotated by ``deltas`` (per row)."""

    src: np.ndarray
    dst: np.ndarray
    deltas: np.ndarray


class ForwardBatch(NamedTuple):
    """One ragged forward: items of new tokens, each attending to its sequence's rows.

    Item i's tokens sit at ``positions[i]`` (one or several contiguous spans) and may attend to
    ``keys[i]``, the handles of its sequence's rows up to its last position (the new tokens'
    included); ``new`` holds the handles the new tokens' rows are written to, in batch order.
    """

    tokens: np.ndarray  # int64 [T]: every item's tokens, back to back
    positions: list[np.ndarray]
    keys: list[np.ndarray]
    new: np.ndarray

    @property
    def lengths(self) -> list[int]:
        return [len(at) for at in self.positions]
