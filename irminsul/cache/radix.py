"""Exact-prefix radix tree over token ids, in the spirit of SGLang's RadixCache.

Each edge stores a run of token ids (``key``) and one opaque int64 handle per
token (``value``; the serving engine keeps KV slot indices there). Matching
compares whole edges with vectorized numpy, so cost is per edge, not per token.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


class RadixNode:
    """A tree node; ``key``/``value`` describe the edge from ``parent`` into it."""

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access", "exact")

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: RadixNode | None,
                 last_access: int, exact: int | None = None) -> None:
        self.key, self.value, self.parent = key, value, parent
        # How many leading tokens of the edge have exact rows: rows computed over exact rows
        # only. A sequence that reused content position-independently stores rows from its
        # first reused position on that differ from a full prefill's; they stay served as its
        # continuation's prefix, but are not exact (see RadixTree.insert).
        self.exact = len(key) if exact is None else exact
        # Keyed by the first token of the child's edge: edges out of a node
        # never share a first token, so this finds the only candidate in O(1).
        self.children: dict[int, RadixNode] = {}
        self.lock_ref, self.last_access = 0, last_access

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"RadixNode(len={len(self.key)}, children={len(self.children)}, lock_ref={self.lock_ref})"


@dataclass
class PrefixMatch:
    """Result of :meth:`RadixTree.match_prefix`."""

    length: int  # number of leading tokens matched
    handles: np.ndarray  # int64 [length], stored handles of the matched tokens
    node: RadixNode  # deepest matched node (root if length == 0); pass to lock/unlock
    exact: int = -1  # leading matched tokens whose rows are exact (-1: all ``length``)

    def __post_init__(self) -> None:
        if self.exact < 0:
            self.exact = self.length


def _as_1d_int(x: np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64, copy=False)  # e.g. np.asarray([]) is float64
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must have an integer dtype, got {arr.dtype}")
    return arr


def _path(node: RadixNode) -> list[RadixNode]:
    """The edges from the root (left out) down to ``node``, root side first."""
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    return path


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two equal-length, non-empty token arrays share (one pass)."""
    differ = a != b
    k = int(differ.argmax())
    return k if differ[k] else differ.size


class RadixTree:
    """Exact-prefix cache of token sequences with per-token handles, LRU eviction and locks.

    Each ``namespace`` (tenant/model salt) has its own root, so sequences never
    match across namespaces. Time is a logical counter bumped once per
    match/insert, which keeps eviction order deterministic; a ``clock`` shared with
    the chunk registry puts both indexes on one LRU timeline.
    """

    def __init__(self, clock: Iterator[int] | None = None) -> None:
        self._roots: dict[int, RadixNode] = {}
        self._clock = clock if clock is not None else itertools.count(1)
        self._total = self._evictable = 0
        self._num_nodes = 0  # non-root nodes; bounds the heap size (see _push)
        # Lazy-deletion min-heap of (last_access, seq, node). An entry is live iff
        # the node is still an unlocked, attached leaf with that exact stamp; every
        # transition into that state pushes a fresh entry, so stale ones can be
        # dropped whenever they are seen. seq breaks ties without comparing nodes.
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._seq = itertools.count()

    # ---- public API -------------------------------------------------------

    @property
    def total_tokens(self) -> int:
        """Tokens stored in the tree, over all namespaces."""
        return self._total

    @property
    def evictable_tokens(self) -> int:
        """Tokens in nodes with ``lock_ref == 0``."""
        return self._evictable

    def roots(self) -> dict[int, RadixNode]:
        """Each namespace's root (a copy of the mapping), for a reader on the tree's own thread
        that walks the stored edges (the server's published index, irminsul.server.index)."""
        return dict(self._roots)

    def match_prefix(self, tokens: np.ndarray, namespace: int = 0) -> PrefixMatch:
        """Longest stored prefix of ``tokens`` within ``namespace``.

        Touches the matched path for LRU. If the match ends inside an edge the
        node is split there, so the returned ``node`` covers exactly the match.
        """
        tokens = _as_1d_int(tokens, "tokens")
        node, length, pieces = self._walk(self._root(namespace), tokens)
        self._touch(node)
        handles = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)
        return PrefixMatch(length=length, handles=handles, node=node, exact=self._exact(node))

    def insert(self, tokens: np.ndarray, handles: np.ndarray, namespace: int = 0,
               exact: int | None = None) -> int:
        """Insert ``tokens`` with per-token ``handles``; return how many leading tokens were present.

        Already-present tokens keep their old handles, so the caller's handles
        for them (``handles[:returned]``) are redundant and may be freed.
        ``exact``: how many leading tokens have exact rows (default: all); the rows of the
        tokens stored here from there on are marked as not exact, and so is any prefix match
        that reaches them (:attr:`PrefixMatch.exact`).
        """
        tokens, handles = _as_1d_int(tokens, "tokens"), _as_1d_int(handles, "handles")
        if len(tokens) != len(handles):
            raise ValueError(f"tokens and handles must have equal lengths, "
                             f"got {len(tokens)} and {len(handles)}")
        node, present, _ = self._walk(self._root(namespace), tokens)
        if present < len(tokens):
            # _walk stopped because no child starts with tokens[present]
            # (after a split, the remaining child differs at exactly that token).
            # Copy so the tree never aliases (or pins) the caller's buffers.
            n = len(tokens) - present
            stored = n if exact is None else min(max(exact - present, 0), n)
            leaf = RadixNode(tokens[present:].copy(), handles[present:].astype(np.int64),
                             node, 0, stored)  # stamped by _touch below
            node.children[int(tokens[present])] = leaf
            self._num_nodes += 1
            self._total += len(leaf.key)
            self._evictable += len(leaf.key)
            node = leaf
        self._touch(node)
        return present

    def heal(self, tokens: np.ndarray, handles: np.ndarray, start: int,
             namespace: int = 0) -> np.ndarray:
        """Replace the handles of stored ``tokens`` from position ``start`` on with ``handles``
        (one per token of ``tokens``; those before ``start`` are not read) and mark the whole
        path exact: its rows from ``start`` on were recomputed over the exact rows before it.
        Returns the replaced handles, in position order, which the tree no longer references.
        The path must be stored whole (the caller holds a lock on its deepest node); branches off
        it past ``start`` are marked not exact (their rows were computed over replaced ones)."""
        tokens, handles = _as_1d_int(tokens, "tokens"), _as_1d_int(handles, "handles")
        if len(tokens) != len(handles) or not 0 <= start <= len(tokens):
            raise ValueError(f"need one handle per token and 0 <= start <= {len(tokens)}, got "
                             f"{len(handles)} handles and start {start}")
        node, length, _ = self._walk(self._root(namespace), tokens)
        if length < len(tokens):
            raise ValueError(f"only {length} of the {len(tokens)} tokens are stored")
        path = _path(node)
        old, at = [], 0
        for depth, edge in enumerate(path):
            n = len(edge.key)
            if at + n > start:
                cut = max(start - at, 0)
                old.append(edge.value[cut:])
                edge.value = np.concatenate([edge.value[:cut],
                                             handles[at + cut:at + n].astype(np.int64)])
                # Every branch off the path from here on was computed over replaced rows: not
                # exact from its first row on (its own count may say exact: it was stored over
                # an inexact path, where the count did not matter).
                below = path[depth + 1] if depth + 1 < len(path) else None
                for child in edge.children.values():
                    if child is not below:
                        child.exact = 0
            edge.exact = n
            at += n
        return np.concatenate(old) if old else np.empty(0, dtype=np.int64)

    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction (reference counted)."""
        self._check_attached(node)
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one :meth:`lock` of ``node``; raises ValueError if it was not locked."""
        self._check_attached(node)
        if node.parent is not None and node.lock_ref <= 0:
            # Ancestors always hold >= the child's count, so checking node suffices
            # and we fail before mutating anything.
            raise ValueError(f"unlock would make lock_ref negative on {node!r}")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                if node.is_leaf:
                    self._push(node)  # it may have been dropped from the heap while locked
            node = node.parent

    def oldest(self) -> int | None:
        """Last-access stamp of the least recently used evictable leaf, or None if none."""
        while self._heap and not self._is_live(self._heap[0][0], self._heap[0][2]):
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def evict(self, num_tokens: int) -> list[np.ndarray]:
        """Evict LRU unlocked leaves until >= ``num_tokens`` tokens are gone or nothing is evictable.

        Parents left childless become candidates in turn. Returns the handle
        arrays of the evicted nodes (in eviction order) so slots can be freed.
        """
        evicted: list[np.ndarray] = []
        freed = 0
        while freed < num_tokens and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if not self._is_live(stamp, node):
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[int(node.key[0])]
            node.parent = None  # marks it detached; lock/unlock will reject it
            n = len(node.key)
            self._total, self._evictable, self._num_nodes = (
                self._total - n, self._evictable - n, self._num_nodes - 1)
            freed += n
            evicted.append(node.value)
            if parent.parent is not None and parent.is_leaf and parent.lock_ref == 0:
                self._push(parent)
        return evicted

    def values(self) -> Iterator[np.ndarray]:
        """The handle array of every stored edge, all namespaces (what the tree references)."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:
                yield node.value

    def check_integrity(self) -> None:
        """Raise AssertionError if any structural, lock, LRU or counter invariant is broken."""
        total = evictable = nodes = 0
        live = {id(n) for s, _, n in self._heap if self._is_live(s, n)}
        for ns, root in self._roots.items():
            assert root.parent is None and len(root.key) == 0 and len(root.value) == 0, (
                f"namespace {ns}: malformed root")
            assert root.lock_ref == 0, f"namespace {ns}: root lock_ref is {root.lock_ref}"
            stack = [root]
            while stack:
                node = stack.pop()
                for first, child in node.children.items():
                    k, v = child.key, child.value
                    assert k.ndim == 1 and v.ndim == 1 and len(k) == len(v), (
                        f"key/value shape mismatch: {k.shape} vs {v.shape}")
                    assert v.dtype == np.int64, f"value dtype {v.dtype}, expected int64"
                    assert len(k) > 0, "non-root node with empty key"
                    assert int(k[0]) == first, f"child keyed {first} but edge starts with {int(k[0])}"
                    assert child.parent is node, "broken parent link"
                    assert child.lock_ref >= 0, f"negative lock_ref {child.lock_ref}"
                    assert 0 <= child.exact <= len(k), f"exact {child.exact} of {len(k)} tokens"
                    if node.parent is not None:
                        assert node.lock_ref >= child.lock_ref, (
                            f"parent lock_ref {node.lock_ref} < child lock_ref {child.lock_ref}")
                        # Every touch stamps the whole path, so parents are never older.
                        assert node.last_access >= child.last_access, "parent older than child"
                    if child.is_leaf and child.lock_ref == 0:
                        assert id(child) in live, "evictable leaf missing from eviction heap"
                    nodes, total = nodes + 1, total + len(k)
                    evictable += len(k) if child.lock_ref == 0 else 0
                    stack.append(child)
        assert total == self._total, f"total_tokens {self._total} != recount {total}"
        assert evictable == self._evictable, (
            f"evictable_tokens {self._evictable} != recount {evictable}")
        assert nodes == self._num_nodes, f"node count {self._num_nodes} != recount {nodes}"

    # ---- internals --------------------------------------------------------

    def _root(self, namespace: int) -> RadixNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = RadixNode(
                np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), None, 0)
        return root

    def _walk(self, node: RadixNode, tokens: np.ndarray) -> tuple[RadixNode, int, list[np.ndarray]]:
        """Follow ``tokens`` from ``node``; split the last edge if the match ends inside it.

        Returns (deepest matched node, matched length, matched handle pieces).
        """
        pos, n = 0, len(tokens)
        pieces: list[np.ndarray] = []
        while pos < n:
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            m = min(len(child.key), n - pos)
            k = common_prefix(child.key[:m], tokens[pos:pos + m])  # >= 1: the first matched
            if k < len(child.key):
                child = self._split(child, k)
            pieces.append(child.value)
            pos += k
            node = child
            if k < m:
                break  # mismatch inside the edge
        return node, pos, pieces

    def _split(self, child: RadixNode, k: int) -> RadixNode:
        """Cut ``child``'s edge after ``k`` tokens; return the new upper node.

        The original object keeps the lower part, so a node handed out earlier
        (and possibly locked) still covers its full path; the new node copies its
        lock count and stamp, which keeps lock and LRU invariants intact.
        """
        parent = child.parent
        assert parent is not None
        upper = RadixNode(child.key[:k], child.value[:k], parent, child.last_access,
                          min(child.exact, k))
        child.exact = max(child.exact - k, 0)
        upper.lock_ref = child.lock_ref
        parent.children[int(child.key[0])] = upper
        child.key, child.value, child.parent = child.key[k:], child.value[k:], upper
        upper.children[int(child.key[0])] = child
        self._num_nodes += 1
        return upper

    @staticmethod
    def _exact(node: RadixNode) -> int:
        """Leading tokens with exact rows on the path from the root to ``node``: the edges'
        exact counts up to the first edge that is not exact throughout."""
        exact = 0
        for edge in _path(node):
            exact += edge.exact
            if edge.exact < len(edge.key):
                break
        return exact

    def _touch(self, node: RadixNode) -> None:
        """Stamp ``node`` and its ancestors with a fresh logical time."""
        stamp = next(self._clock)
        cur: RadixNode | None = node
        while cur is not None:
            cur.last_access = stamp
            cur = cur.parent
        # Only the deepest node can be a leaf (ancestors have it as a child);
        # its old heap entry is now stale, so push one with the new stamp.
        if node.parent is not None and node.is_leaf and node.lock_ref == 0:
            self._push(node)

    def _push(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
        if len(self._heap) > 2 * self._num_nodes + 1024:
            # Touch-heavy workloads pile up stale entries; drop them (and
            # duplicates) so the heap stays O(nodes). Amortized O(1) per push.
            seen: set[int] = set()
            kept: list[tuple[int, int, RadixNode]] = []
            for entry in self._heap:
                if self._is_live(entry[0], entry[2]) and id(entry[2]) not in seen:
                    seen.add(id(entry[2]))
                    kept.append(entry)
            heapq.heapify(kept)
            self._heap = kept

    @staticmethod
    def _is_live(stamp: int, node: RadixNode) -> bool:
        return (node.parent is not None and node.is_leaf and node.lock_ref == 0
                and node.last_access == stamp)

    @staticmethod
    def _check_attached(node: RadixNode) -> None:
        if node.parent is None and len(node.key) > 0:
            raise ValueError(f"{node!r} has been evicted from the tree")
