"""Seeded stateful fuzz of the cache core: the planner (radix tree + registry, Algorithm 1) driven
the way the engine's cache manager drives it, with slot references counted in a real KVPool.

A seeded random sequence of operations over three namespaces — plan a prompt (new documents in
new orders, follow-up turns, resends, forks of recent prompts, documents cut short or edited),
acquire (hold) a plan, commit it (slots allocated, making room by eviction; live-style hits
share their c_KV slots), release it, finish an open sequence (remember it with some output, or
not), evict (a little, or everything evictable), look chunks / windows / heads up, match
prefixes, heal a sequence's reused rows — is checked after every step against references kept
in this file, which never read the structure they check:

* ``ShadowTrie``: a one-node-per-token trie per namespace of what the radix tree must store,
  updated by every insert, heal and by the evictions the tree reports. The longest stored
  prefix, its handles and its exact-row count are found by walking it token by token; the whole
  tree (every token, handle and exact flag) must equal it; an eviction must take a whole leaf
  chain nobody holds.
* ``CacheFuzz.entries``: every registry entry by identity with copies of its content, handles
  and source position. New entries must be exactly the committed plan's missed chunks / regions
  / runs at their positions with the commit's handles; nothing may change but by a heal, or
  vanish unreported or while held; one content is registered once per namespace. A missed
  chunk must have no live entry of equal content in its namespace (brute force), a hit must
  name a live one; lookups from another namespace find nothing of this one.
* ``CacheFuzz.origin``: handle -> (namespace, token, position) of the row it names, recorded
  when the slot is allocated: every served prefix or reused token must name a row of the same
  namespace holding the same token, at its own position (prefix) or at p_source + offset (hit,
  never below position 32).
* holds: how often each plan is acquired; entry refcounts and radix evictable tokens must
  match, and acquire must refuse exactly the plans something was evicted from since they were
  made (holding nothing then).
* LRU: each eviction takes the least recently used unheld item (brute force over the entries
  and the tree's leaves; across both indexes for Planner.evict).
* the KV pool: every slot's count equals the references open sequences and both indexes hold
  (``KVPool.check``), and once everything is finished and evicted every slot is free again.

``IRMINSUL_FUZZ_SEEDS`` / ``IRMINSUL_FUZZ_STEPS`` run more seeds / longer sequences locally.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from irminsul.cache.cdc import Fingerprinter, namespace_seed, tiled_window_fingerprints
from irminsul.cache.plan import Commit, Plan
from irminsul.cache.planner import HEAD_TOKENS, Planner
from irminsul.cache.radix import RadixNode
from irminsul.cache.registry import ChunkEntry
from irminsul.config import ALGORITHM1, CacheConfig
from irminsul.engine.kv_pool import KVPool, PoolExhausted, unpack

SEEDS = int(os.environ.get("IRMINSUL_FUZZ_SEEDS", "10"))
STEPS = int(os.environ.get("IRMINSUL_FUZZ_STEPS", "900"))
NAMESPACES = (namespace_seed("fuzz"), namespace_seed("fuzz", "tenant-a"),
              namespace_seed("fuzz", "tenant-b"))

# Planner configurations the seeds cycle through: the engine's default, the paper's algorithm,
# and the probes switched off one at a time (each takes a different code path to a hit).
CONFIGS: list[tuple[CacheConfig, bool]] = [  # (config, pic)
    (CacheConfig(), True),
    (ALGORITHM1, True),
    (CacheConfig(regions=False, s1_window=64), True),
    (CacheConfig(head_probe=False, s1_extend=False), True),
    (CacheConfig(s1=False, capacity=2500), True),
    (CacheConfig(capacity=1800), True),
    (CacheConfig(), False),  # exact prefix only
]


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------


class _Node:
    """One stored token of the shadow trie."""

    __slots__ = ("children", "handle", "exact", "parent", "token", "dead")

    def __init__(self, parent: _Node | None, token: int, handle: int, exact: bool) -> None:
        self.children: dict[int, _Node] = {}
        self.parent, self.token, self.handle, self.exact = parent, token, handle, exact
        self.dead = False


class ShadowTrie:
    """What the radix tree must hold: a plain per-token trie per namespace."""

    def __init__(self) -> None:
        self.roots: dict[int, _Node] = {}
        self.by_handle: dict[int, _Node] = {}
        self.size = 0

    def _root(self, ns: int) -> _Node:
        return self.roots.setdefault(ns, _Node(None, -1, -1, True))

    def walk(self, ns: int, tokens: list[int]) -> list[_Node]:
        """The nodes of the longest stored prefix of ``tokens``."""
        node, path = self._root(ns), []
        for t in tokens:
            node = node.children.get(t)
            if node is None:
                break
            path.append(node)
        return path

    def match(self, ns: int, tokens: list[int]) -> tuple[int, list[int], int]:
        """(length, handles, exact rows) of the longest stored prefix."""
        path = self.walk(ns, tokens)
        exact = next((i for i, n in enumerate(path) if not n.exact), len(path))
        return len(path), [n.handle for n in path], exact

    def insert(self, ns: int, tokens: list[int], handles: list[int], exact: int | None) -> int:
        """Insert like the radix tree (present tokens keep their handles); how many were
        present."""
        path = self.walk(ns, tokens)
        node = path[-1] if path else self._root(ns)
        for i in range(len(path), len(tokens)):
            assert handles[i] not in self.by_handle, "one handle stored at two places"
            child = _Node(node, tokens[i], handles[i], exact is None or i < exact)
            node.children[tokens[i]] = child
            self.by_handle[handles[i]] = child
            node = child
            self.size += 1
        return len(path)

    def evict_edge(self, handles: np.ndarray, held: set[int]) -> None:
        """Remove an edge the tree evicted: a chain of nodes, the deepest a leaf, none held."""
        hs = handles.tolist()
        for i in range(len(hs) - 1, -1, -1):
            node = self.by_handle.pop(hs[i])
            assert not node.children, "the radix tree evicted a node that still has children"
            assert id(node) not in held, "the radix tree evicted a locked prefix"
            if i:
                assert node.parent is not None and node.parent.handle == hs[i - 1], (
                    "an evicted edge is not one chain of tokens")
            assert node.parent is not None
            del node.parent.children[node.token]
            node.dead = True
            self.size -= 1


@dataclass
class EntryRecord:
    """What the reference knows of a registry entry (copies, so a change to it shows)."""

    entry: ChunkEntry
    content: bytes
    handles: np.ndarray
    p_source: int


@dataclass(eq=False)  # compared by identity (list.remove)
class PlanRecord:
    """A plan and what the reference knows about it."""

    plan: Plan
    resets: list[int]
    prefix_node: _Node | None  # the shadow node of its last prefix token, when it has one
    holds: int = 0
    committed: bool = False
    path: list[_Node] = field(default_factory=list)  # shadow nodes its holds lock


@dataclass(eq=False)
class OpenSeq:
    """A committed prompt whose rows a request still holds (one reference per handle)."""

    tokens: np.ndarray
    handles: np.ndarray
    namespace: int
    exact: int | None
    resets: list[int]
    sources: list[tuple[ChunkEntry, int]]  # entries its prompt reused whole, and where


def _fp(tokens: np.ndarray, ns: int) -> int:
    """The fingerprint of ``tokens`` in namespace ``ns`` (xxHash64 seeded with it)."""
    return Fingerprinter(tokens, ns)(0, tokens.size)


# ---------------------------------------------------------------------------------------------
# The fuzzer
# ---------------------------------------------------------------------------------------------


class CacheFuzz:
    """One seeded run: the system under test, its references, and the operations."""

    def __init__(self, seed: int) -> None:
        self.rng = rng = np.random.default_rng(seed)
        config, pic = CONFIGS[seed % len(CONFIGS)]
        if rng.random() < 0.3 and config.capacity is None:
            config = replace(config, capacity=int(rng.choice([1200, 3000])))
        self.config, self.pic = config, pic
        self.planner = Planner(config, pic=pic)
        # Live-style commits share the hit's c_KV slots (as the engine's reuse stretch does).
        self.share = bool(rng.random() < 0.7)
        slots = int(rng.choice([2600, 4000, 7000]))
        self.pool = KVPool(1, slots, 1, 1, num_kr_slots=slots + int(rng.choice([0, 1500])))
        self.vocab = int(rng.choice([129280, 5000]))
        self.docs = [rng.integers(0, self.vocab, int(rng.integers(20, 500)))
                     for _ in range(int(rng.integers(3, 7)))]
        self.headers = [rng.integers(0, self.vocab, int(n)) for n in
                        rng.choice([0, 5, 20, 31, 32, 33, 50, 70], size=4)]
        self.trie = ShadowTrie()
        self.entries: dict[int, EntryRecord] = {}
        self.locks: dict[int, int] = {}  # id(entry) -> holds
        self.origin: dict[int, tuple[int, int, int]] = {}  # handle -> (ns, token, position)
        self.plans: list[PlanRecord] = []
        self.open: list[OpenSeq] = []
        # Sequences remembered: tokens, namespace, resets, the entries they reused whole.
        self.history: list[tuple[np.ndarray, int, list[int], list[tuple[ChunkEntry, int]]]] = []
        self.planned: list[tuple[np.ndarray, list[int], int]] = []  # the latest prompts planned
        self.stats = dict(hits=0, prefix=0, stale=0, evicted=0, pool_full=0, healed=0)
        self._instrument()

    # -- instrumentation: what each index evicted, checked against a brute-force LRU --------

    def _instrument(self) -> None:
        radix, registry = self.planner.radix, self.planner.registry
        self.radix_log: list[np.ndarray] = []
        self.registry_log: list[np.ndarray] = []
        self.across = False  # inside Planner.evict: one timeline over both indexes
        radix_evict, registry_evict = radix.evict, registry.evict

        def leaves() -> list[RadixNode]:
            out, stack = [], list(radix.roots().values())
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                if node.parent is not None and not node.children and node.lock_ref == 0:
                    out.append(node)
            return out

        def unheld() -> list[ChunkEntry]:
            return sorted((e for e in registry.entries() if e.refcount == 0),
                          key=lambda e: e.last_use)

        def on_radix(n: int) -> list[np.ndarray]:
            candidates = leaves()
            oldest = min(candidates, key=lambda v: v.last_access, default=None)
            if self.across and oldest is not None:
                others = unheld()
                # Planner.evict must take the older of the two indexes' oldest items.
                assert not others or oldest.last_access < others[0].last_use, "not LRU across"
            out = radix_evict(n)
            if out:
                assert oldest is not None and out[0] is oldest.value, "radix did not evict LRU"
            self.radix_log.extend(out)
            return out

        def on_registry(n: int) -> list[np.ndarray]:
            order = unheld()
            if self.across and order:
                oldest = min((v.last_access for v in leaves()), default=None)
                assert oldest is None or order[0].last_use < oldest, "not LRU across indexes"
            out = registry_evict(n)
            assert [id(h) for h in out] == [id(e.handles) for e in order[:len(out)]], (
                "registry did not evict least recently used unheld entries first")
            self.registry_log.extend(out)
            return out

        radix.evict, registry.evict = on_radix, on_registry  # instance attributes: test-only

    # -- prompts ---------------------------------------------------------------------------

    def make_prompt(self) -> tuple[np.ndarray, list[int], int]:
        rng, vocab = self.rng, self.vocab
        ns = NAMESPACES[int(rng.choice(3, p=[0.6, 0.25, 0.15]))]
        r = rng.random()
        if self.planned and r < 0.12:  # a fork of a recent prompt: same context, new ending
            base, base_resets, base_ns = self.planned[int(rng.integers(len(self.planned)))]
            cut = int(rng.integers(base.size // 2, base.size + 1))
            tokens = np.concatenate([base[:cut], rng.integers(0, vocab, int(rng.integers(1, 40)))])
            return tokens, [x for x in base_resets if x <= cut] + [cut], base_ns
        r = rng.random()
        if self.history and r < 0.35:
            base, base_ns, base_resets, _ = self.history[int(rng.integers(len(self.history)))]
            if r < 0.15:  # a follow-up turn: exact prefix
                extra = rng.integers(0, vocab, int(rng.integers(1, 40)))
                tokens = np.concatenate([base, extra])
                resets = base_resets + [base.size]
            elif r < 0.25:  # resent as it was, in its namespace or (cross-tenant) another
                tokens, resets = base.copy(), list(base_resets)
            else:  # one early token changed: everything after it moves out of the prefix
                tokens, resets = base.copy(), list(base_resets)
                at = int(rng.integers(0, min(60, tokens.size)))
                tokens[at] = (tokens[at] + 1) % vocab
            ns = base_ns if rng.random() < 0.7 else ns
            return tokens[:1500], [x for x in resets if x <= min(1500, tokens.size)], ns
        parts: list[np.ndarray] = []
        if rng.random() < 0.6:
            parts.append(self.headers[int(rng.integers(len(self.headers)))])
        else:
            parts.append(rng.integers(0, vocab, int(rng.choice([0, 3, 31, 32, 33, 45]))))
        resets: list[int] = []
        for j in rng.permutation(len(self.docs))[:int(rng.integers(1, 4))].tolist():
            doc = self.docs[j].copy()
            if rng.random() < 0.2:  # cut short: the head probe's case
                doc = doc[:max(1, int(doc.size * rng.uniform(0.3, 0.9)))]
            if rng.random() < 0.15 and doc.size > 80:  # edited inside: S1 windows' case
                doc[int(rng.integers(doc.size))] = int(rng.integers(vocab))
            at = sum(p.size for p in parts)
            if rng.random() < 0.8:
                resets.append(at)
                if rng.random() < 0.4 and doc.size > 2:  # a document of two messages: a run
                    resets.append(at + doc.size // 2)
            parts.append(doc)
            if rng.random() < 0.3:
                parts.append(rng.integers(0, vocab, int(rng.integers(1, 9))))
        parts.append(rng.integers(0, vocab, int(rng.integers(0, 30))))
        tokens = np.concatenate(parts).astype(np.int64)
        if tokens.size == 0:
            tokens = rng.integers(0, vocab, 5)
        return tokens, sorted(set(x for x in resets if 0 < x <= tokens.size)), ns

    # -- bookkeeping of references ----------------------------------------------------------

    def held_nodes(self) -> set[int]:
        return {id(n) for rec in self.plans if rec.holds for n in rec.path}

    def alloc(self, n: int, ns: int, tokens: np.ndarray, start: int) -> np.ndarray:
        handles = self.pool.alloc(n)
        for i, h in enumerate(handles.tolist()):
            self.origin[h] = (ns, int(tokens[start + i]), start + i)
        return handles

    def apply(self, commit: Commit) -> None:
        """The commit's references into the pool, as the engine's cache manager does."""
        if commit.held:
            self.pool.retain(np.concatenate(commit.held))
        if commit.freed:
            self.pool.release(np.concatenate(commit.freed))

    def absorb_evictions(self) -> None:
        """Move what the indexes just evicted (logged) into the references."""
        held = self.held_nodes()
        for handles in self.radix_log:
            self.trie.evict_edge(handles, held)
        self.stats["evicted"] += len(self.radix_log) + len(self.registry_log)
        self.radix_log = []
        logged = {id(h) for h in self.registry_log}
        self.registry_log = []
        live = {id(e) for e in self.planner.registry.entries()}
        for key in [k for k in self.entries if k not in live]:
            rec = self.entries.pop(key)
            assert id(rec.entry.handles) in logged, "an entry left the registry unreported"
            assert not self.locks.get(key), "a held registry entry was evicted"
            assert not rec.entry.registered, "an evicted entry still says registered"
            self.locks.pop(key, None)

    def evict(self, n: int) -> list[np.ndarray]:
        """Planner.evict with the references updated and the pool given the slots back."""
        self.across = True
        try:
            freed = self.planner.evict(n)
        finally:
            self.across = False
        self.absorb_evictions()
        if freed:
            self.pool.release(np.concatenate(freed))
        if sum(h.size for h in freed) < n:  # it stops early only when nothing unheld is left
            assert self.planner.radix.evictable_tokens == 0
            assert all(e.refcount for e in self.planner.registry.entries())
        return freed

    def make_room(self, ckv: int, kr: int) -> bool:
        """Evict until the pool has the slots, as CacheManager.make_room; False if it cannot."""
        pool = self.pool
        while pool.ckv_slots.free < ckv or pool.kr_slots.free < kr:
            short = max(ckv - pool.ckv_slots.free, kr - pool.kr_slots.free)
            if not self.evict(short):
                self.stats["pool_full"] += 1
                return False
        return True

    # -- checks ---------------------------------------------------------------------------

    def check_plan(self, plan: Plan, tokens: np.ndarray, ns: int) -> None:
        """A fresh plan against the references (the planner is read-only here)."""
        n, toks = tokens.size, tokens.tolist()
        pos = 0
        for s in plan.segments:  # covers [0, n) once, in order, nothing empty
            assert s.start == pos and s.end > s.start, (s, pos)
            pos = s.end
        assert pos == n
        for a, b in zip(plan.segments, plan.segments[1:]):
            assert not (a.kind == "miss" and b.kind == "miss"), "misses not merged"
        # The prefix: the brute-force longest stored prefix in this namespace, its handles and
        # its exact rows.
        length, handles, exact = self.trie.match(ns, toks)
        L = plan.prefix.length
        assert L == length, f"prefix {L}, shadow trie {length}"
        assert plan.prefix.handles.tolist() == handles
        assert plan.prefix.exact == exact
        assert (plan.segments[0].kind == "prefix") == (L > 0)
        for i, h in enumerate(handles):
            assert self.origin[h] == (ns, toks[i], i), "a prefix row is not this token's here"
        # Content registered in this namespace, brute force (not through the fingerprint index).
        registered = {rec.content for rec in self.entries.values() if rec.entry.namespace == ns}
        for s in plan.segments:
            if s.kind == "prefix":
                continue
            assert s.start >= L
            if s.kind != "hit":
                continue
            self.stats["hits"] += s.size
            e = s.entry
            assert s.start >= self.config.carve_out, "reuse below the carve-out"
            rec = self.entries.get(id(e))
            assert rec is not None and rec.entry is e and e.registered, "served an evicted entry"
            assert e.namespace == ns, "a hit crossed namespaces"
            assert 0 <= s.offset and s.offset + s.size <= e.size
            assert e.tokens[s.offset:s.offset + s.size].tolist() == toks[s.start:s.end]
            for j, h in enumerate(e.handles[s.offset:s.offset + s.size].tolist()):
                src_ns, token, p = self.origin[h]
                # The reused row holds this very token, in this namespace, where the entry says.
                assert (src_ns, token, p) == (ns, toks[s.start + j], e.p_source + s.offset + j)
            assert s.delta == s.start - (e.p_source + s.offset)
        if not self.pic:
            assert [s.kind for s in plan.segments[1 if L else 0:]] in ([], ["miss"])
            return
        for c in plan.chunks:
            assert (c.kind == "carve_out") == (c.start < self.config.carve_out)
            content = tokens[c.start:c.end].astype(np.int64).tobytes()
            if c.kind == "miss":  # recall: a whole chunk registered here is never missed
                assert content not in registered, "a registered chunk was missed"
            elif c.kind == "hit":
                assert content in registered

    def check_tree(self) -> None:
        """The radix tree holds exactly the shadow trie: every stored token with its handle,
        and whether its row counts as exact (it and every row before it on its path are), read
        off the tree's edges without matching (which would split and touch them)."""
        stored = 0
        for ns, root in self.planner.radix.roots().items():
            shadow = self.trie.roots.get(ns) or _Node(None, -1, -1, True)
            # (radix node, shadow node at its end, exact so far: per the tree, per the shadow)
            stack: list[tuple[RadixNode, _Node, bool, bool]] = [(root, shadow, True, True)]
            while stack:
                node, at, ok, shadow_ok = stack.pop()
                for child in node.children.values():
                    here, edge_ok, edge_shadow_ok = at, ok, shadow_ok
                    for j, (token, handle) in enumerate(zip(child.key.tolist(),
                                                            child.value.tolist())):
                        here = here.children.get(token)
                        assert here is not None, "the radix tree holds a token the shadow does not"
                        assert here.handle == handle, "a stored token's handle differs"
                        edge_ok = edge_ok and j < child.exact
                        edge_shadow_ok = edge_shadow_ok and here.exact
                        assert edge_ok == edge_shadow_ok, "a stored row's exactness differs"
                        stored += 1
                    stack.append((child, here, edge_ok, edge_shadow_ok))
        assert stored == self.trie.size, "the shadow holds tokens the radix tree does not"

    def check_state(self) -> None:
        """Everything the references know, after every operation."""
        planner, registry = self.planner, self.planner.registry
        planner.radix.check_integrity()
        self.check_tree()
        assert planner.radix.total_tokens == self.trie.size
        assert planner.radix.evictable_tokens == self.trie.size - len(self.held_nodes())
        live = registry.entries()
        assert {id(e) for e in live} == set(self.entries), "registry and reference differ"
        assert registry.num_entries == len(live)
        assert registry.total_tokens == sum(e.size for e in live)
        seen: set[tuple[int, bytes]] = set()
        for e in live:
            rec = self.entries[id(e)]
            assert rec.entry is e and e.registered
            assert e.content == rec.content and np.array_equal(e.handles, rec.handles), (
                "a registered entry changed")
            assert e.p_source == rec.p_source >= self.config.carve_out
            assert e.refcount == self.locks.get(id(e), 0), "entry refcount != holds"
            assert e.fingerprint == _fp(e.tokens, e.namespace), "fingerprint is not its content's"
            assert (e.namespace, e.content) not in seen, "the same content registered twice"
            seen.add((e.namespace, e.content))
            if e.run is not None and e.run.registered:  # an evicted run is never followed
                assert id(e.run) in self.entries
                assert e.run.content[8 * e.run_offset:8 * e.run_offset + len(e.content)] == (
                    e.content), "a region is not where its run says"
        for ns in NAMESPACES:
            for held in registry.window_table(ns).values():
                for entry, _ in ([held] if isinstance(held, tuple) else held):
                    assert entry.registered and id(entry) in self.entries, "window of dead entry"
        self.pool.check([s.handles for s in self.open] + planner.references())

    # -- operations -----------------------------------------------------------------------

    def op_plan(self) -> None:
        tokens, resets, ns = self.make_prompt()
        plan = self.planner.plan(tokens, resets, namespace=ns)
        self.check_plan(plan, tokens, ns)
        path = self.trie.walk(ns, tokens.tolist())[:plan.prefix.length]
        self.plans.append(PlanRecord(plan, resets, path[-1] if path else None))
        self.planned = (self.planned + [(tokens, resets, ns)])[-8:]
        self.stats["prefix"] += plan.prefix.length

    def op_acquire(self) -> None:
        candidates = [r for r in self.plans if not r.committed]
        if not candidates:
            return
        rec = candidates[int(self.rng.integers(len(candidates)))]
        plan = rec.plan
        # Reference: refused exactly when something it reuses was evicted since it was made.
        stale = (any(id(e) not in self.entries or self.entries[id(e)].entry is not e
                     for e in plan.reused())
                 or (rec.prefix_node is not None and rec.prefix_node.dead))
        if stale:
            with pytest.raises(ValueError):
                self.planner.acquire(plan)
            self.stats["stale"] += 1
            if not rec.holds:
                self.plans.remove(rec)
            return
        self.planner.acquire(plan)
        rec.holds += 1
        rec.path = self.trie.walk(plan.namespace, plan.tokens.tolist())[:plan.prefix.length]
        for e in plan.reused():
            self.locks[id(e)] = self.locks.get(id(e), 0) + 1

    def _release(self, rec: PlanRecord) -> None:
        self.planner.release(rec.plan)
        rec.holds -= 1
        for e in rec.plan.reused():
            self.locks[id(e)] -= 1
        if not rec.holds and (rec.committed or self.rng.random() < 0.5):
            self.plans.remove(rec)

    def op_release(self) -> None:
        held = [r for r in self.plans if r.holds]
        if held:
            self._release(held[int(self.rng.integers(len(held)))])

    def op_commit(self) -> None:
        held = [r for r in self.plans if r.holds and not r.committed]
        if not held:
            return
        rec = held[int(self.rng.integers(len(held)))]
        plan, pool = rec.plan, self.pool
        tokens, ns, n, L = plan.tokens, plan.namespace, plan.tokens.size, plan.prefix.length
        # Some requests compute what they could reuse (their rows are then exact): their
        # branches can hang exact off another request's reused rows.
        share = self.share and self.rng.random() < 0.8
        shared = sum(s.size for s in plan.hits) if share else 0
        if not self.make_room(n - L - shared, n - L):
            self._release(rec)  # the engine would wait, its plan dropped
            return
        pieces, exact = [plan.prefix.handles], None
        pool.retain(plan.prefix.handles)  # the sequence's own references to its prefix rows
        if plan.prefix.exact < L:
            exact = plan.prefix.exact
        for s in plan.segments:
            if s.kind == "prefix":
                continue
            if s.kind == "hit" and share:
                ckv, _ = unpack(s.entry.handles[s.offset:s.offset + s.size])
                handles = pool.alloc_kr(ckv)  # c_KV shared, k_r of its own
                for j, h in enumerate(handles.tolist()):
                    self.origin[h] = (ns, int(tokens[s.start + j]), s.start + j)
                exact = s.start if exact is None else min(exact, s.start)
            else:
                handles = self.alloc(s.size, ns, tokens, s.start)
            pieces.append(handles)
        handles = np.concatenate(pieces).astype(np.int64)
        present = self.trie.match(ns, tokens.tolist())[0]
        before = set(self.entries)
        commit = self.planner.commit(plan, handles, exact)
        # The radix tree took the prompt: exactly the tokens not present before, with the
        # commit's handles (the last held array says which).
        assert self.trie.insert(ns, tokens.tolist(), handles.tolist(), exact) == present
        assert np.array_equal(commit.held[-1], handles[present:])
        self.check_new_entries(plan, handles, before)
        self.absorb_evictions()
        self.apply(commit)
        capacity, registry, radix = self.config.capacity, self.planner.registry, self.planner.radix
        if capacity is not None:  # evicted down to capacity, or as far as the holds allow
            assert registry.total_tokens <= capacity or all(e.refcount for e in registry.entries())
            assert radix.total_tokens <= capacity or radix.evictable_tokens == 0
        rec.committed = True
        self._release(rec)
        whole = [(h.entry, h.start) for h in plan.hits
                 if h.offset == 0 and h.size == h.entry.size]
        self.open.append(OpenSeq(tokens, handles, ns, exact, rec.resets, whole))

    def check_new_entries(self, plan: Plan, handles: np.ndarray, before: set[int]) -> None:
        """New registry entries are exactly this plan's missed chunks, regions and runs of
        regions, registered at their positions with the commit's handles."""
        tokens, ns = plan.tokens, plan.namespace
        missed = {(c.start, c.end) for c in plan.chunks if c.kind == "miss"}
        regions = sorted((r.start, r.end) for r in plan.regions)
        # Runs: two or more consecutive regions, each ending where the next starts.
        runs = set()
        for i in range(len(regions)):
            for j in range(i + 1, len(regions)):
                if regions[j][0] != regions[j - 1][1]:
                    break
                runs.add((regions[i][0], regions[j][1]))
        for e in self.planner.registry.entries():
            if id(e) in before:
                continue
            span = (e.p_source, e.p_source + e.size)
            assert span in missed or span in regions or span in runs, f"unexpected entry {span}"
            assert e.namespace == ns and e.content == tokens[span[0]:span[1]].astype(
                np.int64).tobytes()
            assert np.array_equal(e.handles, handles[span[0]:span[1]])
            self.entries[id(e)] = EntryRecord(e, e.content, e.handles.copy(), e.p_source)
        if self.config.capacity is None:  # nothing evicted by capacity: every miss is in now
            registered = {(r.entry.namespace, r.content) for r in self.entries.values()}
            for a, b in missed | set(regions):
                assert (ns, tokens[a:b].astype(np.int64).tobytes()) in registered, (
                    "a missed chunk was not registered")

    def op_finish(self) -> None:
        if not self.open:
            return
        seq = self.open.pop(int(self.rng.integers(len(self.open))))
        tokens, handles = seq.tokens, seq.handles
        k = int(self.rng.integers(0, 7))
        if k and self.make_room(k, k):  # decoded tokens: fresh rows at the end
            out = self.rng.integers(0, self.vocab, k)
            tokens = np.concatenate([tokens, out])
            more = self.alloc(k, seq.namespace, tokens, seq.tokens.size)
            handles = np.concatenate([handles, more])
        if self.rng.random() < 0.75:
            present = self.trie.match(seq.namespace, tokens.tolist())[0]
            commit = self.planner.remember(tokens, handles, seq.namespace, seq.exact)
            assert self.trie.insert(seq.namespace, tokens.tolist(), handles.tolist(),
                                    seq.exact) == present
            assert len(commit.held) == 1 and np.array_equal(commit.held[0], handles[present:])
            self.absorb_evictions()
            self.apply(commit)
            self.history.append((tokens, seq.namespace, seq.resets, seq.sources))
        self.pool.release(handles)

    def op_evict(self) -> None:
        # Now and then everything evictable: whatever is held must be all that is left.
        self.evict(int(self.rng.choice([1, 50, 400, 3000, 1 << 40], p=[.25, .25, .2, .2, .1])))

    def op_lookup(self) -> None:
        """Chunk, window and head lookups of registered content, in its namespace and in the
        others, against a brute-force scan of the reference."""
        if not self.entries:
            return
        rng, registry = self.rng, self.planner.registry
        rec = list(self.entries.values())[int(rng.integers(len(self.entries)))]
        e = rec.entry
        tokens = e.tokens.copy()
        by_content = {(r.entry.namespace, r.content): r.entry for r in self.entries.values()}
        assert registry.lookup(e.namespace, e.fingerprint, tokens) is e
        for ns in NAMESPACES:  # in every namespace: only that namespace's own entry
            want = by_content.get((ns, rec.content))
            assert registry.lookup(ns, _fp(tokens, ns), tokens) is want, "namespaces mixed"
            if ns != e.namespace:  # not even under this entry's own fingerprint
                assert registry.lookup(ns, e.fingerprint, tokens) is None, "namespaces mixed"
        if tokens.size > 1:
            changed = tokens.copy()
            changed[int(rng.integers(changed.size))] += 1
            got = registry.lookup(e.namespace, _fp(changed, e.namespace), changed)
            assert got is by_content.get((e.namespace, changed.tobytes()))
            # A fingerprint of other tokens never serves this entry: contents are verified.
            assert registry.lookup(e.namespace, e.fingerprint, changed) is None
        w = registry.window
        if e.window_keys:  # registered with probes: each whole tile is findable
            tile = int(rng.integers(len(e.window_keys)))
            window = tokens[tile * w:(tile + 1) * w]
            for ns in NAMESPACES:
                fp = int(tiled_window_fingerprints(window, w, seed=ns)[0])
                hit = registry.lookup_window(ns, fp, window)
                if ns == e.namespace:
                    assert hit is not None
                if hit is not None:
                    assert hit.entry.namespace == ns and id(hit.entry) in self.entries
                    assert hit.entry.tokens[hit.offset:hit.offset + hit.size].tolist() == (
                        window.tolist())
        if e.head_key is not None:
            for ns in NAMESPACES:
                hit = registry.lookup_head(ns, tokens)
                if ns == e.namespace:
                    assert hit is not None, "a registered head was not found"
                if hit is None:
                    continue
                assert hit.entry.namespace == ns and id(hit.entry) in self.entries
                assert HEAD_TOKENS <= hit.size and hit.offset == 0
                assert hit.entry.tokens[:hit.size].tolist() == tokens[:hit.size].tolist()

    def op_match(self) -> None:
        """A bare prefix match of something near stored content, in a random namespace."""
        if not self.history:
            return
        rng = self.rng
        tokens = self.history[int(rng.integers(len(self.history)))][0]
        tokens = tokens[:int(rng.integers(0, tokens.size + 1))].copy()
        if tokens.size and rng.random() < 0.5:
            tokens[int(rng.integers(tokens.size))] += 1
        ns = NAMESPACES[int(rng.integers(3))]
        m = self.planner.radix.match_prefix(tokens, ns)
        length, handles, exact = self.trie.match(ns, tokens.tolist())
        assert (m.length, m.handles.tolist(), m.exact) == (length, handles, exact)

    def op_heal(self) -> None:
        """Recompute a remembered sequence's inexact rows (Planner.heal_plan / healed), as the
        engine does when idle: the new rows replace the old in both indexes."""
        if not self.history:
            return
        if any(r.holds for r in self.plans):  # the engine heals only when nothing else runs
            if self.rng.random() < 0.3:
                return
            for rec in list(self.plans):  # the prefills in flight give up
                while rec.holds:
                    self._release(rec)
        planner, trie, pool = self.planner, self.trie, self.pool
        # Mostly a sequence with inexact rows (the engine queues only those); else any.
        inexact = [h for h in self.history
                   if trie.match(h[1], h[0].tolist())[2] < trie.match(h[1], h[0].tolist())[0]]
        pick = inexact if inexact and self.rng.random() < 0.8 else self.history
        tokens, ns, _, sources = pick[int(self.rng.integers(len(pick)))]
        length, _, exact = trie.match(ns, tokens.tolist())
        plan = planner.heal_plan(tokens, ns)
        if exact >= length:  # reference: exact throughout (or nothing stored): nothing to heal
            assert plan is None
            return
        assert plan is not None and plan.tokens.tolist() == tokens[:length].tolist()
        assert [(g.kind, g.start, g.end) for g in plan.segments] == (
            [("prefix", 0, exact)] if exact else []) + [("miss", exact, length)]
        n = length - exact
        if pool.ckv_slots.free < n or pool.kr_slots.free < n:
            return  # a heal never evicts
        # Unheld plans would keep handles the heal replaces: the engine never keeps one.
        self.plans = []
        planner.acquire(plan)
        fresh = self.alloc(n, ns, tokens, exact)
        handles = np.concatenate([plan.prefix.handles, fresh]).astype(np.int64)
        path = trie.walk(ns, tokens[:length].tolist())
        replaced = {node.handle: int(h) for node, h in zip(path[exact:], fresh.tolist())}
        commit = planner.healed(plan, handles, sources)
        planner.release(plan)
        # Reference: the path holds the new rows and is exact; what branches off it from the
        # first replaced row on was computed over old rows, so it is not exact from its start.
        for p, node in enumerate(path):
            node.exact = True
            if p >= exact:
                del trie.by_handle[node.handle]
                node.handle = replaced[node.handle]
                trie.by_handle[node.handle] = node
                below = path[p + 1] if p + 1 < len(path) else None
                for child in node.children.values():
                    if child is not below:
                        child.exact = False
        assert trie.match(ns, tokens.tolist())[2] == length
        # Every registry entry holding a replaced row holds the new one; each entry the
        # sequence reused whole and still registered here moves to the path's rows.
        for rec in self.entries.values():
            rec.handles = np.array([replaced.get(h, h) for h in rec.handles.tolist()],
                                   dtype=np.int64)
        for entry, at in sources:
            rec = self.entries.get(id(entry))
            end = at + entry.size
            if (rec is not None and rec.entry is entry and entry.namespace == ns
                    and end <= length and tokens[at:end].astype(np.int64).tobytes()
                    == entry.content):
                rec.handles, rec.p_source = handles[at:end].copy(), at
        self.apply(commit)
        pool.release(fresh)  # the heal's own references to the rows it computed
        self.stats["healed"] += n

    OPS: dict[str, float] = dict(plan=0.24, acquire=0.17, commit=0.2, release=0.04, finish=0.13,
                                 evict=0.05, lookup=0.08, match=0.07, heal=0.06)

    def run(self, steps: int) -> None:
        names = list(self.OPS)
        weights = np.array(list(self.OPS.values()))
        ops: dict[str, Callable[[], None]] = {name: getattr(self, f"op_{name}") for name in names}
        self.check_state()
        for step in range(steps):
            name = names[int(self.rng.choice(len(names), p=weights / weights.sum()))]
            try:
                ops[name]()
                self.check_state()
            except (AssertionError, ValueError, PoolExhausted) as err:
                raise AssertionError(f"step {step} ({name}): {err}") from err
        self.drain()

    def drain(self) -> None:
        """Release every hold, finish every sequence, evict everything: every slot is free."""
        for rec in list(self.plans):
            while rec.holds:
                self._release(rec)
        self.plans = []
        while self.open:
            self.op_finish()
        self.check_state()
        self.evict(1 << 40)
        self.check_state()
        assert self.trie.size == 0 and self.planner.radix.total_tokens == 0
        assert self.planner.registry.num_entries == 0 and self.planner.registry.total_tokens == 0
        pool = self.pool
        assert pool.ckv_slots.free == pool.num_slots and pool.kr_slots.free == pool.num_kr_slots
        assert not pool.ckv_slots.refs[:pool.num_slots].any()
        assert not pool.kr_slots.refs[:pool.num_kr_slots].any()


@pytest.mark.parametrize("seed", range(SEEDS))
def test_cache_operations_against_references(seed: int) -> None:
    """Random operations over three namespaces; every step checked against the references."""
    fuzz = CacheFuzz(seed)
    fuzz.run(STEPS)
    # The run exercised what it is about (not a vacuous pass): prefix reuse, evictions, plans
    # refused as stale, and (with PIC on) hits.
    assert fuzz.stats["prefix"] > 0 and fuzz.stats["evicted"] > 0 and fuzz.stats["stale"] > 0
    assert fuzz.stats["hits"] > 0 or not fuzz.pic
