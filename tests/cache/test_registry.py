"""Tests for irminsul.cache.registry: verified hits, namespaces, LRU eviction, locks, S1 windows.

Fingerprints are chosen deliberately weak (constant, parity of the length, ...) so that distinct
content collides all the time; a naive model keyed by the tokens themselves says what must happen.
Window fingerprints come from the plain-Python reference in ``reference_cdc``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from fixtures import reference_cdc as ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from irminsul.cache.registry import HEAD_CANDIDATES, ChunkEntry, Registry

WEAK_FPS = {
    "zero": lambda toks: 0,
    "parity": lambda toks: len(toks) % 2,
    "first": lambda toks: toks[0] % 2 if toks else 0,
    "sum": lambda toks: sum(toks) % 3,
}


def arr(xs, dtype=np.int64) -> np.ndarray:
    return np.asarray(xs, dtype=dtype)


def window_fp(tokens, ns: int) -> int:
    return ref.window_fingerprint([int(t) for t in tokens], ns)


# ---------------------------------------------------------------------------
# Model-based property test
# ---------------------------------------------------------------------------


class NaiveRegistry:
    """(ns, tuple(tokens)) -> [handles, p_source, last_use, locks]; LRU by an own clock."""

    def __init__(self) -> None:
        self.entries: dict[tuple, list] = {}
        self.clock = 0

    def touch(self, key) -> None:
        self.clock += 1
        self.entries[key][2] = self.clock

    def register(self, key, handles, p_source) -> None:
        if key not in self.entries:
            self.entries[key] = [list(handles), p_source, 0, 0]
        self.touch(key)

    def evict(self, num_tokens: int) -> list[list[int]]:
        freed, removed = [], 0
        while removed < num_tokens:
            free = [k for k, e in self.entries.items() if e[3] == 0]
            if not free:
                break
            k = min(free, key=lambda k: self.entries[k][2])
            freed.append(self.entries.pop(k)[0])
            removed += len(k[1])
        return freed

    def bucket(self, ns, fp, fp_fn) -> int:
        return sum(1 for (n, t) in self.entries if n == ns and fp_fn(t) == fp)


contents = st.lists(st.integers(0, 2), min_size=1, max_size=9).map(tuple)
ops = st.lists(st.tuples(
    st.sampled_from(["register", "register", "lookup", "touch", "lock", "unlock", "evict",
                     "window"]),
    st.integers(0, 1),  # namespace
    st.integers(0, 5),  # content index
    st.integers(0, 12),  # evict amount / window offset
), min_size=5, max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pool=st.lists(contents, min_size=6, max_size=6), ops=ops,
       fp_name=st.sampled_from(sorted(WEAK_FPS)), window=st.sampled_from([2, 4]),
       capacity=st.sampled_from([None, 10, 25]))
def test_registry_matches_naive_model(pool, ops, fp_name, window, capacity):
    """Under weak fingerprints the registry behaves like a dict keyed by the tokens: lookups return
    exactly the entry with the query's tokens (or None), registering existing content returns the
    same entry, eviction drops least-recently-used unlocked entries first and returns their handles,
    counters are consistent, verify_failures counts every colliding comparison, and S1 windows are
    found iff some live entry holds that window at a whole-window offset."""
    fp_fn = WEAK_FPS[fp_name]
    reg, model = Registry(capacity, window=window), NaiveRegistry()
    objs: dict[tuple, ChunkEntry] = {}
    next_handle = itertools.count(1000)
    for op, ns, idx, amount in ops:
        toks = pool[idx]
        key, fp, query = (ns, toks), fp_fn(toks), arr(toks)
        before = reg.verify_failures
        bucket = model.bucket(ns, fp, fp_fn)
        if op == "register":
            handles = [next(next_handle) for _ in toks]
            existed = key in model.entries
            entry = reg.register(ns, fp, query, arr(handles), p_source=amount)
            model.register(key, handles, amount)
            if existed:
                assert entry is objs[key]
                assert reg.verify_failures - before <= bucket - 1
            else:
                assert reg.verify_failures - before == bucket
                objs[key] = entry
            assert entry.tokens.tolist() == list(toks)
            assert entry.handles.tolist() == model.entries[key][0]
            assert entry.p_source == model.entries[key][1]
            freed = reg.evict_to_capacity()
            if capacity is not None and sum(len(t) for _, t in model.entries) > capacity:
                want = model.evict(sum(len(t) for _, t in model.entries) - capacity)
            else:
                want = []
            assert [h.tolist() for h in freed] == want
        elif op == "lookup":
            got = reg.lookup(ns, fp, query)
            if key in model.entries:
                assert got is objs[key]
                assert got.tokens.tolist() == list(toks)
                assert got.handles.tolist() == model.entries[key][0]
                assert reg.verify_failures - before <= bucket - 1
            else:
                assert got is None
                assert reg.verify_failures - before == bucket
        elif op in ("touch", "lock", "unlock"):
            if key not in model.entries:
                continue
            entry = objs[key]
            if op == "touch":
                reg.touch(entry)
                model.touch(key)
            elif op == "lock":
                reg.lock(entry)
                model.entries[key][3] += 1
            elif model.entries[key][3] == 0:
                with pytest.raises(ValueError):
                    reg.unlock(entry)
            else:
                reg.unlock(entry)
                model.entries[key][3] -= 1
        elif op == "evict":
            freed = reg.evict(amount)
            assert [h.tolist() for h in freed] == model.evict(amount)
        else:  # window: a slice of this content at some offset, with its reference fingerprint
            start = amount % len(toks)
            piece = list(toks[start:start + window])
            if len(piece) < window:
                continue
            hit = reg.lookup_window(ns, window_fp(piece, ns), arr(piece))
            holders = [(n, t) for (n, t) in model.entries if n == ns and any(
                list(t[o:o + window]) == piece for o in range(0, len(t) - window + 1, window))]
            if not holders:
                assert hit is None
            else:
                assert hit is not None and hit.size == window
                assert hit.offset % window == 0 and hit.offset + window <= hit.entry.size
                assert hit.entry.tokens[hit.offset:hit.offset + window].tolist() == piece
                assert (ns, tuple(hit.entry.tokens.tolist())) in model.entries
        # Invariants after every operation.
        live = {(e.namespace, tuple(e.tokens.tolist())) for e in reg.entries()}
        assert live == set(model.entries)
        assert reg.num_entries == len(model.entries) == len(reg.entries())
        assert reg.total_tokens == sum(len(t) for _, t in model.entries)
        for k in list(objs):
            if k not in model.entries:
                del objs[k]


# ---------------------------------------------------------------------------
# Hand-built cases
# ---------------------------------------------------------------------------


def test_all_chunks_under_one_fingerprint():
    """Many different chunks registered under fingerprint 0: each lookup returns the entry with the
    query's tokens, a stranger gets None, and verify_failures counts each mismatching comparison."""
    reg = Registry()
    chunks = [arr([i, i + 1, i + 2]) for i in range(50)]
    entries = [reg.register(0, 0, c, c + 1000, p_source=10 * i) for i, c in enumerate(chunks)]
    assert len(set(map(id, entries))) == 50
    for i, c in enumerate(chunks):
        got = reg.lookup(0, 0, c)
        assert got is entries[i]
        assert got.tokens.tolist() == c.tolist() and got.handles.tolist() == (c + 1000).tolist()
        assert got.p_source == 10 * i
    before = reg.verify_failures
    assert reg.lookup(0, 0, arr([999, 1000, 1001])) is None
    assert reg.verify_failures - before == 50  # every entry compared, none matched
    assert reg.lookup(0, 0, arr([0, 1])) is None  # a prefix of a registered chunk is not a hit
    assert reg.lookup(0, 1, chunks[0]) is None  # right tokens, wrong fingerprint: not found


def test_verify_failures_exact_small_case():
    """Three chunks X, Y, Z share fingerprint 7: looking up a fourth compares (and fails) three
    times; looking up X, registered first, fails nowhere."""
    reg = Registry()
    x, y, z, w = arr([1]), arr([2]), arr([3]), arr([4])
    for c in (x, y, z):
        reg.register(0, 7, c, c, 0)
    assert reg.verify_failures == 0 + 1 + 2  # registering Y compared X; Z compared X and Y
    reg.verify_failures = 0
    assert reg.lookup(0, 7, w) is None
    assert reg.verify_failures == 3
    assert reg.lookup(0, 7, x).tokens.tolist() == [1]
    assert reg.verify_failures == 3
    assert reg.lookup(0, 8, w) is None  # empty bucket: nothing compared
    assert reg.verify_failures == 3


def test_register_same_content_twice_returns_same_entry():
    """Re-registering identical tokens (even with other handles and position) returns the original
    entry unchanged and adds no tokens; the registry keeps its own copy of the arrays."""
    reg = Registry()
    toks, handles = arr([5, 6, 7]), arr([50, 60, 70])
    first = reg.register(3, 42, toks, handles, p_source=100)
    toks[0], handles[0] = 99, 99  # the caller's buffers are not aliased
    again = reg.register(3, 42, arr([5, 6, 7], np.int32), arr([1, 2, 3]), p_source=5)
    assert again is first
    assert first.tokens.tolist() == [5, 6, 7] and first.handles.tolist() == [50, 60, 70]
    assert first.p_source == 100
    assert reg.total_tokens == 3 and reg.num_entries == 1
    # Re-registering counts as a use: a chunk registered after it is now the LRU one.
    other = reg.register(3, 43, arr([8]), arr([80]), p_source=0)
    reg.register(3, 42, arr([5, 6, 7]), arr([1, 2, 3]), p_source=5)
    assert [h.tolist() for h in reg.evict(1)] == [[80]]
    assert reg.lookup(3, 43, arr([8])) is None and other.size == 1


def test_namespaces_isolated():
    """Equal content and fingerprint in two namespaces: invisible across them, separate entries,
    separate windows, and evicting one leaves the other."""
    reg = Registry(window=2)
    toks = arr([1, 2, 3, 4])
    a = reg.register(1, 9, toks, arr([10, 11, 12, 13]), 0)
    assert reg.lookup(2, 9, toks) is None
    assert reg.lookup_window(2, window_fp([1, 2], 2), arr([1, 2])) is None
    assert reg.window_table(2) == {}
    b = reg.register(2, 9, toks, arr([20, 21, 22, 23]), 0)
    assert a is not b
    assert reg.lookup(1, 9, toks) is a and reg.lookup(2, 9, toks) is b
    assert reg.lookup_window(1, window_fp([3, 4], 1), arr([3, 4])).entry is a
    assert reg.lookup_window(2, window_fp([3, 4], 2), arr([3, 4])).entry is b
    # A window fingerprint is seeded with the namespace: ns 1's fingerprint does not open ns 2.
    assert reg.lookup_window(2, window_fp([3, 4], 1), arr([3, 4])) is None
    reg.touch(b)
    assert [h.tolist() for h in reg.evict(1)] == [[10, 11, 12, 13]]
    assert reg.lookup(1, 9, toks) is None and reg.lookup(2, 9, toks) is b
    assert reg.lookup_window(1, window_fp([3, 4], 1), arr([3, 4])) is None


def test_lru_eviction_hand_built():
    """Register A(10), B(20), C(30), then use A: LRU order is B, C, A. evict(15) drops B only;
    a locked C is skipped (A goes instead) and stays evictable after unlock."""
    reg = Registry(capacity=60)
    a = reg.register(0, 1, np.arange(10), np.arange(100, 110), 0)
    reg.register(0, 2, np.arange(20), np.arange(200, 220), 0)
    c = reg.register(0, 3, np.arange(30), np.arange(300, 330), 0)
    assert reg.total_tokens == 60 and reg.evict_to_capacity() == []
    reg.touch(a)
    freed = reg.evict(15)
    assert [h.tolist() for h in freed] == [list(range(200, 220))]
    assert reg.total_tokens == 40 and reg.num_entries == 2
    assert reg.lookup(0, 2, np.arange(20)) is None
    reg.lock(c)
    reg.lock(c)
    freed = reg.evict(1)
    assert [h.tolist() for h in freed] == [list(range(100, 110))]  # C is older but held
    assert reg.evict(1000) == []  # only the locked C is left
    assert reg.lookup(0, 3, np.arange(30)) is c and reg.total_tokens == 30
    reg.unlock(c)
    assert reg.evict(1) == []  # still held once
    reg.unlock(c)
    with pytest.raises(ValueError):
        reg.unlock(c)
    assert [h.tolist() for h in reg.evict(1)] == [list(range(300, 330))]
    assert reg.total_tokens == 0 and reg.num_entries == 0 and reg.entries() == []


def test_lock_evicted_entry_raises():
    """An entry found before an eviction and locked after it is refused, as the radix tree
    refuses a detached node: its handles may be given out again."""
    reg = Registry()
    entry = reg.register(0, 1, np.arange(10), np.arange(100, 110), 0)
    assert reg.lookup(0, 1, np.arange(10)) is entry
    assert [h.tolist() for h in reg.evict(1)] == [list(range(100, 110))]
    with pytest.raises(ValueError, match="evicted"):
        reg.lock(entry)
    assert entry.refcount == 0


def test_evict_to_capacity_stops_at_capacity():
    """evict_to_capacity frees the oldest entries until total <= capacity, and no more; an
    unbounded registry never evicts."""
    reg = Registry(capacity=25)
    for i in range(5):
        reg.register(0, i, np.full(10, i), np.full(10, i), 0)  # 50 tokens
    freed = reg.evict_to_capacity()
    assert [h.tolist() for h in freed] == [[0] * 10, [1] * 10, [2] * 10]
    assert reg.total_tokens == 20
    unbounded = Registry()
    for i in range(5):
        unbounded.register(0, i, np.full(10, i), np.full(10, i), 0)
    assert unbounded.evict_to_capacity() == [] and unbounded.total_tokens == 50


def test_locked_entries_survive_capacity_pressure():
    """With every entry locked, evict_to_capacity frees nothing and total stays over capacity."""
    reg = Registry(capacity=5)
    es = [reg.register(0, i, np.full(4, i), np.full(4, i), 0) for i in range(3)]
    for e in es:
        reg.lock(e)
    assert reg.evict_to_capacity() == []
    assert reg.total_tokens == 12
    reg.unlock(es[1])
    assert [h.tolist() for h in reg.evict_to_capacity()] == [[1] * 4]
    assert reg.total_tokens == 8


def test_many_touches_keep_lru_order():
    """Thousands of touches (which compact the lazy LRU heap) keep eviction strictly by last use."""
    reg = Registry()
    es = [reg.register(0, i, arr([i]), arr([i]), 0) for i in range(20)]
    rng = np.random.default_rng(0)
    order = list(range(20))
    for i in rng.integers(0, 20, 5000).tolist():
        reg.touch(es[i])
        order.remove(i)
        order.append(i)
    lock = order[3]
    reg.lock(es[lock])
    freed = [int(h[0]) for h in reg.evict(19)]
    assert freed == [i for i in order if i != lock]


def test_bad_register_shapes():
    """tokens and handles must be equal-length 1-D arrays."""
    reg = Registry()
    with pytest.raises(ValueError):
        reg.register(0, 0, arr([1, 2]), arr([1]), 0)
    with pytest.raises(ValueError):
        reg.register(0, 0, np.zeros((2, 2), dtype=np.int64), np.zeros((2, 2), dtype=np.int64), 0)
    assert reg.num_entries == 0 and reg.total_tokens == 0


def test_s1_windows_of_a_300_token_chunk():
    """A 300-token chunk indexes whole 128-token windows at offsets 0 and 128 only (not 256, which
    has 44 tokens, nor 5); lookups verify tokens; after eviction the windows are gone."""
    reg = Registry(window=128)
    ns = 77
    toks = np.random.default_rng(3).integers(0, 129280, 300)
    entry = reg.register(ns, 1234, toks, np.arange(300) + 5000, p_source=40)
    for off in (0, 128):
        win = toks[off:off + 128]
        hit = reg.lookup_window(ns, window_fp(win, ns), win)
        assert hit is not None
        assert hit.entry is entry and hit.offset == off and hit.size == 128
        assert entry.handles[hit.offset:hit.offset + hit.size].tolist() == list(
            range(5000 + off, 5128 + off))
    assert len(reg.window_table(ns)) == 2
    for off in (5, 172, 256 - 128 + 1):
        win = toks[off:off + 128]
        assert reg.lookup_window(ns, window_fp(win, ns), win) is None
    # A tail window (tokens 172..300, the only 128-window that includes the last 44) is unindexed.
    tail = toks[172:300]
    assert reg.lookup_window(ns, window_fp(tail, ns), tail) is None
    # Right fingerprint, wrong tokens: verified away and counted.
    before = reg.verify_failures
    fake = toks[:128].copy()
    fake[64] += 1
    assert reg.lookup_window(ns, window_fp(toks[:128], ns), fake) is None
    assert reg.verify_failures == before + 1
    # Short chunks index no windows.
    reg.register(ns, 99, toks[:127], np.arange(127), 0)
    assert len(reg.window_table(ns)) == 2
    # Evict everything: windows disappear with their entries.
    reg.evict(10_000)
    assert reg.num_entries == 0
    assert reg.lookup_window(ns, window_fp(toks[:128], ns), toks[:128]) is None
    assert reg.window_table(ns) == {}


def test_same_window_in_two_chunks():
    """Two chunks containing the same 128-token window: the window is found while either chunk
    lives, in the surviving one after the other is evicted."""
    reg = Registry(window=128)
    rng = np.random.default_rng(4)
    shared = rng.integers(0, 1000, 128)
    c1 = np.concatenate([shared, rng.integers(0, 1000, 10)])
    c2 = np.concatenate([rng.integers(0, 1000, 128), shared])
    e1 = reg.register(0, 1, c1, np.arange(c1.size), 0)
    e2 = reg.register(0, 2, c2, np.arange(c2.size) + 1000, 500)
    fp = window_fp(shared, 0)
    assert reg.lookup_window(0, fp, shared).entry in (e1, e2)
    reg.evict(1)  # e1 is older
    hit = reg.lookup_window(0, fp, shared)
    assert hit.entry is e2 and hit.offset == 128
    reg.evict(1)
    assert reg.lookup_window(0, fp, shared) is None


def test_chunk_repeating_a_window_evicts_cleanly():
    """A chunk whose two 128-token windows are identical indexes one window key at two offsets;
    the window is found at a whole-window offset and evicting the chunk removes it without error."""
    reg = Registry(window=128)
    half = np.random.default_rng(5).integers(0, 1000, 128)
    toks = np.concatenate([half, half, half[:10]])
    entry = reg.register(0, 1, toks, np.arange(toks.size), 0)
    hit = reg.lookup_window(0, window_fp(half, 0), half)
    assert hit.entry is entry and hit.offset in (0, 128)
    assert [h.size for h in reg.evict(1)] == [266]
    assert reg.lookup_window(0, window_fp(half, 0), half) is None
    assert reg.window_table(0) == {} and reg.total_tokens == 0


def test_head_lookup_takes_the_longest_run_among_the_newest():
    """Chunks sharing their first 16 tokens: a head lookup returns the one sharing the longest run
    of leading tokens with the query (naive runs computed here), among the newest
    HEAD_CANDIDATES; an older one with a longer run is not compared (the bound on the work).
    Queries shorter than the head, or whose head differs, find nothing."""
    rng = np.random.default_rng(3)
    head = rng.integers(0, 1000, 16)
    query = np.concatenate([head, rng.integers(0, 1000, 80)])
    reg = Registry(head=16)
    runs = [70] + [20 + 3 * i for i in range(HEAD_CANDIDATES)]  # oldest: the longest run
    entries = []
    for i, run in enumerate(runs):
        chunk = np.concatenate([query[:run], 5000 + rng.integers(0, 1000, 100 - run)])
        entries.append(reg.register(0, i, chunk, np.arange(100) + 1000 * i, 40))
        naive = next(k for k in range(100) if k == query.size or chunk[k] != query[k])
        assert naive == run
    hit = reg.lookup_head(0, query)
    assert (hit.entry, hit.offset, hit.size) == (entries[-1], 0, runs[-1])
    reg.evict(1)  # the oldest goes; the answer is unchanged
    assert reg.lookup_head(0, query).entry is entries[-1]
    assert reg.lookup_head(0, query[:15]) is None
    other = query.copy()
    other[3] += 1
    assert reg.lookup_head(0, other) is None
    assert reg.lookup_head(1, query) is None  # another namespace
    assert Registry().lookup_head(0, query) is None  # heads not indexed


def test_a_run_holds_its_regions_tokens():
    """A region joins a run only where the run holds its tokens; eviction marks an entry
    unregistered and drops its own run, so a region pointing at an evicted run does not use it."""
    reg = Registry()
    a = reg.register(0, 1, np.arange(40), np.arange(40), 100)
    b = reg.register(0, 2, np.arange(40, 70), np.arange(40, 70), 140)
    run = reg.register(0, 3, np.arange(70), np.arange(70), 100, probes=False)
    with pytest.raises(ValueError, match="chunk of 30 tokens is not at offset 39 of a run of 70"):
        reg.join_run(b, run, 39)
    reg.join_run(a, run, 0)
    reg.join_run(b, run, 40)
    assert (b.run, b.run_offset) == (run, 40) and run.registered
    reg.touch(a)
    reg.touch(b)
    reg.evict(1)  # the least recently used: the run
    assert not run.registered and a.run is run and a.registered


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), cuts=st.lists(st.integers(1, 30), min_size=1, max_size=12),
       window=st.sampled_from([2, 4]), head=st.sampled_from([0, 3]))
def test_register_chunks_indexes_every_chunk_at_its_position(seed, cuts, window, head):
    """Chunks of one array registered together, from a tiny vocabulary (so chunks, windows and
    heads repeat within the batch and across it): the entries are the distinct chunk contents
    with the first occurrence's handles and position (later ones only refresh it, reported as not
    new); every whole-window tile of every entry is found by the reference window fingerprint,
    every head by its head, and the LRU order is the naive one."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 3, sum(cuts) + 5)
    handles = np.arange(tokens.size) + 100
    ends = np.cumsum(cuts).tolist()
    def weak(piece: np.ndarray) -> int:  # a weak fingerprint: most chunks collide
        return int(piece.sum()) % 2

    chunks = [(s, e, weak(tokens[s:e])) for s, e in zip([0] + ends, ends)]
    reg, model = Registry(window=window, head=head), NaiveRegistry()
    # registered before: found again when the first chunk is these 4 tokens
    reg.register(0, weak(tokens[:4]), tokens[:4], handles[:4] + 1000, 77)
    model.register((0, tuple(tokens[:4].tolist())), (handles[:4] + 1000).tolist(), 77)
    out = reg.register_chunks(0, tokens, handles, chunks)
    for (start, end, _), (entry, new) in zip(chunks, out):
        key = (0, tuple(tokens[start:end].tolist()))
        assert new == (key not in model.entries)
        model.register(key, handles[start:end].tolist(), start)
        assert entry.tokens.tolist() == list(key[1])
        assert (entry.handles.tolist(), entry.p_source) == tuple(model.entries[key][:2])
    assert {(e.namespace, tuple(e.tokens.tolist())) for e in reg.entries()} == set(model.entries)
    order = sorted(model.entries, key=lambda k: model.entries[k][2])
    assert [h.tolist() for h in reg.evict(0)] == []
    for entry in reg.entries():
        toks = entry.tokens
        for offset in range(0, toks.size - window + 1, window):
            piece = toks[offset:offset + window]
            hit = reg.lookup_window(0, window_fp(piece, 0), piece)
            assert hit is not None and hit.entry.tokens[hit.offset:hit.offset + window].tolist() \
                == piece.tolist()
        if head and toks.size >= head:
            assert reg.lookup_head(0, toks) is not None
    freed = reg.evict(10**6)
    assert [h.tolist() for h in freed] == [model.entries[k][0] for k in order]
    assert reg.window_table(0) == {} and reg.total_tokens == 0


@given(seed=st.integers(0, 2**32 - 1))
@settings(max_examples=50, deadline=None)
def test_replace_handles_against_naive_loop(seed):
    """Every occurrence of an old handle in any entry becomes the matching new one, element by
    element as a plain loop does it; the held / freed lists count one per replaced occurrence;
    tokens and lookups are untouched."""
    rng = np.random.default_rng(seed)
    reg = Registry(window=4)
    entries = []
    for i in range(8):
        size = int(rng.integers(1, 12))
        tokens = rng.integers(0, 50, size) + 100 * i  # distinct content per entry
        entries.append(reg.register(0, i, tokens, rng.integers(0, 40, size), i))
    before = {id(e): e.handles.copy() for e in entries}
    old = rng.choice(40, size=int(rng.integers(0, 20)), replace=False)
    new = rng.integers(1000, 2000, old.size)
    held, freed = reg.replace_handles(old, new)
    mapping = dict(zip(old.tolist(), new.tolist()))
    want_held, want_freed = [], []
    for e in entries:
        want = [mapping.get(h, h) for h in before[id(e)].tolist()]
        assert e.handles.tolist() == want
        want_freed += [h for h in before[id(e)].tolist() if h in mapping]
        want_held += [mapping[h] for h in before[id(e)].tolist() if h in mapping]
        assert reg.lookup(0, e.fingerprint, e.tokens) is e
    flat = lambda arrays: sorted(np.concatenate(arrays).tolist()) if arrays else []  # noqa: E731
    assert flat(held) == sorted(want_held) and flat(freed) == sorted(want_freed)
