"""What the planner decides for a prompt: its segments, the chunks it cut, and what a commit
changed in the indexes (:mod:`.planner` makes them; the engine's cache manager serves them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np

from .radix import PrefixMatch
from .registry import ChunkEntry

SegmentKind = Literal["prefix", "carve_out", "hit", "miss"]


class Segment(NamedTuple):
    """Tokens [start, end) of the prompt and how they are served. (Named tuples: a 32K-token
    prompt has some 500 chunks, and a frozen dataclass costs four times as much to create.)"""

    kind: SegmentKind
    start: int
    end: int
    entry: ChunkEntry | None = None  # for hits: the registered chunk
    offset: int = 0  # for hits: where in entry.tokens the reused span begins

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def delta(self) -> int:
        """Rotation for a hit: p_target - p_source of the reused tokens."""
        assert self.entry is not None, "delta is defined for hits only"
        return self.start - (self.entry.p_source + self.offset)


class Chunk(NamedTuple):
    """A content-defined chunk of the tail and its fingerprint."""

    start: int
    end: int
    fingerprint: int
    kind: Literal["carve_out", "hit", "miss"]


class Tail(NamedTuple):
    """What the planner chunks: the prompt from the last reset at or before the exact prefix's
    end (the anchor) on."""

    tokens: np.ndarray
    anchor: int
    resets: np.ndarray  # reset offsets past the anchor, relative to it
    content: bytes  # the tokens as int64 bytes, sliced for each lookup


@dataclass
class Plan:
    """Algorithm 1's decision for one prompt."""

    tokens: np.ndarray
    namespace: int
    prefix: PrefixMatch
    segments: list[Segment]
    chunks: list[Chunk]  # the chunks of the tail that was chunked
    regions: list[Chunk] = field(default_factory=list)  # with regions: those not found whole
    # The region entries through which hits on runs were found: held and refreshed with the
    # hits, so that the runs stay findable.
    region_entries: list[ChunkEntry] = field(default_factory=list)

    def tokens_of(self, kind: SegmentKind) -> int:
        return sum(s.size for s in self.segments if s.kind == kind)

    @property
    def hits(self) -> list[Segment]:
        return [s for s in self.segments if s.kind == "hit"]

    def reused(self) -> list[ChunkEntry]:
        """The registry entries the plan reuses or found its hits through."""
        return [s.entry for s in self.segments if s.kind == "hit"] + self.region_entries


@dataclass
class Commit:
    """What a commit changed in the indexes' references to handles."""

    held: list[np.ndarray]  # handles the radix tree or registry now references (new entries)
    freed: list[np.ndarray]  # handles evicted from either index
