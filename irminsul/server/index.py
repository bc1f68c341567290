"""The server's published index (``GET /irminsul/index``): what routers read to send a request
to the replica that holds its content (the format is :mod:`irminsul.router.digest`'s).

The radix tree and the registry belong to the engine thread, so a poll takes their shape there
(the tree's edges by reference, the registry's fingerprints: work per node and per entry, not
per token; edges are never changed in place, only replaced) and hashes the tree's blocks on a
worker thread. Polls while the engine has neither stepped (a step that raised counts: it may
have evicted before it did), applied an abort (which remembers a request between steps) nor
run idle work (an audit's recomputation evicts to make room) reuse the last digest; the last
few versions are kept so that a router a version or two behind gets only the difference.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..cache.planner import Planner
from ..engine import Scheduler
from ..router.digest import BLOCK_TOKENS, Chunking, Digest, Load, chain_hashes, public
from .async_engine import AsyncEngine

HISTORY = 3  # versions kept to answer with a difference

Tree = tuple[int, list[tuple[int, np.ndarray]]]  # namespace, edges (parent edge's index, tokens)


@dataclass(frozen=True)
class _Sets:
    prefix: frozenset[int]
    chunks: frozenset[int]


def read_planner(planner: Planner) -> tuple[list[Tree], list[int], Chunking]:
    """On the planner's thread: every namespace's edges, parents before children, every
    registry fingerprint as published (:func:`~irminsul.router.digest.public`), and how the
    planner chunks."""
    trees = []
    for namespace, root in planner.radix.roots().items():
        edges: list[tuple[int, np.ndarray]] = []
        stack = [(root, -1)]
        while stack:
            node, index = stack.pop()
            for child in node.children.values():
                edges.append((index, child.key))
                stack.append((child, len(edges) - 1))
        trees.append((namespace, edges))
    fingerprints = [public(entry.fingerprint) for entry in planner.registry.entries()]
    c = planner.config
    return trees, fingerprints, Chunking(c.mask_bits, c.min_chunk, c.max_chunk, c.carve_out,
                                         c.regions and planner.pic)


def _read(scheduler: Scheduler) -> tuple[list[Tree], list[int], Chunking]:
    return read_planner(scheduler.engine.cache.planner)


def prefix_set(trees: list[Tree]) -> frozenset[int]:
    """The chained block hashes of every path of the trees, as published (a worker thread's
    job)."""
    out: set[int] = set()
    empty = np.zeros(0, dtype=np.int64)
    for namespace, edges in trees:
        # per edge: the tokens past its path's last whole block, and that block's hash
        states: list[tuple[np.ndarray, int]] = []
        for parent, key in edges:
            carry, h = states[parent] if parent >= 0 else (empty, namespace)
            tokens = np.concatenate([carry, key]) if carry.size else key
            hashes = chain_hashes(tokens, h)
            out.update(map(public, hashes))
            states.append((tokens[len(hashes) * BLOCK_TOKENS:], hashes[-1] if hashes else h))
    return frozenset(out)


class IndexPublisher:
    """Answers ``/irminsul/index`` polls for one engine."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.generation = secrets.token_hex(8)  # a restarted server is another generation
        self.version = 0
        self._versions: OrderedDict[int, _Sets] = OrderedDict({0: _Sets(frozenset(),
                                                                         frozenset())})
        self._chunking: Chunking | None = None
        # the engine's step, failed step, abort and idle run counts the latest version was
        # read at
        self._turns: tuple[int, int, int, int] | None = None
        self._lock = asyncio.Lock()

    async def digest(self, generation: str | None, since: int | None) -> Digest:
        """What changed since version ``since`` of ``generation`` (all of it when that is not
        a version this process still holds). EngineError when the engine is not running."""
        async with self._lock:
            await self._refresh()
        current = self._versions[self.version]
        base = self._versions.get(since) if generation == self.generation and since is not None \
            else None
        snap = self.engine.snapshot
        load = Load(snap.running, snap.waiting, round(snap.pool_usage, 4))
        assert self._chunking is not None
        if base is None:
            return Digest(self.generation, self.version, True, self._chunking, load,
                          set(current.prefix), set(), set(current.chunks), set())
        return Digest(self.generation, self.version, False, self._chunking, load,
                      set(current.prefix - base.prefix), set(base.prefix - current.prefix),
                      set(current.chunks - base.chunks), set(base.chunks - current.chunks))

    async def _refresh(self) -> None:
        snap = self.engine.snapshot
        # A step that raised may have made room (evicting) first; it is not among the steps.
        turns = (snap.steps, snap.step_errors, snap.aborts, snap.idle_runs)
        if turns == self._turns and self._chunking is not None:
            return  # none of those since: nothing in its indexes changed
        trees, fingerprints, self._chunking = await asyncio.wrap_future(
            self.engine.run_in_engine_thread(_read))
        sets = _Sets(await asyncio.to_thread(prefix_set, trees), frozenset(fingerprints))
        self._turns = turns
        if sets != self._versions[self.version]:
            self.version += 1
            self._versions[self.version] = sets
            while len(self._versions) > HISTORY:
                self._versions.popitem(last=False)
