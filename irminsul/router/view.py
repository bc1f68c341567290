"""What the router knows of one backend's cache: its published index (the last poll's sets),
and the requests it sent there that the index may not show yet.

A request's content enters a backend's indexes when its prefill ends, and the router learns of
it at the next poll after that. An agent sends its next call as soon as a reply ends, often
before then, so what the router sends is counted as held right away (its prefix blocks, regions
and chunks) until a poll that began after the request ended: from then on the index says what
the backend kept (it may have evicted it, or failed the request).
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from .digest import BLOCK_TOKENS, Chunking, Digest, DigestError
from .keys import RequestKeys


@dataclass
class _Routed:
    prefix: tuple[int, ...]
    chunks: tuple[int, ...]
    done_at: float | None = None


@dataclass
class IndexView:
    """One backend's index as polled, plus what was routed to it since."""

    routed_limit: int = 4096
    generation: str | None = None
    version: int | None = None
    chunking: Chunking | None = None
    prefix: set[int] = field(default_factory=set)
    chunks: set[int] = field(default_factory=set)
    _routed: OrderedDict[int, _Routed] = field(default_factory=OrderedDict)
    _routed_prefix: Counter[int] = field(default_factory=Counter)
    _routed_chunks: Counter[int] = field(default_factory=Counter)
    _tickets: itertools.count = field(default_factory=itertools.count)

    def apply(self, digest: Digest, asked_at: float) -> None:
        """A poll's answer; ``asked_at`` is when the poll was sent (monotonic seconds)."""
        if digest.full:
            self.prefix, self.chunks = set(digest.prefix_added), set(digest.chunks_added)
        elif digest.generation != self.generation:
            raise DigestError(f"a difference against generation {digest.generation}, but this "
                              f"view holds {self.generation}")
        else:
            self.prefix -= digest.prefix_removed
            self.prefix |= digest.prefix_added
            self.chunks -= digest.chunks_removed
            self.chunks |= digest.chunks_added
        self.generation, self.version, self.chunking = (digest.generation, digest.version,
                                                        digest.chunking)
        self._confirmed(asked_at)

    def clear(self, asked_at: float) -> None:
        """A poll asked at ``asked_at`` found no published index (404): the backend is taken
        as holding nothing, as a backend without one is, whatever an earlier process there
        published; what was routed to it and ended before the poll is dropped, as by
        :meth:`apply`."""
        self.generation = self.version = self.chunking = None
        self.prefix, self.chunks = set(), set()
        self._confirmed(asked_at)

    def _confirmed(self, asked_at: float) -> None:
        """Drop what was routed here and ended before a poll asked at ``asked_at``: from then
        on the poll's answer says what the backend kept."""
        for ticket in [t for t, r in self._routed.items()
                       if r.done_at is not None and r.done_at <= asked_at]:
            self._drop(ticket)

    def route(self, keys: RequestKeys) -> int:
        """Count a request sent to this backend as held; returns its ticket for :meth:`done`."""
        chunks: list[int] = []
        content = keys.content.get(self.chunking) if self.chunking is not None else None
        if content is not None:
            for region in content.regions:
                chunks.append(region.whole.fingerprint)
                chunks.extend(c.fingerprint for c in region.chunks)
        routed = _Routed(keys.prefix, tuple(chunks))
        ticket = next(self._tickets)
        self._routed[ticket] = routed
        self._routed_prefix.update(routed.prefix)
        self._routed_chunks.update(routed.chunks)
        while len(self._routed) > self.routed_limit:
            self._drop(next(iter(self._routed)))
        return ticket

    def done(self, ticket: int, at: float, *, failed: bool = False) -> None:
        """The request ended at ``at``; a failed one never reached the backend's indexes."""
        routed = self._routed.get(ticket)
        if routed is not None:
            if failed:
                self._drop(ticket)
            else:
                routed.done_at = at

    def _drop(self, ticket: int) -> None:
        routed = self._routed.pop(ticket)
        self._routed_prefix.subtract(routed.prefix)
        self._routed_chunks.subtract(routed.chunks)
        for counter, keys in ((self._routed_prefix, routed.prefix),
                              (self._routed_chunks, routed.chunks)):
            for key in keys:
                if key in counter and counter[key] <= 0:
                    del counter[key]

    def has_prefix(self, block: int) -> bool:
        return block in self.prefix or block in self._routed_prefix

    def has_chunk(self, fingerprint: int) -> bool:
        return fingerprint in self.chunks or fingerprint in self._routed_chunks

    def prefix_tokens(self, keys: RequestKeys) -> int:
        """Tokens of the request's exact prefix held here, to a block: its leading block
        hashes found (each chains all before it)."""
        blocks = 0
        for block in keys.prefix:
            if not self.has_prefix(block):
                break
            blocks += 1
        return blocks * BLOCK_TOKENS

    def cached_tokens(self, keys: RequestKeys, *, content: bool = True) -> int:
        """Tokens this backend would serve from its cache, as its planner would find them:
        the exact prefix, then past it each region found whole, else each chunk found (past
        the carve-out; a chunk or region straddling the prefix's end serves its part past it).
        ``content=False``: the prefix alone. S1 windows and chunk heads are not published,
        so what they would add is not counted."""
        prefix = self.prefix_tokens(keys)
        cut = keys.content.get(self.chunking) if self.chunking is not None else None
        if not content or cut is None:
            return prefix
        carve_out, total = cut.chunking.carve_out, prefix
        for region in cut.regions:
            whole = region.whole
            if whole.end <= prefix:
                continue
            if cut.chunking.regions and whole.start >= carve_out \
                    and self.has_chunk(whole.fingerprint):
                total += whole.end - max(whole.start, prefix)
                continue
            for chunk in region.chunks:
                if chunk.end > prefix and chunk.start >= carve_out \
                        and self.has_chunk(chunk.fingerprint):
                    total += chunk.end - max(chunk.start, prefix)
        return total

    @property
    def routed(self) -> int:
        """Requests counted as held that the index has not confirmed yet."""
        return len(self._routed)
