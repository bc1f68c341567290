"""The cache manager: which KV slots each token's rows live in, and what the indexes keep.

A prompt is planned by the :class:`~irminsul.cache.planner.Planner` (Algorithm 1): exact-prefix
tokens reuse their slots as they are; a live PIC hit shares the chunk's c_KV slots and gets k_r
slots of its own, which the model runner fills with the source k_r rotated by δ (a
:class:`~.batch.Reuse`); everything else — novel chunks, the carve-out — gets fresh slots and is
computed. New chunks are registered and the prompt inserted into the radix tree; a finished
sequence is inserted whole.

Modes: ``off`` is exact-prefix only (the SGLang-equivalent baseline); ``observer`` plans and
records would-be PIC hits but computes them (outputs identical to ``off``); ``live`` reuses them.

Heal (live, ``CacheConfig.heal``): a finished sequence that was served reused rows is queued; when
the engine is idle, :meth:`CacheManager.next_heal` plans its recomputation from the first reused
row on, the model runner computes it like a prefill, and :meth:`CacheManager.complete_heal` swaps
the recomputed rows in for the reused ones wherever the indexes hold them.

Every slot reference is owned by a sequence, a radix node or a registry entry (or is the pool's
reserved padding slot); when the pool runs out the indexes are evicted (least recently used
first across both), never what a sequence holds. :meth:`CacheManager.check` verifies the
accounting. Nothing here touches the device: the model runner moves the rows.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from ..cache.plan import Commit, Plan, Segment
from ..cache.planner import Planner
from ..cache.registry import ChunkEntry
from ..config import CacheConfig, Mode
from .batch import ForwardBatch, Reuse
from .kv_pool import KVPool, PoolExhausted, unpack
from .repair import Deviation, heads_within, recompute_deviating, recompute_heads, reused_count
from .sequence import Prefill, Sequence, Stretch

if TYPE_CHECKING:
    from ..store import SharedStore
    from ..store.shared import RowWriter

Span = tuple[np.ndarray, np.ndarray]  # tokens and their positions, computed in one forward


class CacheManager:
    """Plans prompts, holds what plans reuse, settles slot references, evicts, checks."""

    def __init__(self, config: CacheConfig, mode: Mode, pool: KVPool, context: int, *,
                 write_rows: RowWriter, latent_check: Deviation | None = None) -> None:
        """``pool``: the slots (and rows) every sequence and index refers to; ``context``: the
        model's context in tokens, the longest prompt a plan takes. The model work this class
        decides on is the model runner's: ``write_rows`` writes rows made elsewhere (the shared
        store's) into slots; ``latent_check`` is CacheBlend-style repair's check forward (needed
        with ``recompute_share``)."""
        self.mode, self.pool, self.context = mode, pool, context
        self.planner = Planner(config, pic=mode != "off")
        # Repair (live only; :mod:`.repair`): the heads of reused runs, and the share of reused
        # tokens whose c_KV deviates most, computed instead.
        self.recompute_head = config.recompute_head if mode == "live" else 0
        self.recompute_share = config.recompute_share if mode == "live" else 0.0
        self.recompute_budget = config.recompute_budget if mode == "live" else 0.0
        if self.recompute_share and latent_check is None:
            raise ValueError("recompute_share needs the runner's latent check")
        self.latent_check = latent_check
        self.write_rows = write_rows
        # Heal: finished sequences (tokens, namespace, the entries their prompt reused whole)
        # waiting to be recomputed, newest last, and the one being recomputed now.
        self.heal = config.heal and mode == "live"
        self._to_heal: deque[tuple[np.ndarray, int, list[tuple[ChunkEntry, int]]]] = deque(
            maxlen=config.heal_queue)
        self.healing: Prefill | None = None
        self._healing_sources: list[tuple[ChunkEntry, int]] = []
        self.healed_tokens = 0  # rows recomputed by completed heals so far
        self.sequences: list[Sequence] = []
        # (namespace, fingerprint) of the chunks the prefills in flight missed, which they will
        # register when they complete: how a new plan knows what it could wait for.
        self._in_flight: Counter[tuple[int, int]] = Counter()
        # Prefills started and not yet landed. A heal swaps the radix tree's handles for its
        # own and frees the old ones, which such a prefill's plan still names (copied when it
        # was planned): heals run only while this is 0.
        self._unlanded = 0
        # A content store shared with other engines (irminsul.store.attach): live plans fetch
        # the whole chunks they miss from it, and registered chunks are published to it.
        self.store: SharedStore | None = None

    # -- prefill ---------------------------------------------------------------------------------

    def start_prefill(self, tokens: Iterable[int], resets: Iterable[int] = (), *,
                      namespace: int = 0, fetch: bool = True) -> Prefill:
        """Plan a prompt and hold what the plan reuses; :meth:`advance` serves it. ``fetch``:
        whether chunks it misses may come from the shared store (a fetched chunk holds a c_KV
        and a k_r slot of its own besides the request's k_r slot, so a caller that made room
        only for computing everything must not fetch)."""
        prompt = np.array(tokens if isinstance(tokens, np.ndarray) else list(tokens),
                          dtype=np.int64)
        if prompt.size == 0:
            raise ValueError("empty prompt")
        if prompt.size > self.context:
            raise ValueError(f"prompt of {prompt.size} tokens exceeds the model's context of "
                             f"{self.context}")
        plan = self.planner.plan(prompt, resets, namespace=namespace)
        if fetch and self.store is not None and self.mode == "live" and self._from_store(plan):
            # Planned again whatever the fetch came to: making room for it may have evicted
            # what the first plan reuses (nothing holds it yet), and what it fetched is a hit.
            plan = self.planner.plan(prompt, resets, namespace=namespace)
        self.planner.acquire(plan)
        try:  # repair's check forward runs here: if it fails, the plan holds nothing
            stretches = self._stretches(plan)
        except BaseException:
            self.planner.release(plan)
            raise
        seq = Sequence(prompt, np.zeros(0, dtype=np.int64), namespace)
        seq.stats.prompt_tokens = int(prompt.size)
        if self.mode == "observer":
            # What live would reuse: its hits less the prompt's last token, which live computes
            # whatever serves it (its logits start the generation; _stretches).
            seq.stats.would_be_pic_tokens = (plan.tokens_of("hit")
                                             - (plan.segments[-1].kind == "hit"))
        self.sequences.append(seq)
        misses = [(namespace, c.fingerprint, c.end - c.start) for c in plan.chunks
                  if c.kind == "miss"]
        # Only live mode reuses what it would wait for; observer computes its hits anyway.
        awaited = (sum(n for ns, fp, n in misses if self._in_flight[ns, fp])
                   if self.mode == "live" else 0)
        self._in_flight.update((ns, fp) for ns, fp, _ in misses)
        self._unlanded += 1
        return Prefill(seq, plan, prompt, stretches, awaited)

    def advance(self, prefill: Prefill, budget: int) -> tuple[Span | None, list[Reuse]]:
        """Serve the prefill's cached stretches and give its next ``budget`` tokens fresh slots.
        Returns those tokens and their positions (several spans when reused stretches lie
        between them; None when nothing is left to compute) and the reuses whose rows the model
        runner must rotate before that forward.

        Cached stretches cost no budget and do not depend on computed ones, so they are all
        served as they come: one forward computes every novel span up to the budget, each
        attending to the rows before it (reused rows are in place by then; earlier spans' rows
        are stored layer by layer in the same forward)."""
        seq, stretches = prefill.seq, prefill.stretches
        positions: list[np.ndarray] = []
        reuses: list[Reuse] = []
        pieces, served = [seq.handles], len(seq.handles)  # one concatenation at the end
        try:
            while stretches:
                kind, start, end, hits = stretches[0]
                start = max(start, served)
                if start >= end:
                    stretches.popleft()
                    continue
                if kind == "compute":
                    if budget <= 0:
                        break
                    stop = min(end, start + budget)
                    self.make_room(stop - start)
                    pieces.append(self.pool.alloc(stop - start))
                    seq.stats.prefilled_tokens += stop - start
                    positions.append(np.arange(start, stop))
                    budget -= stop - start
                    served = stop
                    continue
                stretches.popleft()  # cached stretches are served whole
                if kind in ("prefix", "derived"):
                    pieces.append(prefill.plan.prefix.handles[start:end])
                    seq.owed.append(pieces[-1])
                    if kind == "prefix":
                        seq.stats.prefix_tokens += end - start
                    else:  # the radix match past its exact rows (_stretches split it off)
                        seq.stats.derived_prefix_tokens += end - start
                        seq.exact = _first(seq.exact, start)
                else:
                    handles, reuse = self._share(seq, hits)
                    pieces.append(handles)
                    reuses.append(reuse)
                    seq.stats.pic_tokens += end - start
                    seq.exact = _first(seq.exact, start)
                served = end
        finally:  # what was served belongs to the sequence, whatever happens next
            if len(pieces) > 1:
                seq.handles = np.concatenate(pieces)
        if not positions:
            return None, reuses
        at = np.concatenate(positions)
        return (prefill.prompt[at], at), reuses

    def complete_prefill(self, prefill: Prefill) -> None:
        """Register the prompt's new chunks and insert it into the radix tree; release the plan."""
        self.settle(prefill.seq)  # before the plan's locks go
        if self.heal:  # what a heal may move (Planner.healed)
            prefill.seq.sources = _whole_sources(prefill.plan)
        try:
            # Each index's new references counted as soon as it holds them (a fault part-way
            # must not leave entries naming slots the failed request then gives back).
            self.planner.commit(prefill.plan, prefill.seq.handles, prefill.seq.exact,
                                apply=self._apply)
            if self.store is not None:  # off the request path: rows handed to a thread
                self.store.publish(prefill.plan, self.planner.registry, self.pool)
        finally:
            prefill.released = True
            self.planner.release(prefill.plan)
            self._landed(prefill)

    def abort_prefill(self, prefill: Prefill) -> None:
        """Give up a prefill: drop its references, keep the indexes as they were."""
        self.settle(prefill.seq)  # while the plan's locks still hold what it is owed
        prefill.released = True
        self.planner.release(prefill.plan)
        self._landed(prefill)
        self.finish(prefill.seq, remember=False)

    def forget_prefill(self, prefill: Prefill) -> None:
        """The prefill will never complete (its request was dropped after an abort that
        raised): what it missed is no longer in flight, so no plan waits for it, and its plan,
        unless given back already, holds nothing any more (what its sequence was served is
        counted first). The sequence itself is left as it is."""
        try:
            if not prefill.released:
                self.settle(prefill.seq)
                prefill.released = True  # a release that raises part way is not tried again
                self.planner.release(prefill.plan)
        finally:
            self._landed(prefill)

    def _from_store(self, plan: Plan) -> bool:
        """Register the whole chunks ``plan`` misses that the shared store holds (verified, and
        only when fetching beats prefilling them): their rows are written into fresh slots and
        registered at their source position, as if prefilled here. Whether the store held any:
        then the indexes may have changed under ``plan`` (room made by evicting, chunks
        registered), even where the rows could not be placed, and ``plan`` must be made again."""
        found = self.store.fetch(plan)  # never raises: a failing store holds nothing
        sizes = [f.tokens.size for f in found]
        if not found:
            return False
        if not self._try_room(sum(sizes)):
            return True
        handles = self.pool.alloc(sum(sizes))
        if not self.store.write(handles, found, self.write_rows):
            self.pool.release(handles)
            return True
        for f, mine in zip(found, np.split(handles, np.cumsum(sizes)[:-1])):
            entry = self.planner.registry.register(plan.namespace, f.fingerprint, f.tokens, mine,
                                                   f.rows.p_source)
            if not np.array_equal(entry.handles, mine):  # the content is registered already
                self.pool.release(mine)
        return True

    def _try_room(self, tokens: int) -> bool:
        try:
            self.make_room(tokens)
        except PoolExhausted:
            return False
        return True

    def _landed(self, prefill: Prefill) -> None:
        """The prefill is no longer in flight: its missed chunks are registered or never
        will be. Once per prefill: a second call (a drop after an abort that raised) counts
        nothing."""
        if prefill.landed:
            return
        prefill.landed = True
        self._unlanded -= 1
        namespace = prefill.seq.namespace
        for chunk in prefill.plan.chunks:
            if chunk.kind == "miss":
                key = (namespace, chunk.fingerprint)
                self._in_flight[key] -= 1
                if self._in_flight[key] <= 0:
                    del self._in_flight[key]

    def _stretches(self, plan: Plan) -> deque[Stretch]:
        """The plan as stretches. Adjacent computed segments fuse into one, so observer mode
        runs exactly the forwards that off mode runs; consecutive live hits fuse into one reuse
        (one gather-rotate-scatter); and the last token is always computed, since its logits
        start the generation."""
        stretches: list[list] = []  # [kind, start, end, hits], mutable while fusing
        for seg in plan.segments:
            kind = ("prefix" if seg.kind == "prefix" else
                    "reuse" if seg.kind == "hit" and self.mode == "live" else "compute")
            if kind == "prefix" and plan.prefix.exact < seg.end:  # its derived part apart
                if plan.prefix.exact > seg.start:
                    stretches.append(["prefix", seg.start, plan.prefix.exact, []])
                stretches.append(["derived", max(seg.start, plan.prefix.exact), seg.end, []])
                continue
            if stretches and kind == stretches[-1][0] and kind != "prefix":
                stretches[-1][2] = seg.end
            else:
                stretches.append([kind, seg.start, seg.end, []])
            if kind == "reuse":
                stretches[-1][3].append(seg)
        # The last token first: repair's picks are among the tokens the plan reuses.
        kind, start, end, hits = stretches[-1]
        if kind != "compute":
            if kind == "reuse":
                hits[-1] = hits[-1]._replace(end=end - 1)
            stretches[-1] = [kind, start, end - 1, [h for h in hits if h.size]]
            if start == end - 1:
                stretches.pop()
            stretches.append(["compute", end - 1, end, []])
        head = self.recompute_head
        if head and self.recompute_budget:  # the share's tokens first, the heads in what is left
            reused = reused_count(stretches)
            head = heads_within(stretches, head, int(self.recompute_budget * reused)
                                - int(self.recompute_share * reused))
        if head:
            stretches = recompute_heads(stretches, head)
        if self.recompute_share:
            stretches = recompute_deviating(stretches, plan.tokens, self.recompute_share,
                                            self.latent_check, plan.prefix.handles)
        return deque(Stretch(*stretch) for stretch in stretches)

    def _share(self, seq: Sequence, hits: list[Segment]) -> tuple[np.ndarray, Reuse]:
        """Consecutive hits' tokens as handles sharing their c_KV slots (owed to ``seq``) with
        fresh k_r slots, and the reuse that fills those with the source k_r rotated by each
        hit's δ (all layers in one gather-rotate-scatter)."""
        parts, deltas, sizes = [], [], []
        for hit in hits:  # some 500 hits at 32K: one plain loop
            parts.append(hit.entry.handles[hit.offset:hit.offset + hit.size])
            deltas.append(hit.delta)
            sizes.append(hit.size)
        source = np.concatenate(parts)
        self.make_room(0, len(source))
        ckv, kr_src = unpack(source)
        handles = self.pool.alloc_kr(ckv, retain=False)
        seq.owed_ckv.append(ckv)
        return handles, Reuse(kr_src, unpack(handles)[1], np.repeat(deltas, sizes))

    # -- heal ------------------------------------------------------------------------------------

    @property
    def heal_pending(self) -> bool:
        """Whether a heal is in progress or queued."""
        return self.healing is not None or bool(self._to_heal)

    def next_heal(self) -> Prefill | None:
        """The heal in progress, else the newest queued sequence whose stored rows are not exact
        throughout, planned (:meth:`Planner.heal_plan`) and held; None when none is left. A
        heal never evicts: one that would not fit in the free slots now is dropped. Raises
        while a prefill is in flight (a heal runs between requests)."""
        self._no_prefill_in_flight()
        if self.healing is not None:
            return self.healing
        while self._to_heal:
            tokens, namespace, sources = self._to_heal.pop()
            plan = self.planner.heal_plan(tokens, namespace)
            if plan is None:
                continue
            if not self.heal_room(plan.tokens.size - plan.prefix.length):
                continue
            self.planner.acquire(plan)
            seq = Sequence(plan.tokens, np.zeros(0, dtype=np.int64), namespace)
            self.sequences.append(seq)
            exact, end = plan.prefix.length, plan.tokens.size
            stretches = deque([Stretch("prefix", 0, exact, [])] if exact else [])
            stretches.append(Stretch("compute", exact, end, []))
            self.healing = Prefill(seq, plan, plan.tokens, stretches)
            self._healing_sources = sources
            return self.healing
        return None

    def _no_prefill_in_flight(self) -> None:
        if self._unlanded:
            raise RuntimeError(f"{self._unlanded} prefill(s) in flight: a heal frees handles "
                               "their plans name; heal between requests, or abort the heal")

    def heal_room(self, tokens: int) -> bool:
        """Whether ``tokens`` rows fit in the free slots without evicting anything."""
        return self.pool.ckv_slots.free >= tokens and self.pool.kr_slots.free >= tokens

    def complete_heal(self, prefill: Prefill) -> None:
        """The heal's rows are computed: they replace the reused ones in both indexes
        (:meth:`Planner.healed`); the heal's own references go."""
        if prefill is not self.healing:
            raise ValueError("not the heal in progress")
        self._no_prefill_in_flight()
        seq = prefill.seq
        self.settle(seq)
        try:
            commit = self.planner.healed(prefill.plan, seq.handles, self._healing_sources)
            self._apply(commit)
            self.healed_tokens += prefill.plan.tokens.size - prefill.plan.prefix.length
        finally:
            self._end_heal(prefill)

    def abort_heal(self) -> None:
        """Give up the heal in progress (its slots back, the indexes as they were)."""
        if self.healing is not None:
            self.settle(self.healing.seq)
            self._end_heal(self.healing)

    def _end_heal(self, prefill: Prefill) -> None:
        self.healing, self._healing_sources = None, []
        try:
            self.planner.release(prefill.plan)
        finally:
            self.finish(prefill.seq, remember=False)

    # -- batches ---------------------------------------------------------------------------------

    def begin_batch(self, work: list[tuple[Sequence, np.ndarray, np.ndarray]]
                    ) -> tuple[ForwardBatch, list[np.ndarray | None]]:
        """Slots for a forward over (sequence, tokens, positions) items: a prefill's tokens at
        the positions :meth:`advance` gave slots to, or new tokens appended at the sequence's
        end (a decode step, a teacher-forced continuation), which get fresh slots now. Returns
        the batch and each item's appended handles (None for a prefill's), for
        :meth:`end_batch`."""
        positions = [np.asarray(at, dtype=np.int64) for _, _, at in work]
        grows = []  # whether each item appends at its sequence's end
        for (seq, tokens, _), at in zip(work, positions):
            if len(tokens) != len(at) or len(at) == 0:
                raise ValueError("need one position per token")
            served = len(seq.handles)
            grows.append(bool(at[0] >= served))
            if grows[-1] and (at[0] != served or (len(at) > 1 and (np.diff(at) != 1).any())):
                raise ValueError(f"appended tokens must continue the sequence at {served}, got "
                                 f"positions from {int(at[0])}")
            if not grows[-1] and at[-1] >= served:
                raise ValueError("positions past the sequence's slots")
        counts = [len(at) for at, grow in zip(positions, grows) if grow]
        self.make_room(sum(counts))
        # One allocation for every appended token of the batch (a decode step's one per request).
        fresh = iter(np.split(self.pool.alloc(sum(counts)), np.cumsum(counts)[:-1])
                     if counts else ())
        appended: list[np.ndarray | None] = [next(fresh) if grow else None for grow in grows]
        keys, new = [], []
        try:
            for (seq, _, _), at, handles in zip(work, positions, appended):
                keys.append(seq.handles if handles is None else seq.handles_with(handles))
                new.append(keys[-1][at])
        except BaseException:
            self._release_appended(appended)
            raise
        tokens = np.concatenate([np.asarray(t, dtype=np.int64) for _, t, _ in work])
        return ForwardBatch(tokens, positions, keys, np.concatenate(new)), appended

    def end_batch(self, work: list[tuple[Sequence, np.ndarray, np.ndarray]],
                  appended: list[np.ndarray | None], ok: bool) -> None:
        """After the batch's forward is issued (``ok``) or failed: count what its sequences are
        owed (the host counts while the device runs), and give appended tokens their slots, or
        free them."""
        for seq, _, _ in work:
            self.settle(seq)
        if not ok:
            self._release_appended(appended)
            return
        for (seq, _, _), handles in zip(work, appended):
            if handles is not None:
                seq.extend_handles(handles)

    def _release_appended(self, appended: list[np.ndarray | None]) -> None:
        for handles in appended:
            if handles is not None:
                self.pool.release(handles)

    # -- sequences -------------------------------------------------------------------------------

    def fork(self, seq: Sequence) -> Sequence:
        """A second sequence sharing every KV slot of ``seq`` so far (one more reference each)."""
        if seq.finished:
            raise ValueError("cannot fork a finished sequence")
        self.settle(seq)
        twin = Sequence(seq.tokens, seq.handles.copy(), seq.namespace, seq.stats,
                        exact=seq.exact)
        twin.sources = list(seq.sources)  # the same prompt: whichever heals first moves them
        self.pool.retain(twin.handles)
        self.sequences.append(twin)
        return twin

    def finish(self, seq: Sequence, *, remember: bool = True) -> None:
        """Insert the finished sequence into the radix tree, then drop its own references."""
        if seq.finished:
            return
        self.settle(seq)
        if remember and seq.handles.size == len(seq.tokens):
            self._apply(self.planner.remember(seq.tokens, seq.handles, seq.namespace,
                                              seq.exact))
            if self.heal and seq.exact is not None:
                self._to_heal.append((seq.tokens.copy(), seq.namespace, seq.sources))
        self.pool.release(seq.handles)
        seq.finished = True
        self.sequences.remove(seq)

    # -- slots -----------------------------------------------------------------------------------

    def settle(self, seq: Sequence) -> None:
        """Count the references ``seq`` is owed (:attr:`Sequence.owed`)."""
        if seq.owed or seq.owed_ckv:
            self.pool.retain_slots(*seq.owed_slots())
            seq.owed, seq.owed_ckv = [], []

    def _apply(self, commit: Commit) -> None:
        # One retain and one release for all of a commit's arrays: each counts its slots once.
        if commit.held:
            self.pool.retain(np.concatenate(commit.held))
        if commit.freed:
            self.pool.release(np.concatenate(commit.freed))

    def make_room(self, ckv: int, kr: int | None = None) -> None:
        """Evict index entries (never what a sequence holds) until ``ckv`` c_KV and ``kr`` k_r
        slots are free (default: as many; ``make_room(n)``: n fresh tokens)."""
        kr = ckv if kr is None else kr
        pool = self.pool
        while pool.ckv_slots.free < ckv or pool.kr_slots.free < kr:
            short = max(ckv - pool.ckv_slots.free, kr - pool.kr_slots.free)
            freed = self.planner.evict(short)
            if not freed:
                raise PoolExhausted(f"KV pool full: {ckv} c_KV and {kr} k_r slots needed, "
                                    f"{pool.ckv_slots.free} and {pool.kr_slots.free} free, "
                                    "nothing evictable")
            pool.release(np.concatenate(freed))

    def clear(self) -> None:
        """Evict every index entry (never what a sequence holds): the cache as it started."""
        while freed := self.planner.evict(self.pool.capacity):
            self.pool.release(np.concatenate(freed))

    def references(self) -> list[np.ndarray]:
        """Every handle array that holds a slot reference: sequences, radix nodes, registry."""
        return ([self.pool.reserved] + [seq.handles for seq in self.sequences]
                + self.planner.references())

    def check(self) -> None:
        """Verify that every slot is free or referenced exactly as often as it is counted (the
        references sequences are owed not yet)."""
        owed = [seq.owed_slots() for seq in self.sequences]
        self.pool.check(self.references(), uncounted=([c for c, _ in owed], [k for _, k in owed]))


def _whole_sources(plan: Plan) -> list[tuple[ChunkEntry, int]]:
    """(entry, position) of every registry entry a plan's hits reuse whole: an entry hit whole,
    and each region found whole whose run a hit took on (the region's span of that hit)."""
    hits = plan.hits
    out = [(hit.entry, hit.start) for hit in hits
           if hit.offset == 0 and hit.size == hit.entry.size]
    for region in plan.region_entries:
        for hit in hits:
            if (hit.entry is region.run and hit.offset <= region.run_offset
                    and region.run_offset + region.size <= hit.offset + hit.size):
                out.append((region, hit.start + region.run_offset - hit.offset))
                break
    return out


def _first(at: int | None, position: int) -> int:
    """The earlier of a sequence's first inexact position so far (None: none) and ``position``."""
    return position if at is None else min(at, position)
