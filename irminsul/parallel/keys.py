"""The followers' copy of the key handles: a forward's message carries only what changed.

A :class:`~irminsul.engine.batch.ForwardBatch` names, for each item, the pool handles of every row
its tokens attend to: a decode step of 64 requests at 16K tokens is 64 × 16,384 × 8 bytes = 8 MiB
of handles, pickled and sent to every follower every step, although each request's handles grew
by one. :class:`KeyMirror` keeps, on the leader and on every follower alike, the key arrays sent
so far under ids the leader assigns. The leader encodes an item's keys as (id, suffix): the
mirrored array they extend and the handles after it — one handle for a decode step — or, when no
mirrored array is a prefix of them, a new id and the whole array. The follower applies the same
updates in the same order, so its arrays are the leader's, bit for bit.

Which mirrored array an item extends is looked up by the handle just before its new tokens (a
decode step's keys are the previous step's plus one), then checked element by element: a handle
freed and reused elsewhere, a fork, a sequence whose handles were replaced, all fall back to a
whole array. Arrays unused for ``stale`` forwards are dropped on both sides (the message names
them): a request waiting that long is sent whole again.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..engine.batch import ForwardBatch
from ..engine.sequence import Growable

STALE_FORWARDS = 64  # forwards an array may go unused before both sides drop it


class MirroredBatch(NamedTuple):
    """A :class:`ForwardBatch` as sent to the followers: each item's keys as (mirror id, the
    handles after that array), and the ids dropped after this forward."""

    tokens: np.ndarray
    positions: list[np.ndarray]
    keys: list[tuple[int, np.ndarray]]
    new: np.ndarray
    drops: list[int]


class KeyMirror:
    """Key arrays by id, the same on the leader (:meth:`encode`) and every follower
    (:meth:`decode`); one per engine."""

    def __init__(self, stale: int = STALE_FORWARDS) -> None:
        self.stale = stale
        self.arrays: dict[int, Growable] = {}
        self._used: dict[int, int] = {}  # id → the forward that last used it
        self._by_last: dict[int, int] = {}  # leader: an array's last handle → its id
        self._forwards = 0
        self._next = 0

    def encode(self, batch: ForwardBatch) -> MirroredBatch:
        """(Leader.) The message for ``batch``; the mirror now holds every item's keys."""
        codes = []
        for keys, at in zip(batch.keys, batch.positions):
            keys = np.asarray(keys, dtype=np.int64)
            found = self._extends(keys, len(at))
            if found is None:
                found, suffix = self._next, keys
                self._next += 1
                self.arrays[found] = Growable(keys)
            else:
                suffix = keys[self.arrays[found].size:]
                last = int(self.arrays[found].view()[-1])
                if self._by_last.get(last) == found:
                    del self._by_last[last]
                self.arrays[found].extend(suffix)
            if len(keys):
                self._by_last[int(keys[-1])] = found
            self._used[found] = self._forwards
            codes.append((found, suffix))
        drops = self._drop()
        return MirroredBatch(batch.tokens, batch.positions, codes, batch.new, drops)

    def decode(self, message: MirroredBatch) -> ForwardBatch:
        """(Follower.) The batch the leader encoded; the mirror now holds what the leader's
        does."""
        keys = []
        for found, suffix in message.keys:
            if found in self.arrays:
                self.arrays[found].extend(suffix)
            else:
                self.arrays[found] = Growable(suffix)
            self._used[found] = self._forwards
            keys.append(self.arrays[found].view())
        drops = self._drop()
        if drops != message.drops:
            raise RuntimeError(f"the key mirror is out of step with the leader's: it drops "
                               f"{drops}, the leader {message.drops}")
        return ForwardBatch(message.tokens, message.positions, keys, message.new)

    def _extends(self, keys: np.ndarray, new_tokens: int) -> int | None:
        """The id of a mirrored array that ``keys`` extends (checked element by element)."""
        before = len(keys) - new_tokens - 1  # the handle just before the item's new tokens
        if before < 0:
            return None
        found = self._by_last.get(int(keys[before]))
        if found is None:
            return None
        base = self.arrays[found].view()
        return found if len(base) <= len(keys) and np.array_equal(base, keys[:len(base)]) else None

    def _drop(self) -> list[int]:
        """Drop the arrays unused for ``stale`` forwards (the same ones on every rank)."""
        self._forwards += 1
        drops = sorted(i for i, last in self._used.items() if self._forwards - last > self.stale)
        for found in drops:
            del self._used[found]
            array = self.arrays.pop(found)
            if array.size and self._by_last.get(int(array.view()[-1])) == found:
                del self._by_last[int(array.view()[-1])]
        return drops
