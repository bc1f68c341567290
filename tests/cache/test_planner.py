"""Tests for irminsul.cache.planner: Algorithm 1's plan over random agentic-looking prompt streams.

Prompts are built from a small pool of random token "documents" concatenated in random orders behind
short unique headers, so the same content reappears at shifted positions. Every plan is checked
against naive facts computed here: coverage of the prompt, the longest common prefix with earlier
prompts, and, through handles that encode (prompt, position), that every reused span points at the
very tokens it claims to reuse.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from irminsul.cache.cdc import chunk_boundaries
from irminsul.cache.plan import Plan
from irminsul.cache.planner import HEAD_TOKENS, Planner
from irminsul.config import ALGORITHM1

CARVE_OUT = 32
HANDLE_STRIDE = 1 << 20  # prompt k gets handles k * STRIDE + position


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


class History:
    """Committed prompts and their handles; decodes a handle back to (prompt, position)."""

    def __init__(self) -> None:
        self.prompts: list[tuple[int, np.ndarray]] = []  # (namespace, tokens)

    def handles_for(self, tokens: np.ndarray) -> np.ndarray:
        base = (len(self.prompts) + 1) * HANDLE_STRIDE
        return np.arange(base, base + tokens.size, dtype=np.int64)

    def add(self, namespace: int, tokens: np.ndarray) -> None:
        self.prompts.append((namespace, tokens))

    def source(self, handle: int) -> tuple[int, np.ndarray, int]:
        k, pos = divmod(int(handle), HANDLE_STRIDE)
        ns, toks = self.prompts[k - 1]
        return ns, toks, pos


def check_plan(plan: Plan, tokens: np.ndarray, namespace: int, history: History,
               planner: Planner, exact_prefix: bool, resets=()) -> None:
    """Properties (a)-(e) of a plan made before its commit, and: the tail is chunked at every
    reset past the prefix."""
    n = tokens.size
    segs = plan.segments
    # (a) contiguous, non-overlapping, covering [0, n) once, in order, no empty segments.
    pos = 0
    for s in segs:
        assert s.start == pos and s.end > s.start, (s, pos)
        pos = s.end
    assert pos == n
    assert sum(s.size for s in segs) == n
    # Chunks (and with regions, the regions found whole) cover the tail likewise, anchored at
    # the last reset at or before the prefix end (or at the prefix end when there is none); the
    # first one reaches past the prefix.
    L = plan.prefix.length
    earlier = [r for r in resets if r <= L]
    anchor = max(earlier) if earlier else L
    # Region hits lie outside every chunk (an S1 hit lies inside chunks, several with s1_extend)
    whole = [(s.start, s.end) for s in plan.hits
             if not any(c.start < s.end and s.start < c.end for c in plan.chunks)]
    pieces = sorted([(c.start, c.end) for c in plan.chunks] + whole)
    pos = pieces[0][0] if pieces else L
    assert anchor <= pos <= L
    assert not pieces or pieces[0][1] > L
    for a, b in pieces:
        assert a == pos and b > a
        pos = b
    assert pos == n
    # Every reset past the prefix starts a piece, or lies inside a run of regions found whole.
    assert all(any(a <= r for a, _ in pieces) and
               (r in {a for a, _ in pieces} or any(a < r < b for a, b in whole))
               for r in resets if L < r < n)
    # Regions (each found whole, or a run of them, is one hit; the others are registered at
    # commit) lie between resets, past the carve-out, and reach past the prefix.
    bounds = {0, n, anchor, *resets}
    assert all(a in bounds | {L} and b in bounds and a >= planner.config.carve_out for a, b in whole)
    assert whole == [] or planner.config.regions
    for r in plan.regions:
        assert r.kind == "miss" and r.start >= planner.config.carve_out and r.end > L
        assert r.start in bounds and r.end in bounds
    # (b) the prefix segment, and its length against a naive LCP over earlier prompts.
    L = plan.prefix.length
    if L > 0:
        assert segs[0].kind == "prefix" and segs[0].end == L
    assert all(s.kind != "prefix" for s in segs[1 if L else 0:])
    same_ns = [t for ns, t in history.prompts if ns == namespace]
    naive = max((lcp(tokens, t) for t in same_ns), default=0)
    if exact_prefix:
        assert L == naive
    else:
        assert L <= naive
    # The prefix handles point at the same tokens, at the same positions, in an earlier prompt.
    assert plan.prefix.handles.size == L
    if L:
        decoded = [history.source(h) for h in plan.prefix.handles.tolist()]
        for i, (ns, _src, p) in enumerate(decoded):
            assert ns == namespace and p == i
        last_of: dict[int, int] = {}
        for i, h in enumerate(plan.prefix.handles.tolist()):
            last_of[h // HANDLE_STRIDE] = i
        for k, i in last_of.items():
            assert np.array_equal(history.prompts[k - 1][1][:i + 1], tokens[:i + 1])
    # (c) + (e) hits: the tokens, the rotation, and the source KV.
    for s in plan.hits:
        e = s.entry
        assert e.namespace == namespace and e.registered
        assert 0 <= s.offset and s.offset + s.size <= e.size
        assert np.array_equal(e.tokens[s.offset:s.offset + s.size], tokens[s.start:s.end])
        src_handles = e.handles[s.offset:s.offset + s.size]
        first_ns, first_src, first_pos = history.source(src_handles[0])
        assert first_ns == namespace
        # The handles are the consecutive handles of one earlier prompt...
        assert np.array_equal(src_handles, src_handles[0] + np.arange(s.size))
        # ...which held exactly these tokens there, at p_source + offset.
        assert np.array_equal(first_src[first_pos:first_pos + s.size], tokens[s.start:s.end])
        assert first_pos == e.p_source + s.offset
        assert s.delta == s.start - first_pos
    # (d) carve-out: nothing reused from below position 32 of the tail; chunks starting there are
    # carve-outs (their part past the exact prefix prefilled as a segment of its own).
    carve = {(s.start, s.end) for s in segs if s.kind == "carve_out"}
    for s in segs:
        if s.kind == "hit":
            assert s.start >= planner.config.carve_out
    for c in plan.chunks:
        assert (c.start < planner.config.carve_out) == (c.kind == "carve_out")
        past = (max(c.start, L), c.end)  # the chunk's part past the exact prefix
        if c.kind == "carve_out":
            assert past in carve
        if c.kind == "hit":  # a whole-chunk hit is one segment
            assert any(s.kind == "hit" and (s.start, s.end) == past for s in segs)
    assert len(carve) == sum(c.kind == "carve_out" for c in plan.chunks)
    # Misses are merged: no two adjacent miss segments.
    for a, b in zip(segs, segs[1:]):
        assert not (a.kind == "miss" and b.kind == "miss")
    # Kinds partition the prompt.
    assert sum(plan.tokens_of(k) for k in ("prefix", "carve_out", "hit", "miss")) == n


@st.composite
def workloads(draw):
    """A document pool, and prompts of unique headers + documents in random orders."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    vocab = draw(st.sampled_from([50, 129280]))
    n_docs = draw(st.integers(1, 4))
    docs = [rng.integers(0, vocab, int(rng.integers(20, 900))) for _ in range(n_docs)]
    fresh = itertools.count(200_000)  # header tokens never appear in documents or other headers
    prompts = []
    for _ in range(draw(st.integers(2, 8))):
        order = draw(st.lists(st.integers(0, n_docs - 1), min_size=1, max_size=4))
        hlen = draw(st.sampled_from([0, 0, 1, 5, 20, 31, 32, 33, 45]))
        parts = [np.array([next(fresh) for _ in range(hlen)], dtype=np.int64)]
        starts = []
        for d in order:
            starts.append(sum(p.size for p in parts))
            parts.append(docs[d])
            if draw(st.booleans()):  # a short unique separator
                parts.append(np.array([next(fresh) for _ in range(int(rng.integers(1, 9)))]))
        tokens = np.concatenate(parts).astype(np.int64)
        if tokens.size == 0 or draw(st.integers(0, 5)) == 0:
            # Sometimes resend an earlier prompt extended (agent loop): exact prefix reuse.
            if prompts:
                prev = prompts[int(rng.integers(0, len(prompts)))][0]
                tokens = np.concatenate([prev, rng.integers(0, vocab, int(rng.integers(0, 80)))])
                starts = []
            if tokens.size == 0:
                tokens = rng.integers(0, vocab, 10)
        ns = draw(st.sampled_from([0, 0, 0, 1]))
        prompts.append((tokens, starts, ns))
    return prompts


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(prompts=workloads(), use_resets=st.booleans(), s1=st.booleans(), heads=st.booleans(),
       regions=st.booleans(), capacity=st.sampled_from([None, None, 600, 2000]),
       s1_window=st.sampled_from([32, 128]), extend=st.booleans(),
       dtype=st.sampled_from([np.int64, np.int32]))
def test_plans_over_random_workloads(prompts, use_resets, s1, heads, regions, capacity, s1_window,
                                     extend, dtype):
    """Every plan covers the prompt exactly once, its prefix is the naive LCP (unbounded capacity),
    every hit reuses exactly its own tokens from where an earlier prompt prefilled them, and nothing
    below position 32 is reused."""
    planner = Planner(replace(ALGORITHM1, capacity=capacity, s1=s1, s1_window=s1_window,
                              s1_extend=extend, head_probe=heads, regions=regions))
    history = History()
    for tokens, starts, ns in prompts:
        tokens = tokens.astype(dtype)
        resets = starts if use_resets else []
        plan = planner.plan(tokens, resets, namespace=ns)
        check_plan(plan, tokens.astype(np.int64), ns, history, planner, capacity is None,
                   resets)
        planner.commit(plan, history.handles_for(tokens))
        history.add(ns, tokens.astype(np.int64))
        planner.radix.check_integrity()
        # Carve-outs are never registered; the registry respects its capacity (nothing is locked).
        assert all(e.p_source >= CARVE_OUT for e in planner.registry.entries())
        if capacity is not None:
            assert planner.registry.total_tokens <= capacity
            assert planner.radix.total_tokens <= capacity
        # A whole-prompt resend is served by the prefix tree (unless evicted).
        if capacity is None:
            again = planner.plan(tokens, resets, namespace=ns)
            assert [(s.kind, s.start, s.end) for s in again.segments] == [("prefix", 0,
                                                                           tokens.size)]


# ---------------------------------------------------------------------------
# Hand-built cases
# ---------------------------------------------------------------------------


def _doc(seed: int = 0, n: int = 2000) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 129280, n)


def _header(n: int, start: int) -> np.ndarray:
    return np.arange(start, start + n) + 300_000


@pytest.mark.parametrize("reset_in_a", [True, False])
def test_shifted_document_is_reused_with_delta(reset_in_a):
    """A = header(40) + D; B = another header(75) + D with a reset at D's start. B reuses >= 90% of
    D (all of it when A also reset at D) and every hit rotates by delta = 75 - 40 = 35."""
    doc = _doc()
    planner = Planner(ALGORITHM1)
    a = np.concatenate([_header(40, 0), doc])
    plan_a = planner.plan(a, [40] if reset_in_a else [])
    assert plan_a.prefix.length == 0 and plan_a.tokens_of("hit") == 0
    planner.commit(plan_a, np.arange(a.size) + 10_000)
    b = np.concatenate([_header(75, 1000), doc])
    plan_b = planner.plan(b, [75])
    assert plan_b.prefix.length == 0
    hit_tokens = plan_b.tokens_of("hit")
    assert hit_tokens >= 0.9 * doc.size
    if reset_in_a:
        assert hit_tokens == doc.size
    for s in plan_b.hits:
        assert s.delta == 35
        assert s.entry.handles[s.offset:s.offset + s.size].tolist() == list(
            range(10_000 + s.start - 35, 10_000 + s.end - 35))
    if reset_in_a:  # everything not reused is in the header
        assert all(s.end <= 75 for s in plan_b.segments if s.kind in ("miss", "carve_out"))


def test_regions_moved_whole_are_one_hit_each():
    """A = header(40) + D1 + D2, B = header(75) + D2 + D1, resets at every document. With
    regions, B's documents are one hit each (D2 by δ = 75 - 2040, D1 by δ = 75 + 1500 - 40), their
    handles A's at those tokens; without, the same tokens are served chunk by chunk (12 hits).
    A third prompt moving D1 by one token more still finds it whole."""
    d1, d2 = _doc(1, 2000), _doc(2, 1500)
    a = np.concatenate([_header(40, 0), d1, d2])
    b = np.concatenate([_header(75, 1000), d2, d1])
    plans = {}
    for regions in (False, True):
        planner = Planner(replace(ALGORITHM1, regions=regions, s1=False))
        plan_a = planner.plan(a, [40, 2040])
        assert plan_a.tokens_of("hit") == 0
        assert [(r.start, r.end, r.kind) for r in plan_a.regions] == (
            [(40, 2040, "miss"), (2040, 3540, "miss")] if regions else [])
        planner.commit(plan_a, np.arange(a.size) + 10_000)
        plans[regions] = planner.plan(b, [75, 1575])
    assert plans[True].tokens_of("hit") == plans[False].tokens_of("hit") == 3500
    hits = [(s.start, s.end, s.delta) for s in plans[True].hits]
    assert hits == [(75, 1575, 75 - 2040), (1575, 3575, 1575 - 40)]
    assert len(plans[False].hits) > 2
    for s in plans[True].hits:
        assert s.entry.handles[s.offset:s.offset + s.size].tolist() == list(
            range(10_000 + s.start - s.delta, 10_000 + s.end - s.delta))
    assert plans[True].chunks == [c for c in plans[False].chunks if c.end <= 75]  # the header
    planner.commit(plans[True], np.arange(b.size) + 20_000)
    c = np.concatenate([_header(76, 2000), d1])
    (hit,) = planner.plan(c, [76]).hits
    assert (hit.start, hit.end, hit.size) == (76, 2076, 2000)


def _messages(header: int, start: int, doc: np.ndarray, cuts: list[int]) -> tuple:
    """header + doc with resets at the doc and at each of its message starts ``cuts``."""
    return (np.concatenate([_header(header, start), doc]),
            [header] + [header + c for c in cuts])


def test_a_run_of_regions_moved_together_is_one_hit():
    """A document of three messages (resets at each) moves by 35 tokens: with regions it is one
    hit on the run A registered, one δ, A's handles throughout; a plan holds the region the run
    was found through, and a run is entered at any of its regions."""
    doc = _doc(3, 2000)
    a, ra = _messages(40, 0, doc, [600, 1300])
    b, rb = _messages(75, 1000, doc, [600, 1300])
    planner = Planner(replace(ALGORITHM1, regions=True))
    planner.commit(planner.plan(a, ra), np.arange(a.size) + 10_000)
    plan = planner.plan(b, rb)
    (hit,) = plan.hits
    assert (hit.start, hit.end, hit.delta, hit.entry.size, hit.entry.p_source) == (
        75, 2075, 35, 2000, 40)
    assert hit.entry.handles[hit.offset:hit.offset + hit.size].tolist() == list(
        range(10_040, 12_040))
    # From the second message on (the first one dropped), the run is entered at an offset.
    c, rc = _messages(50, 3000, doc[600:], [700])
    (hit,) = planner.plan(c, rc).hits
    assert (hit.start, hit.end, hit.offset, hit.delta) == (50, 1450, 600, 50 - 640)
    # What a plan holds keeps its run findable: the region it was found through is held too.
    planner.acquire(plan)
    planner.registry.evict(planner.registry.total_tokens)  # everything not held
    assert [(s.start, s.end) for s in planner.plan(b, rb).hits] == [(75, 2075)]
    planner.release(plan)


def test_a_run_stops_at_an_edited_region_or_an_evicted_run():
    """A run is followed only as far as the tokens are the same, cut back to a region end, and
    only while its entry is registered: a document whose middle message was edited is served
    as two hits around it; once the run's entry and the middle message's are evicted, the
    first and last messages are served alone (the first one still points at the run)."""
    doc = _doc(4, 2000)
    a, ra = _messages(40, 0, doc, [600, 1300])
    planner = Planner(replace(ALGORITHM1, regions=True, s1=False))
    planner.commit(planner.plan(a, ra), np.arange(a.size) + 10_000)
    edited = doc.copy()
    edited[1000] = 129_279 - edited[1000]
    c, rc = _messages(60, 2000, edited, [600, 1300])
    spans = [(s.start, s.end) for s in planner.plan(c, rc).hits]
    assert spans[0] == (60, 660) and spans[-1] == (1360, 2060)
    assert all(s[1] <= 1060 or s[0] > 1060 for s in spans)  # the edit is never reused
    registry = planner.registry
    by_size = {e.size: e for e in registry.entries() if e.p_source >= 40 and e.size >= 600}
    run, first, last = by_size[2000], by_size[600], by_size[700]
    assert first.run is run and first.run_offset == 0 and last.run_offset == 1300
    registry.touch(first)
    registry.touch(last)
    registry.evict(registry.total_tokens - 1300)  # chunks, the run, the middle message
    assert not run.registered and first.run is run and registry.total_tokens == 1300
    b, rb = _messages(75, 1000, doc, [600, 1300])
    plan = planner.plan(b, rb)
    assert [(s.start, s.end) for s in plan.hits] == [(75, 675), (1375, 2075)]
    assert plan.tokens_of("miss") == 700


def _s1_pair(seed: int) -> dict[bool, Plan]:
    """A = header(40) + D (reset at D) committed to two planners, S1 off and on; then the plans of
    C = novel 57-token insertion + D[700:1300], with no resets."""
    doc = _doc(seed)
    a = np.concatenate([_header(40, 0), doc])
    c = np.concatenate([_header(57, 5000), doc[700:1300]])
    plans = {}
    for s1 in (False, True):
        p = Planner(replace(ALGORITHM1, s1=s1))
        p.commit(p.plan(a, [40]), np.arange(a.size))
        plans[s1] = p.plan(c)
    return plans


def test_s1_recovers_windows_inside_missed_chunks():
    """D's middle 600 tokens behind a novel 57-token insertion, no resets (seed 18: the chunkers of
    A and C only resynchronise late, so whole-chunk hits cover little): S1 finds 128-token windows
    of A's chunks inside C's missed chunks and reuses strictly more; every S1 hit is a whole window
    at a whole-window offset of its chunk and rotates by the same delta."""
    plans = _s1_pair(18)
    c = plans[True].tokens
    without, with_s1 = plans[False].tokens_of("hit"), plans[True].tokens_of("hit")
    assert with_s1 > without
    assert with_s1 >= 0.5 * 600
    whole_chunk_hits = {(s.start, s.end) for s in plans[False].hits}
    assert whole_chunk_hits <= {(s.start, s.end) for s in plans[True].hits}
    for s in plans[True].hits:
        if (s.start, s.end) not in whole_chunk_hits:
            assert s.size == 128 and s.offset % 128 == 0
        assert np.array_equal(s.entry.tokens[s.offset:s.offset + s.size], c[s.start:s.end])
        assert s.delta == 57 - 700 - 40


def test_s1_never_reuses_less():
    """Over 20 documents S1 keeps every whole-chunk hit (it only probes missed chunks) and reuses
    strictly more in several of them (measured: 6 of 20; S1 matters when the chunkers resynchronise
    late or a max-size chunk hides the shared content)."""
    better = 0
    for seed in range(20):
        plans = _s1_pair(seed)
        off = {(s.start, s.end) for s in plans[False].hits}
        on = {(s.start, s.end) for s in plans[True].hits}
        assert off <= on
        without, with_s1 = plans[False].tokens_of("hit"), plans[True].tokens_of("hit")
        assert with_s1 >= without
        better += with_s1 > without
    assert better >= 3


def _longest_registered_run(planner: Planner, chunk: np.ndarray) -> int:
    """Naive: the longest run of leading tokens ``chunk`` shares with any registered chunk."""
    return max((lcp(chunk, e.tokens) for e in planner.registry.entries()), default=0)


def test_heads_serve_a_last_chunk_cut_short():
    """A = header(40) + D committed. B = another header(75) + D[:n] (reset at D): B's last chunk
    ends where B does, inside one of A's chunks, and misses whole. With heads it is served from
    that chunk's leading tokens (the naive longest registered run, δ = 35); without, prefilled."""
    doc = _doc(5)
    a = np.concatenate([_header(40, 0), doc])
    plans = {}
    for heads in (False, True):
        planner = Planner(replace(ALGORITHM1, head_probe=heads, s1=False))
        planner.commit(planner.plan(a, [40]), np.arange(a.size))
        cuts = chunk_boundaries(doc)
        n = int(cuts[5]) + (int(cuts[6]) - int(cuts[5])) // 2  # halfway into D's seventh chunk
        b = np.concatenate([_header(75, 1000), doc[:n]])
        plans[heads] = plan = planner.plan(b, [75])
        last = plan.chunks[-1]
        assert last.kind == "miss" and last.start == 75 + int(cuts[5])
        if heads:
            run = _longest_registered_run(planner, b[last.start:])
            assert run == last.end - last.start  # the whole fragment lies in A's chunk
            tail = plan.segments[-1]
            assert (tail.kind, tail.start, tail.end) == ("hit", last.start, last.end)
            assert tail.delta == 35 and tail.offset == 0
    assert plans[False].tokens_of("miss") == plans[True].tokens_of("miss") + (
        plans[True].chunks[-1].end - plans[True].chunks[-1].start)


def test_heads_reuse_only_the_shared_run():
    """Registered: chunk X (100 tokens). Missed: a chunk of X's first 70 tokens, then others.
    The head hit covers exactly the 70 shared tokens (verified token by token, the naive longest
    run); a chunk whose head differs in one token reuses nothing (a head fingerprint alone never
    serves); the head index is namespaced and forgets evicted chunks."""
    rng = np.random.default_rng(11)
    x = rng.integers(0, 129280, 100)
    planner = Planner(replace(ALGORITHM1, min_chunk=40, max_chunk=100, head_probe=True, s1=False))
    entry = planner.registry.register(0, 1, x, np.arange(100) + 5000, 300)
    prompt = np.concatenate([_header(100, 0), x[:70], rng.integers(0, 129280, 30) + 200_000])
    plan = planner.plan(prompt, [100])
    assert (plan.chunks[-1].start, plan.chunks[-1].kind) == (100, "miss")  # one chunk, missed
    got = [(s.kind, s.start, s.end, s.entry, s.offset) for s in plan.segments[-2:]]
    assert got == [("hit", 100, 170, entry, 0), ("miss", 170, 200, None, 0)]
    assert _longest_registered_run(planner, prompt[100:]) == 70
    assert plan.hits[0].delta == 100 - 300
    changed = prompt.copy()
    changed[100 + HEAD_TOKENS - 1] += 1  # the head's last token: nothing is reused
    assert planner.plan(changed, [100]).tokens_of("hit") == 0
    assert planner.plan(prompt, [100], namespace=1).tokens_of("hit") == 0
    assert planner.registry.evict(100) and planner.registry.num_entries == 0
    assert planner.plan(prompt, [100]).tokens_of("hit") == 0


def test_carve_out_hand_built():
    """A prompt identical to a registered document from position 0 (different first token so the
    prefix tree misses): the chunk starting at 0 is a carve-out and is prefilled, later chunks hit."""
    doc = _doc(2, 1000)
    planner = Planner(replace(ALGORITHM1, s1=False))
    a = np.concatenate([_header(50, 0), doc])
    planner.commit(planner.plan(a, [50]), np.arange(a.size))
    plan = planner.plan(doc, [])  # doc at position 0, chunked from a zero state as in A
    assert plan.prefix.length == 0
    assert plan.segments[0].kind == "carve_out" and plan.segments[0].start == 0
    assert plan.chunks[0].kind == "carve_out"
    assert all(c.kind == "hit" for c in plan.chunks[1:])
    assert all(s.delta == -50 for s in plan.hits)
    # The carve-out is not registered on commit: only A's chunks (all at >= 50) are present.
    before = planner.registry.num_entries
    planner.commit(plan, np.arange(doc.size))
    assert planner.registry.num_entries == before
    assert min(e.p_source for e in planner.registry.entries()) == 50


def test_prefix_then_tail():
    """A resend with an appended turn is served by the prefix tree up to the old length, and the
    tail after it is chunked from there."""
    doc = _doc(3, 800)
    planner = Planner(ALGORITHM1)
    planner.commit(planner.plan(doc), np.arange(doc.size))
    longer = np.concatenate([doc, _header(300, 0)])
    plan = planner.plan(longer)
    assert plan.prefix.length == 800
    assert plan.segments[0].kind == "prefix" and plan.segments[0].end == 800
    assert plan.prefix.handles.tolist() == list(range(800))
    assert plan.chunks[0].start == 800 and plan.tokens_of("miss") == 300
    # Resets are prompt offsets (not tail offsets): the tail is cut at 900 and 1000.
    plan = planner.plan(longer, [100, 800, 900, 1000, 1100])
    assert {900, 1000} <= {c.start for c in plan.chunks}
    # A reset inside the prefix anchors the chunking there (so chunks keep their alignment);
    # only chunks reaching past the prefix are listed.
    expected = [int(e) + 50 for e in chunk_boundaries(longer[50:])]
    got = planner.plan(longer, [50]).chunks
    assert [c.end for c in got] == [e for e in expected if e > 800]
    assert got[0].start < 800 < got[0].end


def test_s1_windows_never_overlap_hand_built():
    """Fixed 100-token chunks, 32-token windows. Registered: A = T[0:32], B = T[31:63] (overlaps A
    by one token in the query), C = T[63:95]. The missed chunk [100, 200) holds T[0:63], 4 novel
    tokens, T[63:95], 1 novel token: S1 takes A at 100, skips B at 131 (it overlaps A), takes C at
    167 and leaves the last token a miss."""
    rng = np.random.default_rng(9)
    t = rng.integers(0, 129280, 95)
    planner = Planner(replace(ALGORITHM1, min_chunk=100, max_chunk=100, s1_window=32))
    a = planner.registry.register(0, 1, t[0:32], np.arange(32) + 1000, 500)
    b = planner.registry.register(0, 2, t[31:63], np.arange(32) + 2000, 600)
    c = planner.registry.register(0, 3, t[63:95], np.arange(32) + 3000, 700)
    novel = itertools.count(400_000)
    prompt = np.concatenate([[next(novel) for _ in range(100)], t[0:63],
                             [next(novel) for _ in range(4)], t[63:95], [next(novel)]])
    plan = planner.plan(prompt)
    got = [(s.kind, s.start, s.end, s.entry, s.offset) for s in plan.segments]
    assert got == [("carve_out", 0, 100, None, 0), ("hit", 100, 132, a, 0),
                   ("miss", 132, 167, None, 0), ("hit", 167, 199, c, 0),
                   ("miss", 199, 200, None, 0)]
    assert [s.delta for s in plan.hits] == [100 - 500, 167 - 700]
    assert b.refcount == 0


def _short_repeat_plans(extend: bool, before: int) -> tuple[Plan, int]:
    """A = header(40) + D[0:256] (one 256-token chunk); B = header(75) + a message of ``before``
    novel tokens, D[100:190] and 100 novel tokens, chunked at 256 tokens from the message start.
    Returns B's plan and where D[100:190] starts in B."""
    doc = _doc(11)
    planner = Planner(replace(ALGORITHM1, min_chunk=256, max_chunk=256, s1_window=32,
                              s1_extend=extend))
    a = np.concatenate([_header(40, 0), doc[:256]])
    planner.commit(planner.plan(a, [40]), np.arange(a.size) + 10_000)
    novel = itertools.count(400_000)
    b = np.concatenate([_header(75, 1000), [next(novel) for _ in range(before)], doc[100:190],
                        [next(novel) for _ in range(100)]])
    return planner.plan(b, [75]), 75 + before


@pytest.mark.parametrize("before", [100, 200])
def test_s1_extension_finds_a_short_repeat_whole(before: int) -> None:
    """A 90-token repeat inside a new message, inside one chunk (before=100) or cut by the chunk
    boundary at 75 + 256 (before=200). Hand-computed: A's registered 32-token windows start at D
    offsets 0, 32, ..., 224, so the only one inside D[100:190] is D[128:160]; without extension
    that window is all S1 serves, and only when no chunk boundary cuts it (at 331 = at + 56 when
    before=200, inside it); with extension, the hit grows to exactly D[100:190] (the novel tokens
    around it are outside the document's vocabulary), one segment reused from D offset 100."""
    plan, at = _short_repeat_plans(True, before)
    assert [(s.start, s.end, s.offset) for s in plan.hits] == [(at, at + 90, 100)]
    assert plan.hits[0].delta == at - (40 + 100)
    plain, at = _short_repeat_plans(False, before)
    expected = [(at + 28, at + 60, 128)] if before == 100 else []
    assert [(s.start, s.end, s.offset) for s in plain.hits] == expected


def test_namespaces_do_not_share():
    """The same prompt in another namespace reuses nothing: no prefix, no hits."""
    doc = _doc(4, 1000)
    planner = Planner(ALGORITHM1)
    planner.commit(planner.plan(doc, namespace=1), np.arange(doc.size))
    plan = planner.plan(doc, namespace=2)
    assert plan.prefix.length == 0 and plan.hits == []
    assert planner.plan(doc, namespace=1).prefix.length == 1000


def test_commit_rejects_wrong_handle_count():
    """commit needs exactly one handle per prompt token."""
    planner = Planner(ALGORITHM1)
    plan = planner.plan(_doc(5, 100))
    with pytest.raises(ValueError):
        planner.commit(plan, np.arange(99))


def test_acquire_protects_against_eviction():
    """acquire locks the plan's prefix node and hit entries: commits of other prompts under a tiny
    capacity evict everything else but not them; after release they become evictable again, and a
    second release unlocks below zero (ValueError)."""
    doc = _doc(6, 1500)
    planner = Planner(ALGORITHM1)  # unbounded while A is registered, then bounded to 400 tokens
    a = np.concatenate([_header(40, 0), doc])
    planner.commit(planner.plan(a, [40]), np.arange(a.size))
    planner.config = replace(planner.config, capacity=400)
    planner.registry.capacity = 400
    c = np.concatenate([a[:100], _header(10, 7000), doc[:600]])  # shares A's first 100 tokens
    plan = planner.plan(c, [110])
    assert plan.prefix.length == 100 and plan.tokens_of("hit") > 300
    held = [s.entry for s in plan.hits]
    planner.acquire(plan)
    for i in range(5):  # unrelated prompts push everything else out
        other = np.random.default_rng(100 + i).integers(0, 129280, 700)
        planner.commit(planner.plan(other), np.arange(other.size) + 10**6 * (i + 1))
    live = {id(e) for e in planner.registry.entries()}
    assert all(id(e) in live for e in held)
    held_size = sum(e.size for e in {id(e): e for e in held}.values())
    unheld_size = planner.registry.total_tokens - held_size
    assert unheld_size <= max(0, 400 - held_size)  # eviction took everything it was allowed to
    for s in plan.hits:
        assert planner.registry.lookup(0, s.entry.fingerprint, s.entry.tokens) is s.entry
    assert planner.radix.match_prefix(c).length == 100  # the locked prefix path survived
    planner.radix.check_integrity()
    # Committing the plan itself still works, and release drops the locks.
    planner.commit(plan, np.arange(c.size) + 10**8)
    planner.release(plan)
    with pytest.raises(ValueError):
        planner.release(plan)  # unlock below zero
    for i in range(5):
        other = np.random.default_rng(200 + i).integers(0, 129280, 700)
        planner.commit(planner.plan(other), np.arange(other.size) + 10**7 * (i + 1))
    live = {id(e) for e in planner.registry.entries()}
    assert not any(id(e) in live for e in held)
    assert planner.registry.total_tokens <= 400 and planner.radix.total_tokens <= 400
    assert planner.radix.match_prefix(c).length == 0
    planner.radix.check_integrity()


def test_acquire_refuses_a_plan_made_before_an_eviction_and_holds_nothing():
    """A plan whose hits were evicted after it was made is refused whole (ValueError): no lock
    is left on its prefix path or on its entries still registered, so they stay evictable."""
    doc = _doc(6, 1500)
    planner = Planner(ALGORITHM1)
    a = np.concatenate([_header(40, 0), doc])
    planner.commit(planner.plan(a, [40]), np.arange(a.size))
    c = np.concatenate([a[:100], _header(10, 7000), doc[:600]])
    plan = planner.plan(c, [110])
    assert plan.prefix.length == 100 and len(plan.hits) >= 2
    gone = plan.hits[-1].entry
    planner.registry.touch(plan.hits[0].entry)  # the others are younger: only the last goes
    while gone.registered:
        planner.registry.evict(1)
    kept = [s.entry for s in plan.hits if s.entry.registered]
    with pytest.raises(ValueError, match="evicted"):
        planner.acquire(plan)
    assert all(e.refcount == 0 for e in kept)
    assert planner.radix.evictable_tokens == planner.radix.total_tokens  # no path locked


def test_evict_is_lru_across_both_indexes():
    """Eviction follows one timeline over the radix tree and the registry: a stale radix branch
    goes before a chunk reused since, and a stale chunk before a recently used prefix."""
    doc = _doc(8, 800)
    planner = Planner(ALGORITHM1)
    first = np.concatenate([_header(40, 1), doc])
    planner.commit(planner.plan(first, [40]), np.arange(first.size))  # doc's chunks registered
    shifted = np.concatenate([_header(90, 2), doc])
    plan = planner.plan(shifted, [90])
    assert plan.tokens_of("hit") > 600
    planner.commit(plan, np.arange(shifted.size) + 10**6)  # the chunks are used again: fresh
    # Oldest now: the radix branch of `first`; then the reused chunks; then `shifted`'s branch.
    branch = planner.radix.total_tokens
    freed = planner.evict(1)
    assert [h.size for h in freed] == [first.size]  # first's whole branch, no chunk
    assert planner.registry.total_tokens >= 600 and planner.radix.total_tokens == branch - first.size
    # Touch `shifted`'s branch again: now the chunks are the oldest and go next.
    planner.radix.match_prefix(shifted)
    chunks_before = planner.registry.num_entries
    planner.evict(1)
    assert planner.registry.num_entries == chunks_before - 1
    assert planner.radix.total_tokens == shifted.size


@pytest.mark.parametrize("size,first_difference", [(1, 0), (1, None), (300, 255), (300, 256),
                                                   (3000, 2047), (3000, None), (5000, 4999)])
def test_common_prefix_against_a_naive_scan(size: int, first_difference: int | None) -> None:
    """The common prefix equals a token-by-token scan (all equal, the first or last differs)."""
    from irminsul.cache.radix import common_prefix

    a = np.random.default_rng(size).integers(0, 50, size)
    b = a.copy()
    if first_difference is not None:
        b[first_difference] += 1
        b[first_difference + 1:] = 99  # everything after differs as well
    naive = next((i for i in range(size) if a[i] != b[i]), size)
    assert common_prefix(a, b) == naive
