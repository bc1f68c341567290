"""Tests for irminsul.cache.radix.RadixTree against independent naive models."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from irminsul.cache.radix import PrefixMatch, RadixTree

SETTINGS = settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Small vocabularies and short sequences so prefixes collide and edges split often.
seqs = st.lists(st.integers(0, 2), min_size=0, max_size=10)
namespaces = st.integers(0, 1)


def arr(xs, dtype=np.int32) -> np.ndarray:
    return np.asarray(xs, dtype=dtype)


# ---------------------------------------------------------------------------
# Model 1 (no eviction): the literal list of inserted sequences.
# ---------------------------------------------------------------------------


class ListModel:
    """match = longest common prefix with any inserted sequence; a handle comes
    from the FIRST insertion whose sequence contained that prefix."""

    def __init__(self) -> None:
        self.inserted: list[tuple[int, list[int], list[int]]] = []

    def match(self, ns: int, toks: list[int]) -> tuple[int, list[int]]:
        best = 0
        for n, t, _ in self.inserted:
            if n != ns:
                continue
            lcp = 0
            while lcp < min(len(t), len(toks)) and t[lcp] == toks[lcp]:
                lcp += 1
            best = max(best, lcp)
        handles = []
        for i in range(best):
            first = next(h for n, t, h in self.inserted if n == ns and t[: i + 1] == toks[: i + 1])
            handles.append(first[i])
        return best, handles

    def insert(self, ns: int, toks: list[int], handles: list[int]) -> int:
        present, _ = self.match(ns, toks)
        self.inserted.append((ns, list(toks), list(handles)))
        return present


ops_no_evict = st.lists(
    st.tuples(st.sampled_from(["insert", "match"]), namespaces, seqs), min_size=1, max_size=30
)


@SETTINGS
@given(ops=ops_no_evict, dtype=st.sampled_from([np.int32, np.int64]))
def test_matches_list_model(ops, dtype):
    tree, model = RadixTree(), ListModel()
    next_handle = itertools.count(1000)
    for op, ns, toks in ops:
        if op == "insert":
            handles = [next(next_handle) for _ in toks]
            got = tree.insert(arr(toks, dtype), arr(handles, np.int64), namespace=ns)
            assert got == model.insert(ns, toks, handles)
        else:
            m = tree.match_prefix(arr(toks, dtype), namespace=ns)
            length, handles = model.match(ns, toks)
            assert m.length == length
            assert m.handles.dtype == np.int64
            assert m.handles.tolist() == handles
            # The returned node covers exactly the matched tokens (split on match).
            assert _path_len(m) == length
        tree.check_integrity()
        stored = {(n, tuple(t[: i + 1])) for n, t, _ in model.inserted for i in range(len(t))}
        assert tree.total_tokens == len(stored)
        assert tree.evictable_tokens == len(stored)


ops_exact = st.lists(
    st.tuples(st.sampled_from(["insert", "match"]), namespaces, seqs, st.integers(-1, 10)),
    min_size=1, max_size=30)


@SETTINGS
@given(ops=ops_exact)
def test_exact_rows_against_list_model(ops):
    """Each stored row is exact iff it lies before the ``exact`` count of the FIRST insertion
    that stored it (later insertions keep its handle, whatever theirs were); a match's exact
    length is the leading run of exact rows on its path."""
    tree, model = RadixTree(), ListModel()
    flags: dict[tuple, bool] = {}  # (ns, prefix) -> whether the row at its last token is exact
    next_handle = itertools.count(1000)
    for op, ns, toks, exact in ops:
        if op == "insert":
            given_exact = None if exact < 0 else exact
            tree.insert(arr(toks), arr([next(next_handle) for _ in toks], np.int64),
                        namespace=ns, exact=given_exact)
            for i in range(len(toks)):
                flags.setdefault((ns, tuple(toks[:i + 1])),
                                 given_exact is None or i < given_exact)
            model.insert(ns, toks, [0] * len(toks))
        else:
            m = tree.match_prefix(arr(toks), namespace=ns)
            want = 0
            while want < m.length and flags[(ns, tuple(toks[:want + 1]))]:
                want += 1
            assert m.length == model.match(ns, toks)[0]
            assert m.exact == want
        tree.check_integrity()


# Two token values and short paths: heals of a path's prefix with branches below it are common.
ops_heal = st.lists(
    st.tuples(st.sampled_from(["insert", "match", "heal"]), namespaces,
              st.lists(st.integers(0, 1), max_size=6), st.integers(-1, 6)),
    min_size=1, max_size=30)


@SETTINGS
@given(ops=ops_heal)
@example(ops=[("insert", 0, [0, 1], 1), ("insert", 0, [0, 1, 0], -1), ("heal", 0, [0, 1, 0], 2),
              ("match", 0, [0, 1, 0], -1)])
def test_heal_against_row_model(ops):
    """A model of rows: (namespace, prefix) -> the handle and exactness of the row at its last
    token. Insert stores the rows it adds (``exact`` as given); heal of a stored path from its
    first inexact row replaces those rows' handles, makes the path exact, and makes every row
    stored off the path after a replaced row inexact (it was computed over a replaced row). A
    match returns the rows' handles and its leading run of exact rows."""
    tree = RadixTree()
    rows: dict[tuple, list] = {}  # (ns, prefix) -> [handle, exact]
    next_handle = itertools.count(1000)
    for op, ns, toks, exact in ops:
        if op == "insert":
            given_exact = None if exact < 0 else exact
            handles = [next(next_handle) for _ in toks]
            tree.insert(arr(toks), arr(handles, np.int64), namespace=ns, exact=given_exact)
            for i, h in enumerate(handles):
                rows.setdefault((ns, tuple(toks[:i + 1])), [h, given_exact is None or i < given_exact])
            continue
        if op == "heal" and exact >= 0:
            toks = toks[:exact]  # a stored path's prefix: branches off it stay behind
        m = tree.match_prefix(arr(toks), namespace=ns)
        length = 0
        while length < len(toks) and (ns, tuple(toks[:length + 1])) in rows:
            length += 1
        want_exact = 0
        while want_exact < length and rows[(ns, tuple(toks[:want_exact + 1]))][1]:
            want_exact += 1
        assert m.length == length and m.exact == want_exact
        assert m.handles.tolist() == [rows[(ns, tuple(toks[:i + 1]))][0] for i in range(length)]
        if op == "heal" and m.exact < m.length:
            path, start = tuple(toks[:length]), m.exact
            fresh = [next(next_handle) for _ in range(length)]
            old = tree.heal(arr(path), arr(fresh, np.int64), start, namespace=ns)
            assert old.tolist() == m.handles[start:].tolist()
            for key, row in rows.items():
                if key[0] != ns:
                    continue
                prefix = key[1]
                common = 0
                while common < min(len(prefix), length) and prefix[common] == path[common]:
                    common += 1
                if common == len(prefix):  # on the path
                    row[:] = [fresh[len(prefix) - 1] if len(prefix) > start else row[0], True]
                elif common > start:  # off the path, after a replaced row
                    row[1] = False
        tree.check_integrity()


def test_heal_hand_built():
    """A turn whose last row was reused, and a follow-up stored over it ('exact' by its own
    count): healing the turn makes it exact and leaves the follow-up's own row inexact."""
    tree = RadixTree()
    tree.insert(arr([0, 1]), arr([5, 6], np.int64), exact=1)
    tree.insert(arr([0, 1, 2]), arr([5, 6, 7], np.int64))
    old = tree.heal(arr([0, 1]), arr([-1, 9], np.int64), 1)
    assert old.tolist() == [6]
    m = tree.match_prefix(arr([0, 1, 2]))
    assert (m.length, m.exact, m.handles.tolist()) == (3, 2, [5, 9, 7])
    with pytest.raises(ValueError, match="stored"):
        tree.heal(arr([0, 1, 3]), arr([1, 2, 3], np.int64), 1)
    tree.check_integrity()


def test_exact_stops_at_the_first_inexact_row_hand_built():
    """A follow-up stored after a turn whose last row was not exact: its own rows were computed
    over that row, so a match through both is exact only before it, and a split keeps the
    counts on each side."""
    tree = RadixTree()
    tree.insert(arr([0, 1]), arr([5, 6], np.int64), exact=1)
    tree.insert(arr([0, 1, 2]), arr([5, 6, 7], np.int64))  # 'all exact', but over row 1
    assert tree.match_prefix(arr([0, 1, 2])).exact == 1
    assert tree.match_prefix(arr([0])).exact == 1  # splits [0, 1] after 0
    assert tree.match_prefix(arr([0, 1])).exact == 1
    tree.insert(arr([3, 4, 5, 6]), arr([1, 2, 3, 4], np.int64), exact=2)
    m = tree.match_prefix(arr([3, 4, 5, 9]))  # splits [3, 4, 5, 6] after 5
    assert (m.length, m.exact) == (3, 2)
    assert tree.match_prefix(arr([3, 4, 5, 6])).exact == 2
    tree.check_integrity()


def _path_len(m: PrefixMatch) -> int:
    n, node = 0, m.node
    while node.parent is not None:
        n += len(node.key)
        node = node.parent
    return n


# ---------------------------------------------------------------------------
# Model 2 (with eviction and locks): a prefix-closed dict of prefixes.
# ---------------------------------------------------------------------------


class PrefixModel:
    """Stores each present prefix (ns, tuple) -> handle of its last token, plus a
    logical last-access time and a lock count per prefix."""

    def __init__(self) -> None:
        self.handle: dict[tuple, int] = {}
        self.time: dict[tuple, int] = {}
        self.locks: dict[tuple, int] = {}
        self.clock = 0

    def _prefixes(self, ns, toks, n):
        return [(ns, tuple(toks[: i + 1])) for i in range(n)]

    def match(self, ns, toks):
        self.clock += 1
        n = 0
        while n < len(toks) and (ns, tuple(toks[: n + 1])) in self.handle:
            n += 1
        for p in self._prefixes(ns, toks, n):
            self.time[p] = self.clock
        return n, [self.handle[p] for p in self._prefixes(ns, toks, n)]

    def insert(self, ns, toks, handles):
        present, _ = self.match(ns, toks)  # same clock tick as the tree's single touch
        for i, p in enumerate(self._prefixes(ns, toks, len(toks))):
            if p not in self.handle:
                self.handle[p], self.locks[p] = handles[i], 0
            self.time[p] = self.clock
        return present

    def lock(self, ns, toks, delta):
        for p in self._prefixes(ns, toks, len(toks)):
            self.locks[p] += delta

    def is_maximal(self, p):
        ns, t = p
        return not any(q[0] == ns and len(q[1]) == len(t) + 1 and q[1][:-1] == t for q in self.handle)

    def evictable(self) -> int:
        return sum(1 for p in self.handle if self.locks[p] == 0)


def dump(tree: RadixTree) -> dict[tuple, int]:
    """Read every stored (ns, prefix) -> handle straight out of the tree structure."""
    out = {}
    for ns, root in tree._roots.items():
        stack = [(root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                p = prefix
                for tok, h in zip(child.key.tolist(), child.value.tolist()):
                    p = p + (tok,)
                    out[(ns, p)] = h
                stack.append((child, p))
    return out


ops_evict = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), namespaces, seqs),
        st.tuples(st.just("match"), namespaces, seqs),
        st.tuples(st.just("match_lock"), namespaces, seqs),
        st.tuples(st.just("unlock"), st.integers(0, 10)),
        st.tuples(st.just("evict"), st.integers(0, 12)),
    ),
    min_size=1,
    max_size=40,
)


@SETTINGS
@given(ops=ops_evict)
def test_eviction_and_locks_against_prefix_model(ops):
    tree, model = RadixTree(), PrefixModel()
    next_handle = itertools.count(1)
    held = []  # (PrefixMatch, ns, matched tokens) currently locked
    all_stored: set[int] = set()
    all_evicted: list[int] = []
    for op in ops:
        kind = op[0]
        if kind == "insert":
            _, ns, toks = op
            handles = [next(next_handle) for _ in toks]
            present = tree.insert(arr(toks), arr(handles, np.int64), namespace=ns)
            assert present == model.insert(ns, toks, handles)
            all_stored.update(handles[present:])
        elif kind in ("match", "match_lock"):
            _, ns, toks = op
            m = tree.match_prefix(arr(toks), namespace=ns)
            length, handles = model.match(ns, toks)
            assert (m.length, m.handles.tolist()) == (length, handles)
            if kind == "match_lock":
                tree.lock(m.node)
                model.lock(ns, toks[:length], +1)
                held.append((m, ns, toks[:length]))
        elif kind == "unlock":
            if held:
                m, ns, toks = held.pop(op[1] % len(held))
                tree.unlock(m.node)
                model.lock(ns, toks, -1)
        else:
            want = op[1]
            evicted = tree.evict(want)
            flat = [h for a in evicted for h in a.tolist()]
            assert len(flat) == len(set(flat))
            by_handle = {h: p for p, h in model.handle.items()}
            assert set(flat) <= set(by_handle), "evicted a handle that was not stored"
            removed = {by_handle[h] for h in flat}
            assert all(model.locks[p] == 0 for p in removed), "evicted a locked prefix"
            max_t = max((model.time[p] for p in removed), default=None)
            for p in removed:
                del model.handle[p], model.time[p], model.locks[p]
            # Only whole leaves go, so what remains is still prefix-closed.
            for ns, t in model.handle:
                assert len(t) == 1 or (ns, t[:-1]) in model.handle
            # Evicted enough, or nothing evictable is left.
            assert len(flat) >= want or model.evictable() == 0
            # LRU: no unlocked leaf left behind is strictly older than something evicted.
            if max_t is not None:
                for p in model.handle:
                    if model.locks[p] == 0 and model.is_maximal(p):
                        assert model.time[p] >= max_t, "evicted a newer leaf before an older one"
            all_evicted.extend(flat)
        tree.check_integrity()
        assert dump(tree) == model.handle
        assert tree.total_tokens == len(model.handle)
        assert tree.evictable_tokens == model.evictable()
        # Evicted and remaining handles partition everything ever stored.
        remaining = list(model.handle.values())
        assert len(all_evicted) + len(remaining) == len(all_stored)
        assert set(all_evicted) | set(remaining) == all_stored


# ---------------------------------------------------------------------------
# Hand-built cases.
# ---------------------------------------------------------------------------


def test_lru_order_hand_built():
    tree = RadixTree()
    tree.insert(arr([1, 2, 3]), arr([10, 11, 12]))
    tree.insert(arr([4, 5]), arr([20, 21]))
    tree.insert(arr([6]), arr([30]))
    tree.match_prefix(arr([1, 2, 3, 9]))  # [1,2,3] becomes most recent
    # Order now: [4,5] (t=2), [6] (t=3), [1,2,3] (t=4).
    assert [a.tolist() for a in tree.evict(1)] == [[20, 21]]
    assert [a.tolist() for a in tree.evict(2)] == [[30], [10, 11, 12]]
    assert tree.total_tokens == 0 and tree.evict(5) == []
    tree.check_integrity()


def test_eviction_cascades_to_parent_in_one_call():
    tree = RadixTree()
    assert tree.insert(arr([1, 2, 3, 4]), arr([1, 2, 3, 4])) == 0
    assert tree.insert(arr([1, 2, 5, 6]), arr([9, 9, 5, 6])) == 2
    tree.match_prefix(arr([1, 2, 3]))  # splits [3,4]; [1,2,3] newer than [5,6]
    out = tree.evict(100)
    # [4] was split off but never touched again (t=1), so it is older than [5,6]
    # (t=2); then the childless [3] (t=3); then [1,2] once it is a leaf.
    assert [a.tolist() for a in out] == [[4], [5, 6], [3], [1, 2]]
    tree.check_integrity()


def test_split_on_match_and_locked_prefix_survives():
    tree = RadixTree()
    tree.insert(arr([7, 8, 9, 10]), arr([70, 80, 90, 100]))
    m = tree.match_prefix(arr([7, 8, 0]))
    assert m.length == 2 and m.handles.tolist() == [70, 80] and len(m.node.key) == 2
    tree.lock(m.node)
    assert tree.evictable_tokens == 2 and tree.total_tokens == 4
    assert [a.tolist() for a in tree.evict(10)] == [[90, 100]]
    assert tree.evict(10) == []  # only locked tokens left
    assert tree.match_prefix(arr([7, 8])).handles.tolist() == [70, 80]
    tree.unlock(m.node)
    assert tree.evictable_tokens == 2
    assert [a.tolist() for a in tree.evict(1)] == [[70, 80]]
    tree.check_integrity()


def test_lock_survives_later_split():
    tree = RadixTree()
    tree.insert(arr([1, 2, 3]), arr([1, 2, 3]))
    m = tree.match_prefix(arr([1, 2, 3]))
    tree.lock(m.node)
    tree.match_prefix(arr([1]))  # splits the locked edge
    tree.check_integrity()
    assert tree.evict(10) == [] and tree.evictable_tokens == 0
    tree.unlock(m.node)
    tree.check_integrity()
    assert tree.evictable_tokens == 3 and sum(len(a) for a in tree.evict(10)) == 3


def test_unlock_below_zero_raises():
    tree = RadixTree()
    tree.insert(arr([1, 2]), arr([1, 2]))
    m = tree.match_prefix(arr([1, 2]))
    tree.lock(m.node)
    tree.unlock(m.node)
    with pytest.raises(ValueError, match="negative"):
        tree.unlock(m.node)
    tree.check_integrity()


def test_lock_evicted_node_raises():
    tree = RadixTree()
    tree.insert(arr([1, 2]), arr([1, 2]))
    m = tree.match_prefix(arr([1, 2]))
    tree.evict(2)
    with pytest.raises(ValueError, match="evicted"):
        tree.lock(m.node)


def test_empty_match_returns_root_and_lock_is_noop():
    tree = RadixTree()
    m = tree.match_prefix(arr([5]))
    assert m.length == 0 and m.handles.shape == (0,) and m.handles.dtype == np.int64
    tree.lock(m.node)
    tree.unlock(m.node)
    assert tree.insert(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == 0
    tree.check_integrity()


def test_namespaces_isolated():
    tree = RadixTree()
    assert tree.insert(arr([1, 2, 3]), arr([1, 2, 3]), namespace=0) == 0
    assert tree.match_prefix(arr([1, 2, 3]), namespace=1).length == 0
    assert tree.insert(arr([1, 2, 3]), arr([4, 5, 6]), namespace=1) == 0
    assert tree.match_prefix(arr([1, 2, 3]), namespace=0).handles.tolist() == [1, 2, 3]
    assert tree.match_prefix(arr([1, 2, 3]), namespace=1).handles.tolist() == [4, 5, 6]
    assert tree.total_tokens == 6
    tree.check_integrity()


def test_input_validation():
    tree = RadixTree()
    with pytest.raises(ValueError, match="1-D"):
        tree.match_prefix(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="1-D"):
        tree.insert(np.zeros((2, 2), dtype=np.int64), np.zeros(4, dtype=np.int64))
    with pytest.raises(ValueError, match="equal lengths"):
        tree.insert(arr([1, 2, 3]), arr([1, 2]))
    with pytest.raises(ValueError, match="integer"):
        tree.insert(np.array([1.0, 2.0]), arr([1, 2]))


def test_tree_does_not_alias_caller_buffers():
    tree = RadixTree()
    toks, hs = arr([1, 2, 3]), arr([7, 8, 9], np.int64)
    tree.insert(toks, hs)
    toks[:] = 0
    hs[:] = 0
    assert tree.match_prefix(arr([1, 2, 3])).handles.tolist() == [7, 8, 9]


def test_heap_stays_bounded_under_repeated_touches():
    tree = RadixTree()
    tree.insert(arr([1, 2]), arr([1, 2]))
    tree.insert(arr([3]), arr([3]))
    for _ in range(5000):
        tree.match_prefix(arr([1, 2]))
    assert len(tree._heap) <= 2 * 2 + 1024 + 1
    tree.check_integrity()
    assert [a.tolist() for a in tree.evict(1)] == [[3]]


def test_check_integrity_detects_corruption():
    tree = RadixTree()
    tree.insert(arr([1, 2, 3]), arr([1, 2, 3]))
    tree._total += 1
    with pytest.raises(AssertionError, match="total_tokens"):
        tree.check_integrity()
