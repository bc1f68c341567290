"""The serve path of the paper's Algorithm 1, over token ids: what to reuse and what to prefill.

``Planner.plan(tokens, resets)`` is read-only; it returns a :class:`Plan` whose segments cover the
prompt exactly once, in order:

    prefix     tokens [0, L) served by the exact-prefix radix tree (line 1)
    carve_out  a tail chunk starting below position 32: always prefilled, never registered (line 5);
               the attention sink lives at the sequence start
    hit        a chunk (or, with S1, an s1_window-token sub-window of a missed chunk, with
               s1_extend grown both ways as far as it repeats its source; with the head probe,
               the most leading tokens a missed chunk shares with a registered chunk; with
               regions, a whole region, run on as far as the run of regions it was registered in
               goes on the same)
               found in the registry and verified token by token; reused with
               delta = p_target - p_source (lines 7-10)
    miss       tokens to prefill (line 12)

``Planner.commit(plan, handles)`` runs after the engine has prefilled the misses: it registers every
missed chunk at its position (line 13), inserts the whole prompt into the radix tree and evicts both
indexes down to their capacities. Between the two the engine holds the plan's radix node and entries
with :meth:`Planner.acquire` / :meth:`Planner.release`. Observer and live modes are the engine's
business: the plan is the same.
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from collections.abc import Callable, Iterable

import numpy as np

from ..config import CacheConfig
from .cdc import (
    Fingerprinter,
    as_offsets,
    as_token_array,
    chunk_boundaries,
    fingerprints,
    window_fingerprints,
)
from .plan import Chunk, Commit, Plan, Segment, Tail
from .radix import PrefixMatch, RadixTree, common_prefix
from .registry import ChunkEntry, Registry

# Leading tokens a chunk head is indexed by: half the smallest chunk, since a prompt's last chunk
# (cut where the prompt ends) is often shorter than a chunk.
HEAD_TOKENS = 16


class Planner:
    """Exact-prefix radix tree + content registry, combined as in Algorithm 1."""

    def __init__(self, config: CacheConfig, *, pic: bool = True) -> None:
        """``config``: chunking, carve-out and probes (:class:`~irminsul.config.CacheConfig`;
        :data:`~irminsul.config.ALGORITHM1` is the paper's algorithm exactly). Beyond it:
        ``head_probe``, a missed chunk first reuses the most leading tokens it shares
        with a registered chunk (at least HEAD_TOKENS); ``regions``, each region of the tail is
        looked up whole before it is chunked, and registered whole at commit (a run of
        consecutive ones too, which a found region is run on along with one comparison), so
        content that moves region by region (a re-ranked document of many messages, a tool
        schema, a message) is a lookup and a hit, not one per chunk. The chunks are cut as
        without regions (the chunker restarts at every reset), so a region not found whole is
        served chunk by chunk as before. ``pic=False``: exact prefix only (the baseline); the
        tail is one miss."""
        clock = itertools.count(1)  # one LRU timeline for both indexes (see evict)
        self.config = config
        self.radix = RadixTree(clock)
        self.registry = Registry(config.capacity, window=config.s1_window,
                                 head=HEAD_TOKENS if config.head_probe else 0, clock=clock)
        self.pic = pic

    def plan(self, tokens: Iterable[int] | np.ndarray, resets: Iterable[int] | np.ndarray = (), *,
             namespace: int = 0) -> Plan:
        """Match the exact prefix, chunk the tail (restarting at ``resets``), look chunks up."""
        tokens = as_token_array(tokens)
        return self.plan_tail(tokens, self.radix.match_prefix(tokens, namespace), resets,
                              namespace=namespace)

    def plan_tail(self, tokens: np.ndarray, prefix: PrefixMatch,
                  resets: Iterable[int] | np.ndarray = (), *, namespace: int = 0) -> Plan:
        """Algorithm 1 after line 1: chunk and look up everything past a given exact prefix."""
        start = prefix.length
        plan = Plan(tokens, namespace, prefix, [Segment("prefix", 0, start)] if start else [], [])
        if not self.pic:
            if start < tokens.size:
                plan.segments.append(Segment("miss", start, tokens.size))
            return plan
        # Chunk from the last reset at or before the prefix end, not from the prefix end itself:
        # an exact prefix often runs a few tokens into the next message (a shared role token),
        # and chunking from there would misalign every chunk of that message. A chunk that
        # straddles the prefix end is looked up whole and serves only its part past the prefix.
        resets = as_offsets(resets)
        if resets.size and (resets[0] < 0 or resets[-1] > tokens.size):
            raise ValueError(f"reset offsets must lie in [0, {tokens.size}], "
                             f"got {int(resets[0])}..{int(resets[-1])}")
        earlier = resets[resets <= start]
        anchor = int(earlier[-1]) if earlier.size else start
        part = tokens[anchor:]
        tail = Tail(part, anchor, resets[resets > anchor] - anchor,
                    part.astype(np.int64, copy=False).tobytes())
        if self.config.regions:
            self._plan_regions(plan, tail)
        else:
            self._plan_chunks(plan, tail, 0, tail.tokens.size)
        plan.segments = _merge_misses(plan.segments)
        return plan

    def _plan_regions(self, plan: Plan, tail: Tail) -> None:
        """Look each region of the tail up whole, and run a region found on as far as the tail
        goes on as the run of regions it was registered in did; chunk the rest."""
        ends = np.append(tail.resets[tail.resets < tail.tokens.size], tail.tokens.size).tolist()
        fingerprint = Fingerprinter(tail.tokens, plan.namespace)
        start, lookup, content = plan.prefix.length, self.registry.lookup, tail.content
        anchor = tail.anchor
        first = pending = 0  # the region's first tail offset; the first not served whole
        i = 0
        while i < len(ends):
            end = ends[i]
            # A region within the prefix (the whole prompt matched) or the carve-out is not
            # looked up; the chunk path handles both.
            if anchor + end > start and anchor + first >= self.config.carve_out:
                fp = fingerprint(first, end)
                entry = lookup(plan.namespace, fp, content[8 * first:8 * end])
                if entry is None:
                    plan.regions.append(Chunk(anchor + first, anchor + end, fp, "miss"))
                else:
                    offset, run = 0, entry.run
                    if run is not None and run.registered:
                        # One comparison for the whole run (a document of many messages that
                        # moved), cut back to the last region end it covers.
                        n = min(run.size - entry.run_offset, tail.tokens.size - first)
                        same = common_prefix(tail.tokens[first:first + n],
                                              run.tokens[entry.run_offset:entry.run_offset + n])
                        i = bisect_right(ends, first + same, lo=i) - 1
                        plan.region_entries.append(entry)
                        entry, offset, end = run, entry.run_offset, ends[i]
                    self._plan_chunks(plan, tail, pending, first)
                    at = max(anchor + first, start)
                    plan.segments.append(Segment("hit", at, anchor + end, entry,
                                                 offset + at - anchor - first))
                    pending = end
            first = end
            i += 1
        self._plan_chunks(plan, tail, pending, tail.tokens.size)

    def _plan_chunks(self, plan: Plan, tail: Tail, low: int, high: int) -> None:
        """Algorithm 1 lines 2-12 over tail offsets [low, high): chunk, look up, probe misses."""
        if low >= high:
            return
        start, namespace, anchor = plan.prefix.length, plan.namespace, tail.anchor + low
        tokens, segments, chunks = plan.tokens, plan.segments, plan.chunks
        resets = tail.resets[(tail.resets > low) & (tail.resets < high)] - low
        config = self.config
        bounds = chunk_boundaries(tail.tokens[low:high], mask_bits=config.mask_bits,
                                  min_size=config.min_chunk, max_size=config.max_chunk,
                                  resets=resets)
        fps = fingerprints(tail.tokens[low:high], bounds, seed=namespace).tolist()
        lookup, carve_out, content = self.registry.lookup, self.config.carve_out, tail.content
        first, byte = anchor, 8 * low  # the chunk's first token; its first byte in content
        mark = len(segments)
        # Some 500 chunks at 32K tokens: plain locals and ints in this loop.
        for end, high_byte, fp in zip((bounds + anchor).tolist(), (8 * (bounds + low)).tolist(),
                                      fps):
            if end > start:
                at = first if first > start else start  # where the part past the prefix begins
                if first < carve_out:
                    chunks.append(Chunk(first, end, fp, "carve_out"))
                    segments.append(Segment("carve_out", at, end))
                elif (entry := lookup(namespace, fp, content[byte:high_byte])) is not None:
                    chunks.append(Chunk(first, end, fp, "hit"))
                    segments.append(Segment("hit", at, end, entry, at - first))
                else:
                    chunks.append(Chunk(first, end, fp, "miss"))
                    segments.extend(self._probe_miss(tokens, first, at, end, namespace))
            first, byte = end, high_byte
        if config.s1_extend:
            segments[mark:] = self._probe_gaps(tokens, segments[mark:], namespace)

    def _probe_miss(self, tokens: np.ndarray, first: int, start: int, end: int,
                    namespace: int) -> list[Segment]:
        """A missed chunk [first, end), served from ``start``: the most leading tokens it
        shares with a registered chunk (with the head probe), then S1 windows over the rest
        (with ``s1_extend``, the rest stays a miss here: :meth:`_probe_gaps` probes it)."""
        hit = self.registry.lookup_head(namespace, tokens[first:end])
        if hit is None or first + hit.size <= start:
            return self._probe_rest(tokens, start, end, namespace)
        stop = first + hit.size
        head = Segment("hit", start, stop, hit.entry, start - first)
        return [head] + (self._probe_rest(tokens, stop, end, namespace) if stop < end else [])

    def _probe_rest(self, tokens: np.ndarray, start: int, end: int,
                    namespace: int) -> list[Segment]:
        """What a missed chunk's head did not serve: S1 windows now, or with ``s1_extend`` a
        miss that :meth:`_probe_gaps` probes together with its neighbours."""
        if self.config.s1_extend:
            return [Segment("miss", start, end)]
        return self._probe_windows(tokens, start, end, namespace)

    def _probe_gaps(self, tokens: np.ndarray, segments: list[Segment],
                    namespace: int) -> list[Segment]:
        """S1 with extension over consecutive missed chunks: adjacent misses are probed as one
        gap, so a repeated stretch that a chunk boundary cuts in two is still found whole."""
        out: list[Segment] = []
        for seg in _merge_misses(segments):
            if seg.kind == "miss":
                out.extend(self._probe_windows(tokens, seg.start, seg.end, namespace))
            else:
                out.append(seg)
        return out

    def _probe_windows(self, tokens: np.ndarray, start: int, end: int,
                       namespace: int) -> list[Segment]:
        """S1: a missed range's registered sub-windows, at any offset, left to right; with
        ``s1_extend`` each hit grows token by token both ways, as far as the range and the
        entry it was found in repeat each other."""
        width, extend = self.config.s1_window, self.config.s1_extend
        table = self.registry.window_table(namespace)
        if not self.config.s1 or end - start < width or not table:
            return [Segment("miss", start, end)]
        fps = window_fingerprints(tokens[start:end], width, seed=namespace).tolist()
        # The offsets whose window is registered: one membership test per offset, iterated in C
        candidates = np.flatnonzero(np.fromiter(map(table.__contains__, fps), dtype=bool,
                                                count=len(fps)))
        if not candidates.size:
            return [Segment("miss", start, end)]
        out: list[Segment] = []
        pos = start
        for offset in candidates.tolist():
            at = start + offset
            if at < pos:
                continue  # overlaps the window just taken
            hit = self.registry.lookup_window(namespace, fps[offset], tokens[at:at + width])
            if hit is None:
                continue
            offset, stop = hit.offset, at + width
            if extend:
                source = hit.entry.tokens
                back = _common_suffix(tokens[max(pos, at - offset):at], source[:offset])
                at, offset = at - back, offset - back
                stop += _common_head(tokens[stop:end], source[offset + stop - at:])
            if at > pos:
                out.append(Segment("miss", pos, at))
            out.append(Segment("hit", at, stop, hit.entry, offset))
            pos = stop
        if pos < end:
            out.append(Segment("miss", pos, end))
        return out

    def acquire(self, plan: Plan) -> None:
        """Hold what the plan reuses so eviction cannot take it before commit/release; all of
        it or, where something was evicted since the plan was made (ValueError), none."""
        entries = plan.reused()
        stale = [e for e in entries if not e.registered]
        if stale:
            raise ValueError(f"{len(stale)} chunk(s) the plan reuses were evicted after it was "
                             f"made (first {stale[0].fingerprint:#x}): plan it again")
        self.radix.lock(plan.prefix.node)  # raises, holding nothing, on an evicted node
        for entry in entries:
            self.registry.lock(entry)

    def release(self, plan: Plan) -> None:
        """Undo :meth:`acquire`."""
        self.radix.unlock(plan.prefix.node)
        for entry in plan.reused():
            self.registry.unlock(entry)

    def register_misses(self, plan: Plan, handles: np.ndarray) -> list[np.ndarray]:
        """Algorithm 1 line 13: register each missed chunk at its position (with regions, each
        region not found whole too, and each run of them); refresh reused entries.

        Returns the handle arrays of the entries this created (content already registered is
        not registered twice), which the registry now references.
        """
        for entry in plan.reused():
            self.registry.touch(entry)
        held = []

        def register(chunk: Chunk, probes: bool) -> ChunkEntry:
            before = self.registry.num_entries
            entry = self.registry.register(plan.namespace, chunk.fingerprint,
                                           plan.tokens[chunk.start:chunk.end],
                                           handles[chunk.start:chunk.end], chunk.start,
                                           probes=probes)
            if self.registry.num_entries > before:
                held.append(entry.handles)
            return entry

        # A chunk's windows and head are indexed only for the probes that look them up.
        missed = [(c.start, c.end, c.fingerprint) for c in plan.chunks if c.kind == "miss"]
        if self.config.s1 or self.config.head_probe:
            for entry, new in self.registry.register_chunks(plan.namespace, plan.tokens,
                                                            handles, missed):
                if new:
                    held.append(entry.handles)
        else:
            for start, end, fingerprint in missed:
                register(Chunk(start, end, fingerprint, "miss"), False)
        # A region's entry takes its handles from this prompt, whatever served them: its rows
        # are this prompt's, at these positions (chunks found elsewhere were rotated here). Each
        # run of consecutive regions is registered whole too, and its regions point into it, so
        # a later prompt holding the run (or a part of it from a region start on) finds its
        # first region and reuses the rest with one comparison, as one hit.
        run: list[tuple[Chunk, ChunkEntry]] = []
        for region in plan.regions:
            if run and run[-1][0].end != region.start:
                self._register_run(plan, run, register)
                run = []
            run.append((region, register(region, False)))
        self._register_run(plan, run, register)
        return held

    def _register_run(self, plan: Plan, run: list[tuple[Chunk, ChunkEntry]],
                      register: Callable[[Chunk, bool], ChunkEntry]) -> None:
        """Register a run of two or more consecutive regions whole; point its regions into it."""
        if len(run) < 2:
            return
        first, end = run[0][0].start, run[-1][0].end
        fingerprint = Fingerprinter(plan.tokens[first:end], plan.namespace)(0, end - first)
        whole = register(Chunk(first, end, fingerprint, "miss"), False)
        for region, entry in run:
            self.registry.join_run(entry, whole, region.start - first)

    def heal_plan(self, tokens: np.ndarray, namespace: int = 0) -> Plan | None:
        """A plan that recomputes what the radix tree stores of ``tokens`` past its exact rows
        (rows served by reuse, and those computed over them), over the exact prefix before them:
        segments [prefix, miss], no chunks, nothing registered by it. None where the stored
        prefix is exact throughout (or nothing is stored). Hold it with :meth:`acquire`: its
        prefix node is the deepest of the stored path, so the whole path stays."""
        tokens = as_token_array(tokens)
        match = self.radix.match_prefix(tokens, namespace)
        if match.exact >= match.length:
            return None
        exact = match.exact
        prefix = PrefixMatch(exact, match.handles[:exact], match.node, exact)
        segments = [Segment("prefix", 0, exact)] if exact else []
        return Plan(tokens[:match.length].copy(), namespace, prefix,
                    segments + [Segment("miss", exact, match.length)], [])

    def healed(self, plan: Plan, handles: np.ndarray,
               sources: Iterable[tuple[ChunkEntry, int]] = ()) -> Commit:
        """A :meth:`heal_plan`'s rows are computed (``handles``: one per plan token): every
        reference either index holds to a row it replaced — the radix path's, and any registry
        entry's (chunks and regions registered from that prompt, or from prompts that matched
        it) — now names the recomputed row, and the path is exact. ``sources``: (entry,
        position) of the entries the healed prompt reused whole; each still registered is moved
        to the path's rows at that position (:meth:`Registry.move`), so the
        next prompt reuses it from the latest context rather than the one it was first
        registered in (served right after the turn before it, rerank's KL is 43% of what a
        session in order gives: benchmarks/cpu/kl_anatomy.py)."""
        handles = np.asarray(handles, dtype=np.int64)
        if handles.shape != plan.tokens.shape:
            raise ValueError(f"need one handle per plan token: {handles.shape} vs "
                             f"{plan.tokens.shape}")
        start = plan.prefix.length
        old = self.radix.heal(plan.tokens, handles, start, plan.namespace)
        new = handles[start:]
        held, freed = self.registry.replace_handles(old, new)
        content = plan.tokens.astype(np.int64, copy=False)
        for entry, at in sources:
            end = at + entry.size
            # Anywhere on the healed path: its rows before ``start`` were exact already.
            if (entry.registered and entry.namespace == plan.namespace and end <= content.size
                    and content[at:end].tobytes() == entry.content):
                held.append(handles[at:end])
                freed.append(self.registry.move(entry, handles[at:end], at))
        return Commit([new, *held], [old, *freed])

    def commit(self, plan: Plan, handles: np.ndarray, exact: int | None = None,
               apply: Callable[[Commit], None] | None = None) -> Commit:
        """Register the missed chunks, insert the prompt in the radix tree, evict to capacity.

        ``handles`` holds one handle per prompt token (what the engine now stores for each);
        ``exact``: how many leading tokens have exact rows (default all; see :meth:`remember`).
        The result says which handles the indexes took a reference to and which they dropped,
        so an engine can keep its slot reference counts exact. ``apply``: given, each step's
        part of it is handed over as soon as that index holds it (and the result is empty):
        were the radix insert to raise after the chunks were registered, the registry's new
        references would otherwise go uncounted, and the slots they name be given back and
        computed over while the entries still serve them.
        """
        handles = np.asarray(handles, dtype=np.int64)
        if handles.shape != plan.tokens.shape:
            raise ValueError(f"need one handle per prompt token: {handles.shape} vs "
                             f"{plan.tokens.shape}")
        held = self.register_misses(plan, handles)
        if apply is not None:
            apply(Commit(held, []))
            held = []
        done = self.remember(plan.tokens, handles, plan.namespace, exact)
        if apply is not None:
            apply(done)
            return Commit([], [])
        return Commit(held + done.held, done.freed)

    def remember(self, tokens: np.ndarray, handles: np.ndarray, namespace: int = 0,
                 exact: int | None = None) -> Commit:
        """Insert a sequence into the radix tree (a finished request's prompt and output) and
        evict both indexes down to capacity. ``exact``: how many leading tokens have exact rows
        (default all): from the first position reused position-independently on, a sequence's
        rows are not a full prefill's, and a later prompt that matches them is told so
        (:attr:`~.radix.PrefixMatch.exact`)."""
        present = self.radix.insert(tokens, handles, namespace, exact)
        freed = self.registry.evict_to_capacity()
        capacity = self.config.capacity
        if capacity is not None and self.radix.total_tokens > capacity:
            freed += self.radix.evict(self.radix.total_tokens - capacity)
        return Commit([np.asarray(handles, dtype=np.int64)[present:]], freed)

    def references(self) -> list[np.ndarray]:
        """Every handle array the indexes hold: radix nodes', then registry entries'."""
        return list(self.radix.values()) + [entry.handles for entry in self.registry.entries()]

    def evict(self, num_tokens: int) -> list[np.ndarray]:
        """Free at least ``num_tokens`` index tokens if possible, least recently used first
        across both indexes (never anything held); returns the dropped handles.

        One timeline matters under pool pressure: a stale radix branch (a prompt whose exact
        order will not recur, e.g. re-ranked documents) must go before the chunks every request
        reuses, and a cold chunk before a hot prefix."""
        freed: list[np.ndarray] = []
        dropped = 0
        while dropped < num_tokens:
            radix, registry = self.radix.oldest(), self.registry.oldest()
            if radix is None and registry is None:
                break
            index = self.radix if registry is None or (radix is not None and radix < registry) \
                else self.registry
            step = index.evict(1)  # one leaf or one entry
            if not step:
                break  # cannot happen while oldest() names an evictable item; never spin
            freed += step
            dropped += sum(len(h) for h in step)
        return freed


def _common_head(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two token arrays of any lengths share."""
    n = min(a.size, b.size)
    return common_prefix(a[:n], b[:n]) if n else 0


def _common_suffix(a: np.ndarray, b: np.ndarray) -> int:
    """How many trailing tokens two token arrays of any lengths share."""
    n = min(a.size, b.size)
    return common_prefix(a[a.size - n:][::-1], b[b.size - n:][::-1]) if n else 0


def _merge_misses(segments: list[Segment]) -> list[Segment]:
    """Fuse adjacent miss segments (one prefill span each)."""
    out: list[Segment] = []
    for seg in segments:
        if out and seg.kind == "miss" and out[-1].kind == "miss" and out[-1].end == seg.start:
            out[-1] = Segment("miss", out[-1].start, seg.end)
        else:
            out.append(seg)
    return out
