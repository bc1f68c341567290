"""A request's state in the engine: its tokens, the KV handles it holds, and its prefill.

A prompt is served in *stretches* (:class:`Stretch`): consecutive segments of its plan served one
way — the exact prefix (slots shared as they are), a reuse (live hits: c_KV slots shared, k_r
rotated by δ into slots of the request's own) or a computation (everything prefilled).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from ..cache.plan import Plan, Segment
from ..cache.registry import ChunkEntry
from .kv_pool import unpack


@dataclass
class ServeStats:
    """Where a prompt's tokens came from."""

    prompt_tokens: int = 0
    prefix_tokens: int = 0  # served by the exact-prefix radix tree, rows exact
    # Served by the radix tree too, but from an earlier sequence's rows that derive from
    # position-independent reuse (its reused rows, or rows computed after them): cached, not
    # exact, and never counted as an exact prefix hit (live mode)
    derived_prefix_tokens: int = 0
    pic_tokens: int = 0  # served from the registry (live mode)
    would_be_pic_tokens: int = 0  # registry hits prefilled anyway, less the last token (observer)
    prefilled_tokens: int = 0


class Growable:
    """An int64 array that grows at its end in amortised O(1) per element: a decode step
    appends one token and one handle to sequences thousands long, which a concatenation would
    copy whole every step. :meth:`view` is the array so far; views taken earlier keep their
    length (nothing before the end is ever overwritten)."""

    __slots__ = ("_data", "size")

    def __init__(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.int64)
        self._data = np.empty(max(16, 2 * values.size), dtype=np.int64)
        self._data[:values.size] = values
        self.size = int(values.size)

    def view(self) -> np.ndarray:
        return self._data[:self.size]

    def extended(self, values: np.ndarray) -> np.ndarray:
        """The array with ``values`` after it, written past the end but not kept (until
        :meth:`extend`): a batch's keys before its forward is known to run."""
        end = self.size + len(values)
        if end > self._data.size:
            grown = np.empty(2 * end, dtype=np.int64)
            grown[:self.size] = self._data[:self.size]
            self._data = grown
        self._data[self.size:end] = values
        return self._data[:end]

    def extend(self, values: np.ndarray) -> None:
        self.extended(values)
        self.size += len(values)


class Sequence:
    """A request's tokens and the pool handles of their KV rows (one reference each); two
    sequences with equal tokens are still two sequences (identity, not equality).

    ``tokens`` and ``handles`` read as arrays (the tokens and handles so far); appending to
    either is amortised O(1) per element (:meth:`append`, :meth:`extend_handles`)."""

    def __init__(self, tokens: np.ndarray, handles: np.ndarray, namespace: int,
                 stats: ServeStats | None = None, finished: bool = False,
                 exact: int | None = None) -> None:
        self._tokens, self._handles = Growable(tokens), Growable(handles)
        self.namespace, self.finished = namespace, finished
        self.stats = stats if stats is not None else ServeStats()
        # The first position whose row is not a full prefill's (None: none so far): where the
        # sequence was first served reused rows, from the registry or derived from a radix
        # match. Every row from there on, computed or decoded, attended to such rows.
        self.exact = exact
        # References the sequence holds that the pool has not counted yet: a prefill's cached
        # stretches are served without counting them, so that their forward is issued sooner,
        # and they are counted once it is (the plan's locks on the radix node and the registry
        # entries hold those slots meanwhile). Handles (both slots); c_KV slots alone.
        self.owed: list[np.ndarray] = []
        self.owed_ckv: list[np.ndarray] = []
        # With heal on: (entry, position) of each registry entry its prompt reused whole.
        self.sources: list[tuple[ChunkEntry, int]] = []

    @property
    def tokens(self) -> np.ndarray:
        """int64: the prompt, then every token appended."""
        return self._tokens.view()

    @property
    def handles(self) -> np.ndarray:
        """The pool handles of the rows computed or served so far, in position order."""
        return self._handles.view()

    @handles.setter
    def handles(self, value: np.ndarray) -> None:
        self._handles = Growable(value)

    def append(self, tokens: np.ndarray) -> None:
        """Tokens whose rows were just computed (a decode step, a teacher-forced run)."""
        self._tokens.extend(np.asarray(tokens, dtype=np.int64))

    def extend_handles(self, handles: np.ndarray) -> None:
        """Handles of rows appended at the end (their tokens' slots)."""
        self._handles.extend(handles)

    def handles_with(self, handles: np.ndarray) -> np.ndarray:
        """The handles so far followed by ``handles``, without keeping them yet."""
        return self._handles.extended(handles)

    def owed_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """The (c_KV, k_r) slots whose references this sequence is owed."""
        ckv, kr = (unpack(np.concatenate(self.owed)) if self.owed
                   else (np.zeros(0, np.int64),) * 2)
        return np.concatenate([ckv, *self.owed_ckv]), kr


class Stretch(NamedTuple):
    """Prompt tokens [start, end) served one way: "prefix" (the exact prefix), "derived" (the
    radix tree's match past its exact rows: an earlier sequence's reused rows and those computed
    over them), "reuse" (live hits, consecutive ones together: ``hits``) or "compute"."""

    kind: Literal["prefix", "derived", "reuse", "compute"]
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
    landed: bool = False  # no longer in flight (completed, aborted or dropped)
    released: bool = False  # its plan's holds given back (or being given back)

    def slots_to_come(self) -> tuple[int, int]:
        """(c_KV, k_r) slots the rest of this prefill allocates: a computed token one of each,
        a reused one a k_r slot alone, the radix match none (exact or derived: its rows are
        the tree's, at their positions)."""
        served, ckv, kr = len(self.seq.handles), 0, 0
        for kind, start, end, _ in self.stretches:
            n = end - max(start, served)
            if n > 0 and kind not in ("prefix", "derived"):
                kr += n
                ckv += n if kind == "compute" else 0
        return ckv, kr
