"""The content registry: fingerprint -> chunk entry, the heart of position-independent reuse.

An entry records a chunk of tokens that was prefilled at position ``p_source`` together with one
opaque handle per token (the engine stores KV slot indices: the shared ``c_KV`` slots and the
``k_r`` base slots). A chunk or window lookup hashes nothing itself: callers bring the fingerprint
and the tokens (a head lookup hashes the head it is given). Every hit compares the tokens, so a
fingerprint collision can never serve the wrong content.

Keys are ``(namespace, fingerprint)``; the namespace is the fingerprint seed (model and tenant), so
content registered under one namespace is invisible to every other.

S1 sub-windows (paper Appendix G). When a chunk is registered, each whole ``window``-token slice at
offsets 0, w, 2w, ... from the chunk start is indexed too, by ``cdc.tiled_window_fingerprints``,
pointing into the chunk's entry. On a chunk miss the planner fingerprints the missed chunk's
windows at *every* offset and takes the hits left to right, so any registered window that reappears
anywhere inside a missed chunk is found, whatever the chunk boundaries around it did.

Chunk heads (``head`` > 0). Each chunk's first ``head`` tokens are indexed too. A missed chunk
whose head is registered reuses the most leading tokens it shares with such a chunk:
a chunk cut short (the prompt's last chunk ends where the prompt does, not where the content
says) or grown past a cut, a document edited near its end.

Regions (the planner's ``regions``). A whole region of a prompt (the tokens between two chunker
resets) is registered as an entry too, under its own fingerprint, without windows or head: its
handles are the region's slots in that prompt, which its chunks' entries (or the entries they were
reused from) reference as well. Consecutive regions registered by one prompt are registered as
one more entry, their run, and each region entry points into it (``run``, ``run_offset``): a later
prompt that finds a region compares its following tokens with the run's in one step and reuses as
much of the run as it holds, as one hit. The token budget counts these tokens once per entry. An
evicted entry is marked (``registered``) so that a region never leads to it.

Eviction is LRU over entries nobody holds (``refcount == 0``), to a token budget.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from .cdc import Fingerprinter, tiled_window_fingerprints

HEAD_CANDIDATES = 8  # registered chunks compared per head lookup, newest first


@dataclass(eq=False)
class ChunkEntry:
    """A registered chunk: its tokens (for verification), per-token handles and source position."""

    namespace: int
    fingerprint: int
    content: bytes  # the token ids as int64 bytes: what a hit is verified against
    handles: np.ndarray
    p_source: int
    last_use: int = 0
    refcount: int = 0
    window_keys: list[int] = field(default_factory=list)  # fingerprints of its S1 windows
    head_key: int | None = None  # fingerprint of its first ``head`` tokens, when indexed
    # The run of regions this region was registered in, and where in it this one's tokens are
    # (a hint: a hit along the run is verified against the run's own tokens).
    run: ChunkEntry | None = None
    run_offset: int = 0
    registered: bool = True  # False once evicted

    @property
    def tokens(self) -> np.ndarray:
        """The token ids (a read-only view of ``content``)."""
        return np.frombuffer(self.content, dtype=np.int64)

    @property
    def size(self) -> int:
        return len(self.content) // 8


@dataclass(frozen=True)
class WindowHit:
    """A run of a registered chunk found again (an S1 window, a head):
    ``entry.tokens[offset:offset + size]``."""

    entry: ChunkEntry
    offset: int
    size: int


# What a window fingerprint leads to: the one (entry, offset) holding it, or a list of them.
WindowHolders = tuple["ChunkEntry", int] | list[tuple["ChunkEntry", int]]


def _holders(held: WindowHolders | None) -> tuple | list:
    """The (entry, offset) pairs of a window table's value, as one sequence."""
    if held is None:
        return ()
    return (held,) if type(held) is tuple else held


def _content(tokens: np.ndarray) -> bytes:
    """Token ids as int64 bytes: the verification of a hit compares these (an order of magnitude
    faster than np.array_equal on a chunk, and every registry entry holds int64 ids)."""
    return np.asarray(tokens, dtype=np.int64).tobytes()


class Registry:
    """Fingerprint -> chunk entries, verified on every hit, LRU-evicted to ``capacity`` tokens."""

    def __init__(self, capacity: int | None = None, *, window: int = 128, head: int = 0,
                 clock: Iterator[int] | None = None) -> None:
        """``head``: leading tokens a chunk head is indexed by (0: heads not indexed);
        ``clock``: logical time shared with the radix tree (one LRU timeline for both)."""
        self.capacity = capacity
        self.window, self.head = window, head
        # namespace -> fingerprint -> entries (a list: distinct content may share a fingerprint)
        self._chunks: dict[int, dict[int, list[ChunkEntry]]] = {}
        # namespace -> window fingerprint -> (entry, offset), or a list of them: nearly every
        # window is the only one with its fingerprint, and a tuple is stored without a list
        # around it (a registered chunk's windows go in with one dict update).
        self._windows: dict[int, dict[int, WindowHolders]] = {}
        self._heads: dict[int, dict[int, list[ChunkEntry]]] = {}
        self._clock = clock if clock is not None else itertools.count(1)
        self._lru: OrderedDict[ChunkEntry, None] = OrderedDict()  # least recently used first
        self.total_tokens = 0
        self.verify_failures = 0  # fingerprint matched, tokens did not: collisions caught

    @property
    def num_entries(self) -> int:
        return len(self._lru)

    def entries(self) -> list[ChunkEntry]:
        """Every registered entry, all namespaces."""
        return [e for table in self._chunks.values() for bucket in table.values() for e in bucket]

    def lookup(self, namespace: int, fingerprint: int,
               tokens: np.ndarray | bytes) -> ChunkEntry | None:
        """The entry holding exactly ``tokens`` (or their int64 bytes) under this fingerprint,
        or None."""
        content = tokens if isinstance(tokens, bytes) else _content(tokens)
        for entry in self._chunks.get(namespace, {}).get(int(fingerprint), ()):
            if entry.content == content:
                return entry
            self.verify_failures += 1
        return None

    def window_table(self, namespace: int) -> dict[int, WindowHolders]:
        """Window fingerprint -> its (entry, offset), or a list of them when several windows
        share the fingerprint, of one namespace: for fast membership probes."""
        return self._windows.get(namespace, {})

    def lookup_window(self, namespace: int, fingerprint: int, tokens: np.ndarray) -> WindowHit | None:
        """A registered sub-window holding exactly ``tokens`` (one window) under this fingerprint."""
        content = _content(tokens)
        for entry, offset in _holders(self.window_table(namespace).get(int(fingerprint))):
            if entry.content[8 * offset:8 * (offset + tokens.size)] == content:
                return WindowHit(entry, offset, int(tokens.size))
            self.verify_failures += 1
        return None

    def lookup_head(self, namespace: int, tokens: np.ndarray) -> WindowHit | None:
        """The registered chunk sharing the most leading tokens with ``tokens`` (at
        least its head; compared token by token), or None."""
        if not self.head or tokens.size < self.head:
            return None
        best = None
        entries = self._heads.get(namespace, {}).get(self._head_key(namespace, tokens), [])
        for entry in reversed(entries[-HEAD_CANDIDATES:]):
            m = min(entry.size, tokens.size)
            differ = np.flatnonzero(entry.tokens[:m] != tokens[:m])
            run = int(differ[0]) if differ.size else m
            if run < self.head:
                self.verify_failures += 1
            elif best is None or run > best.size:
                best = WindowHit(entry, 0, run)
        return best

    def _head_key(self, namespace: int, tokens: np.ndarray) -> int:
        return Fingerprinter(tokens[:self.head], namespace)(0, self.head)

    def register(self, namespace: int, fingerprint: int, tokens: np.ndarray, handles: np.ndarray,
                 p_source: int, *, probes: bool = True) -> ChunkEntry:
        """Add a chunk (or return the existing entry with the same content) and, with ``probes``,
        index its S1 windows and head (a whole region is registered without: its chunks are)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        handles = np.asarray(handles, dtype=np.int64)
        if tokens.ndim != 1 or tokens.shape != handles.shape:
            raise ValueError(f"tokens {tokens.shape} and handles {handles.shape} must be equal 1-D")
        existing = self.lookup(namespace, fingerprint, tokens)
        if existing is not None:
            self.touch(existing)
            return existing
        windows: list[int] = []
        head = None
        if probes:
            windows = tiled_window_fingerprints(tokens, self.window, seed=namespace).tolist()
            if self.head and tokens.size >= self.head:
                head = self._head_key(namespace, tokens)
        return self._add(namespace, int(fingerprint), _content(tokens), handles.copy(),
                         int(p_source), windows, head)

    def register_chunks(self, namespace: int, tokens: np.ndarray, handles: np.ndarray,
                        chunks: Sequence[tuple[int, int, int]]) -> list[tuple[ChunkEntry, bool]]:
        """:meth:`register` with probes of each ``(start, end, fingerprint)`` chunk of one token
        array, in order, at its position: ``tokens[start:end]`` with ``handles[start:end]``.
        Returns each chunk's entry and whether it is new. The windows and heads of all the chunks
        are fingerprinted together (a few numpy calls per prompt, not per chunk)."""
        tokens = np.asarray(tokens)  # converted chunk by chunk: most of a prompt is not missed
        handles = np.asarray(handles, dtype=np.int64)
        if tokens.ndim != 1 or tokens.shape != handles.shape:
            raise ValueError(f"tokens {tokens.shape} and handles {handles.shape} must be equal 1-D")
        width, head = self.window, self.head
        # Each chunk's whole windows, back to back: tiled as one array, they are its tiles; its
        # head likewise (a fingerprint is of the tokens alone, wherever they are).
        tiles = [(end - start) // width for start, end, _ in chunks]
        pieces = [tokens[start:start + n * width] for (start, _, _), n in zip(chunks, tiles) if n]
        windows = (tiled_window_fingerprints(np.concatenate(pieces), width, seed=namespace)
                   .tolist() if pieces else [])
        heads = [tokens[start:start + head] for start, end, _ in chunks
                 if head and end - start >= head]
        head_of = Fingerprinter(np.concatenate(heads), namespace) if heads else None
        out, first, at = [], 0, 0
        for (start, end, fingerprint), n in zip(chunks, tiles):
            keys, first = windows[first:first + n], first + n
            key = None
            if head and end - start >= head:
                key, at = head_of(at, at + head), at + head
            content = _content(tokens[start:end])
            existing = self.lookup(namespace, fingerprint, content)
            if existing is not None:
                self.touch(existing)
                out.append((existing, False))
                continue
            out.append((self._add(namespace, int(fingerprint), content,
                                  handles[start:end].copy(), start, keys, key), True))
        return out

    def _add(self, namespace: int, fingerprint: int, content: bytes, handles: np.ndarray,
             p_source: int, windows: list[int], head: int | None) -> ChunkEntry:
        """A new entry, indexed by its fingerprint, its windows' (at offsets 0, w, 2w, ...) and
        its head's."""
        entry = ChunkEntry(namespace, fingerprint, content, handles, p_source)
        self._chunks.setdefault(namespace, {}).setdefault(fingerprint, []).append(entry)
        if windows:
            table = self._windows.setdefault(namespace, {})
            offsets = range(0, len(windows) * self.window, self.window)
            if table.keys().isdisjoint(windows) and len(set(windows)) == len(windows):
                table.update(zip(windows, zip(repeat(entry), offsets)))  # all new: in C
            else:
                for offset, fp in zip(offsets, windows):
                    held = table.get(fp)
                    if held is None:
                        table[fp] = (entry, offset)
                    elif type(held) is tuple:
                        table[fp] = [held, (entry, offset)]
                    else:
                        held.append((entry, offset))
            entry.window_keys = windows
        if head is not None:
            entry.head_key = head
            self._heads.setdefault(namespace, {}).setdefault(head, []).append(entry)
        self.total_tokens += entry.size
        self._lru[entry] = None
        self.touch(entry)
        return entry

    def join_run(self, entry: ChunkEntry, run: ChunkEntry, offset: int) -> None:
        """Record that ``entry``'s tokens stand in ``run`` from ``offset`` on (the latest run
        wins)."""
        if run.content[8 * offset:8 * (offset + entry.size)] != entry.content:
            raise ValueError(f"chunk of {entry.size} tokens is not at offset {offset} of a run "
                             f"of {run.size}")
        entry.run, entry.run_offset = run, offset

    def replace_handles(self, old: np.ndarray, new: np.ndarray
                        ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Wherever an entry holds a handle of ``old``, make it the same index of ``new`` (rows
        recomputed for the same token at the same position after the same tokens: a heal).
        Returns the handles the registry now references instead, and those it no longer does
        (one per replaced occurrence, for the engine's reference counts). Content, windows,
        heads and runs are untouched: they name tokens, not rows."""
        old, new = np.asarray(old, dtype=np.int64), np.asarray(new, dtype=np.int64)
        if old.shape != new.shape or old.ndim != 1:
            raise ValueError(f"old {old.shape} and new {new.shape} must be equal 1-D")
        held: list[np.ndarray] = []
        freed: list[np.ndarray] = []
        if old.size == 0:
            return held, freed
        order = np.argsort(old)
        keys, values = old[order], new[order]
        low, high = keys[0], keys[-1]
        for entry in self._lru:
            handles = entry.handles
            if handles.size == 0 or handles.max() < low or handles.min() > high:
                continue
            at = np.minimum(np.searchsorted(keys, handles), keys.size - 1)
            hit = keys[at] == handles
            if hit.any():
                fresh = values[at[hit]]
                freed.append(handles[hit])
                held.append(fresh)
                handles = handles.copy()  # a new array: windows and runs hold offsets, not it
                handles[hit] = fresh
                entry.handles = handles
        return held, freed

    def move(self, entry: ChunkEntry, handles: np.ndarray, p_source: int) -> np.ndarray:
        """Point a registered entry at other rows of its tokens: ``handles`` computed at
        ``p_source`` (a heal's rows of a prompt that reused the entry whole, in a context nearer
        the prompts to come). A region leaves its run: the run's rows stay those of the
        context it was registered in, and a hit runs on only along rows of one context. Returns
        the handles it no longer references."""
        handles = np.asarray(handles, dtype=np.int64)
        if handles.shape != (entry.size,):
            raise ValueError(f"need {entry.size} handles, got {handles.shape}")
        old, entry.handles, entry.p_source = entry.handles, handles.copy(), int(p_source)
        entry.run, entry.run_offset = None, 0
        return old

    def touch(self, entry: ChunkEntry) -> None:
        """Mark an entry as just used (LRU)."""
        entry.last_use = next(self._clock)
        if entry in self._lru:  # an entry evicted since (a stale handle to it) stays out
            self._lru.move_to_end(entry)

    def lock(self, entry: ChunkEntry) -> None:
        """Hold an entry (a running request uses its handles): it cannot be evicted. An entry
        evicted already is refused: its handles may be another's by now."""
        if not entry.registered:
            raise ValueError(f"chunk {entry.fingerprint:#x} has been evicted: a plan that "
                             "reuses it was made before the eviction")
        entry.refcount += 1

    def unlock(self, entry: ChunkEntry) -> None:
        if entry.refcount <= 0:
            raise ValueError(f"unlock of chunk {entry.fingerprint:#x} that is not locked")
        entry.refcount -= 1

    def oldest(self) -> int | None:
        """Last-use stamp of the least recently used unheld entry, or None if none."""
        entry = self._oldest_unheld()
        return None if entry is None else entry.last_use

    def _oldest_unheld(self) -> ChunkEntry | None:
        return next((entry for entry in self._lru if not entry.refcount), None)

    def evict(self, num_tokens: int) -> list[np.ndarray]:
        """Drop least-recently-used unheld entries until ``num_tokens`` tokens are freed.

        Returns the handle arrays of the dropped entries, for the engine to release.
        """
        freed: list[np.ndarray] = []
        removed = 0
        while removed < num_tokens:
            entry = self._oldest_unheld()  # held ones stay
            if entry is None:
                break
            self._remove(entry)
            freed.append(entry.handles)
            removed += entry.size
        return freed

    def evict_to_capacity(self) -> list[np.ndarray]:
        """Evict down to the configured capacity (no-op when unbounded)."""
        if self.capacity is None or self.total_tokens <= self.capacity:
            return []
        return self.evict(self.total_tokens - self.capacity)

    def _remove(self, entry: ChunkEntry) -> None:
        del self._lru[entry]
        # A region may still point here as its run (keeping this object alive, not its slots):
        # it must not be followed.
        entry.registered, entry.run = False, None
        table = self._chunks[entry.namespace]
        table[entry.fingerprint].remove(entry)
        if not table[entry.fingerprint]:
            del table[entry.fingerprint]
        windows = self._windows.get(entry.namespace, {})
        for fp in set(entry.window_keys):  # a chunk may repeat a window: one key, two offsets
            held = windows[fp]
            rest = [] if type(held) is tuple else [(e, o) for e, o in held if e is not entry]
            if not rest:
                del windows[fp]
            else:
                windows[fp] = rest[0] if len(rest) == 1 else rest
        if entry.head_key is not None:
            heads = self._heads[entry.namespace]
            heads[entry.head_key].remove(entry)
            if not heads[entry.head_key]:
                del heads[entry.head_key]
        self.total_tokens -= entry.size
