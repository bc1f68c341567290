"""The serve path with live position-independent caching, one sequence at a time.

A prompt is served through the planner (Algorithm 1): exact-prefix tokens reuse their KV slots as
they are; a PIC hit shares the chunk's c_KV slots and gets its k_r rotated by δ into slots of its
own (gather–rotate–scatter); everything else — novel chunks, the carve-out — is prefilled, all
its spans in one forward up to a token budget, each token attending to every row before it
(cached, reused and new). New chunks are registered and the prompt inserted into the radix tree;
a finished sequence is inserted whole.

Modes: ``off`` is exact-prefix only (the SGLang-equivalent baseline); ``observer`` plans and
records would-be PIC hits but prefills them (outputs identical to ``off``); ``live`` serves them.
``rotate=False`` is naive reuse (shared c_KV *and* unrotated k_r), kept only to measure what the
δ-rotation buys.

Every slot reference is owned by a sequence, a radix node or a registry entry (or is the pool's
reserved padding slot); when the pool runs out the indexes are evicted (least recently used
first across both), never what a sequence holds. :meth:`Engine.check` verifies the accounting.

On CUDA a forward reads the pool in place through the Triton kernels, and a batch of short spans
only replays a CUDA graph (:mod:`.graphs`).
"""

from __future__ import annotations

import importlib.util
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np
import torch

from ..cache.planner import Commit, Plan, Planner, Segment
from ..model import MLAModel
from ..model.mla import naive_from
from ..model.paged import PagedKV, upload
from .kv_pool import KVPool, PoolExhausted, unpack

if TYPE_CHECKING:
    from .graphs import CudaGraphs
    from .rotation import Rotation

Mode = Literal["off", "observer", "live"]
MODES: tuple[Mode, ...] = ("off", "observer", "live")


@dataclass
class ServeStats:
    """Where a prompt's tokens came from."""

    prompt_tokens: int = 0
    prefix_tokens: int = 0  # served by the exact-prefix radix tree
    pic_tokens: int = 0  # served from the registry (live mode)
    would_be_pic_tokens: int = 0  # registry hits prefilled anyway (observer mode)
    prefilled_tokens: int = 0


@dataclass(eq=False)  # identity: two sequences with equal tokens are still two sequences
class Sequence:
    """A request's tokens and the pool handles of their KV rows (one reference each)."""

    tokens: np.ndarray  # int64: the prompt, then every token appended
    handles: np.ndarray
    namespace: int
    stats: ServeStats = field(default_factory=ServeStats)
    finished: bool = False
    # References the sequence holds that the pool has not counted yet: :meth:`Engine.advance`
    # serves cached runs without counting them, so that their forward is issued sooner, and
    # :meth:`Engine.run_batch` counts them once it is (the plan's locks on the radix node and
    # the registry entries hold those slots meanwhile). Handles (both slots); c_KV slots alone.
    owed: list[np.ndarray] = field(default_factory=list)
    owed_ckv: list[np.ndarray] = field(default_factory=list)

    def append(self, tokens: np.ndarray) -> None:
        """Tokens whose rows were just computed (a decode step, a teacher-forced run)."""
        self.tokens = np.concatenate([self.tokens, np.asarray(tokens, dtype=np.int64)])


class Run(NamedTuple):
    """Prompt tokens [start, end) served one way: "prefix" (the exact prefix), "reuse" (live PIC
    hits, consecutive ones together: ``hits``) or "compute"."""

    kind: Literal["prefix", "reuse", "compute"]
    start: int
    end: int
    hits: list[Segment]


@dataclass
class Prefill:
    """A prompt being served: its plan and the runs still to do."""

    seq: Sequence
    plan: Plan
    prompt: np.ndarray
    runs: deque[Run]

    def slots_to_come(self) -> tuple[int, int]:
        """(c_KV, k_r) slots the rest of this prefill allocates: a computed token one of each,
        a reused one a k_r slot alone, the exact prefix none."""
        served, ckv, kr = len(self.seq.handles), 0, 0
        for kind, start, end, _ in self.runs:
            n = end - max(start, served)
            if n > 0 and kind != "prefix":
                kr += n
                ckv += n if kind == "compute" else 0
        return ckv, kr


def default_kernels(model: MLAModel) -> bool:
    """Whether an engine runs the Triton kernels by default: on a CUDA device with triton."""
    return (model.lm_head.weight.device.type == "cuda"
            and importlib.util.find_spec("triton") is not None)


def default_graphs(model: MLAModel, kernels: bool) -> bool:
    """Whether an engine replays CUDA graphs by default: with the kernels on CUDA, for bfloat16
    models (grouped GEMM in float32 reads expert offsets on the host) whose heads fill 16-row
    blocks."""
    weight = model.lm_head.weight
    return (kernels and weight.device.type == "cuda" and weight.dtype == torch.bfloat16
            and model.config.num_attention_heads % 16 == 0)


class Engine:
    """Prefill through the planner, decode against the split pool, keep slot accounting exact."""

    def __init__(self, model: MLAModel, *, num_slots: int, num_kr_slots: int | None = None,
                 mode: Mode = "live", rotate: bool = True, capacity: int | None = None,
                 s1: bool = True, heads: bool = True, regions: bool = True,
                 kernels: bool | None = None,
                 graphs: bool | None = None) -> None:
        """``num_slots`` / ``num_kr_slots``: the pool's c_KV and k_r slot spaces
        (:class:`KVPool`; k_r default: as many). ``s1`` / ``heads``: the planner's probes of a
        missed chunk (S1 windows; the longest registered run its head starts, which serves a
        prompt's last chunk, cut where the prompt ends, from a longer chunk seen before).
        ``regions``: the planner looks each region between two resets up whole first and runs
        it on along the run of regions it was registered in (one lookup and one reuse where a
        document of many messages moved, instead of one per chunk).
        ``kernels``: attend and rotate in place in the pool with the Triton kernels (default: on
        a CUDA device when triton is installed); otherwise each forward gathers its sequences'
        context rows and runs plain torch. ``graphs``: replay CUDA graphs for batches of short
        spans (default: with the kernels, for bfloat16 models whose heads fill 16-row blocks;
        off a GPU, the same padded forwards run without graphs)."""
        if mode not in MODES:
            raise ValueError(f"unknown cache mode {mode!r}; choose from {', '.join(MODES)}")
        cfg = model.config
        device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        kernels = default_kernels(model) if kernels is None else kernels
        graphs = default_graphs(model, kernels) if graphs is None else graphs
        if graphs and not kernels:
            raise ValueError("graphs replay the kernel path: they need kernels=True")
        if graphs and device.type == "cuda" and dtype != torch.bfloat16:
            raise ValueError(f"CUDA graphs need a bfloat16 model, not {dtype}: grouped GEMM in "
                             "other dtypes reads the expert offsets on the host")
        self.model, self.mode, self.rotate, self.kernels = model, mode, rotate, kernels
        # Graphs pad batches with rows written to a slot of their own, outside the capacity.
        self.pool = KVPool(cfg.num_hidden_layers, num_slots, cfg.kv_lora_rank,
                           cfg.qk_rope_head_dim, num_kr_slots=num_kr_slots, dtype=dtype,
                           device=device, reserved=1 if graphs else 0)
        self.planner = Planner(capacity=capacity, s1=s1, heads=heads, regions=regions,
                               pic=mode != "off")
        self.sequences: list[Sequence] = []
        self._naive_from = naive_from(cfg)
        self._rotation: Rotation | None = None
        if kernels and rotate and mode == "live":  # only live mode reuses rows
            from .rotation import Rotation  # needs triton

            # A reuse rotates at most a prompt's worth of rows.
            self._rotation = Rotation(self.pool.kr, model.rotary, cfg.max_position_embeddings)
        self.graphs: CudaGraphs | None = None
        if graphs:
            from .graphs import CudaGraphs  # needs triton

            ckv, kr = unpack(self.pool.reserved)
            self.graphs = CudaGraphs(model, self.pool.ckv, self.pool.kr, (int(ckv[0]), int(kr[0])))

    # -- prefill ---------------------------------------------------------------------------------

    def start_prefill(self, tokens: Iterable[int], resets: Iterable[int] = (), *,
                      namespace: int = 0) -> Prefill:
        """Plan a prompt and hold what the plan reuses; the work is done by :meth:`advance`."""
        prompt = np.array(tokens if isinstance(tokens, np.ndarray) else list(tokens),
                          dtype=np.int64)
        if prompt.size == 0:
            raise ValueError("empty prompt")
        if prompt.size > self.model.config.max_position_embeddings:
            raise ValueError(f"prompt of {prompt.size} tokens exceeds the model's context of "
                             f"{self.model.config.max_position_embeddings}")
        plan = self.planner.plan(prompt, resets, namespace=namespace)
        self.planner.acquire(plan)
        seq = Sequence(prompt, np.zeros(0, dtype=np.int64), namespace)
        seq.stats.prompt_tokens = int(prompt.size)
        seq.stats.would_be_pic_tokens = plan.tokens_of("hit") if self.mode == "observer" else 0
        self.sequences.append(seq)
        return Prefill(seq, plan, prompt, self._runs(plan))

    def advance(self, prefill: Prefill, budget: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Serve the prefill's cached runs and give its next ``budget`` tokens to compute fresh
        slots in place; return those tokens and their positions (several spans when reused runs
        lie between them), or None when nothing is left to compute. Call :meth:`run_batch` on
        them, then :meth:`advance` again.

        Cached runs cost no budget and do not depend on computed ones, so they are all served
        as they come: one forward computes every novel span up to the budget, each attending to
        the rows before it (reused rows are already in place; earlier spans' rows are stored
        layer by layer in the same forward)."""
        seq, runs = prefill.seq, prefill.runs
        positions: list[np.ndarray] = []
        pieces, served = [seq.handles], len(seq.handles)  # one concatenation at the end
        try:
            while runs:
                kind, start, end, hits = runs[0]
                start = max(start, served)
                if start >= end:
                    runs.popleft()
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
                runs.popleft()  # cached runs are served whole
                if kind == "prefix":
                    pieces.append(prefill.plan.prefix.handles[start:end])
                    seq.owed.append(pieces[-1])
                    seq.stats.prefix_tokens += end - start
                else:
                    handles, source, deltas = self._share(seq, hits)
                    pieces.append(handles)  # the sequence's before the device work can fail
                    self._rotate(source, unpack(handles)[1], deltas)
                    seq.stats.pic_tokens += end - start
                served = end
        finally:  # what was served belongs to the sequence, whatever happens next
            if len(pieces) > 1:
                seq.handles = np.concatenate(pieces)
        if not positions:
            return None
        at = np.concatenate(positions)
        return prefill.prompt[at], at

    def complete_prefill(self, prefill: Prefill) -> None:
        """Register the prompt's new chunks and insert it into the radix tree; release the plan."""
        self._settle(prefill.seq)  # before the plan's locks go
        try:
            self._apply(self.planner.commit(prefill.plan, prefill.seq.handles))
        finally:
            self.planner.release(prefill.plan)

    def abort_prefill(self, prefill: Prefill) -> None:
        """Give up a prefill: drop its references, keep the indexes as they were."""
        self._settle(prefill.seq)  # while the plan's locks still hold what it is owed
        self.planner.release(prefill.plan)
        self.finish(prefill.seq, remember=False)

    def prefill(self, tokens: Iterable[int], resets: Iterable[int] = (), *,
                namespace: int = 0) -> tuple[Sequence, torch.Tensor]:
        """Serve a prompt; returns its sequence and the logits [vocab] after its last token."""
        prefill = self.start_prefill(tokens, resets, namespace=namespace)
        logits = None
        try:
            while (span := self.advance(prefill, prefill.prompt.size)) is not None:
                logits = self.run_batch([(prefill.seq, *span)])[0]
        except BaseException:
            self.abort_prefill(prefill)
            raise
        try:
            self.complete_prefill(prefill)  # releases the plan whatever happens
        except BaseException:
            self.finish(prefill.seq, remember=False)
            raise
        return prefill.seq, logits[-1]

    def _runs(self, plan: Plan) -> deque[Run]:
        """The plan as runs (:class:`Run`). Adjacent computed segments fuse into one span, so
        observer mode runs exactly the forwards that off mode runs; consecutive live hits fuse
        into one reuse (one gather-rotate-scatter); and the last token is always computed, since
        its logits start the generation."""
        runs: list[list] = []  # [kind, start, end, hits], mutable while fusing
        for seg in plan.segments:
            kind = ("prefix" if seg.kind == "prefix" else
                    "reuse" if seg.kind == "hit" and self.mode == "live" else "compute")
            if runs and kind == runs[-1][0] and kind != "prefix":
                runs[-1][2] = seg.end
            else:
                runs.append([kind, seg.start, seg.end, []])
            if kind == "reuse":
                runs[-1][3].append(seg)
        kind, start, end, hits = runs[-1]
        if kind != "compute":
            if kind == "reuse":
                hits[-1] = hits[-1]._replace(end=end - 1)
            runs[-1] = [kind, start, end - 1, [h for h in hits if h.size]]
            runs.append(["compute", end - 1, end, []])
        return deque(Run(*run) for run in runs)

    def _share(self, seq: Sequence, hits: list[Segment]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Consecutive hits' tokens as handles sharing their c_KV slots (owed to ``seq``) with
        fresh k_r slots, which :meth:`_rotate` fills with the source k_r rotated by each hit's δ
        (all layers in one gather-rotate-scatter). Returns the handles, the source k_r slots
        and each token's δ."""
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
        return handles, kr_src, np.repeat(deltas, sizes)

    def _rotate(self, src: np.ndarray, dst: np.ndarray, deltas: np.ndarray) -> None:
        """The device work of a reuse: k_r slots ``dst`` of every layer := slots ``src``
        rotated by ``deltas`` (copied unrotated for naive reuse)."""
        if self._rotation is not None:
            self._rotation(src, dst, deltas)
            return
        device = self.pool.kr.device
        base = self.pool.kr[:, upload(src, device)].transpose(0, 1)  # [tokens, layers, rope]
        rotated = self.model.rotary.rotate(base, torch.from_numpy(deltas)) if self.rotate else base
        self.pool.kr[:, upload(dst, device)] = rotated.transpose(0, 1)

    def run_batch(self, work: list[tuple[Sequence, np.ndarray, np.ndarray]], *,
                  all_logits: bool = False) -> list[torch.Tensor]:
        """One ragged forward over (sequence, tokens, positions) items: a prefill's tokens at
        the positions :meth:`advance` gave slots to, or new tokens appended at the sequence's
        end (a decode step, a teacher-forced continuation). Each token attends to every row of
        its sequence at or before its position; its rows are stored in its slot. Returns each
        item's logits: [n, vocab] with ``all_logits``, else [1, vocab] for its last token."""
        appended: list[np.ndarray | None] = []
        self.make_room(sum(len(tokens) for seq, tokens, at in work
                           if int(at[0]) >= len(seq.handles)))
        try:
            keys, new, positions = [], [], []
            for seq, tokens, at in work:
                at = np.asarray(at, dtype=np.int64)
                positions.append(at)
                if len(tokens) != len(at) or len(at) == 0:
                    raise ValueError("need one position per token")
                if at[0] >= len(seq.handles):  # appended at the end: fresh slots now
                    if at[0] != len(seq.handles) or (np.diff(at) != 1).any():
                        raise ValueError(f"appended tokens must continue the sequence at "
                                         f"{len(seq.handles)}, got positions from {int(at[0])}")
                    appended.append(self.pool.alloc(len(at)))
                    keys.append(np.concatenate([seq.handles, appended[-1]]))
                else:
                    if at[-1] >= len(seq.handles):
                        raise ValueError("positions past the sequence's slots")
                    appended.append(None)
                    keys.append(seq.handles)
                new.append(keys[-1][at])
            try:
                logits = self._forward(
                    np.concatenate([np.asarray(t, dtype=np.int64) for _, t, _ in work]),
                    positions, keys, np.concatenate(new), all_logits)
            finally:
                for seq, _, _ in work:  # the forward is issued: the host counts while it runs
                    self._settle(seq)
        except BaseException:
            for handles in appended:
                if handles is not None:
                    self.pool.release(handles)
            raise
        for (seq, _, _), handles in zip(work, appended):
            if handles is not None:
                seq.handles = np.concatenate([seq.handles, handles])
        return logits

    def _forward(self, tokens: np.ndarray, positions: list[np.ndarray], keys: list[np.ndarray],
                 new: np.ndarray, all_logits: bool) -> list[torch.Tensor]:
        """Split the batch into contiguous spans, each attending to its sequence's rows up to
        its last position: short spans through the kernel when there is one (one launch per
        layer for all of them, context or not), the rest in torch over context gathered from the
        pool. A batch of kernel spans only replays a CUDA graph where there are graphs."""
        device = self.pool.ckv.device
        kernel, gathered, offset = [], [], 0  # kernel: (batch rows, new tokens, c_KV, k_r slots)
        for at, seq_keys in zip(positions, keys):
            for run in np.split(np.arange(len(at)), np.flatnonzero(np.diff(at) != 1) + 1):
                first, n = int(at[run[0]]), len(run)
                span = slice(offset + int(run[0]), offset + int(run[0]) + n)
                if self.kernels and n < self._naive_from:
                    kernel.append((run + offset, n, *unpack(seq_keys[:first + n])))
                else:
                    gathered.append((span, seq_keys[:first]))
            offset += len(at)
        lengths = [len(at) for at in positions]
        at = np.concatenate(positions)
        last = None if all_logits else np.cumsum(lengths) - 1
        new_ckv, new_kr = unpack(new)
        if (self.graphs is not None and not gathered
                and self.graphs.fits(len(at), sum(len(c) for _, _, c, _ in kernel))):
            hidden, rows = self.graphs.hidden(tokens, at, new_ckv, new_kr,
                                              [(n, c, r) for _, n, c, r in kernel], last)
            return self.model.head(hidden, lengths, rows)
        layout = None
        if kernel:
            from ..kernels import PagedLayout  # needs triton: only with kernels

            layout = PagedLayout.build([n for _, n, _, _ in kernel], [c for _, _, c, _ in kernel],
                                       [r for _, _, _, r in kernel],
                                       self.model.config.num_attention_heads, device)
        take = (upload(np.concatenate([rows for rows, _, _, _ in kernel]), device)
                if kernel and gathered else None)
        context = []
        for span, handles in gathered:
            slots = [upload(s, device) for s in unpack(handles)] if handles.size else [None, None]
            context.append((span, *slots))
        kv = PagedKV(self.pool.ckv, self.pool.kr, upload(new_ckv, device),
                     upload(new_kr, device), layout, take, context)
        hidden = self.model.hidden_paged(upload(tokens, device), upload(at, device), kv)
        return self.model.head(hidden, lengths, None if last is None else upload(last, device))

    # -- decode ----------------------------------------------------------------------------------

    def extend(self, seq: Sequence, tokens: Iterable[int]) -> torch.Tensor:
        """Append tokens (a decode step, or a teacher-forced continuation); their logits [n, V]."""
        new = np.asarray(list(tokens), dtype=np.int64)
        if seq.finished:
            raise ValueError("sequence already finished")
        at = np.arange(len(seq.tokens), len(seq.tokens) + len(new))
        logits = self.run_batch([(seq, new, at)], all_logits=True)[0]
        seq.append(new)
        return logits

    def generate(self, tokens: Iterable[int], max_tokens: int, *, resets: Iterable[int] = (),
                 namespace: int = 0, stop: Iterable[int] = ()) -> tuple[list[int], Sequence]:
        """Greedy decoding: up to ``max_tokens`` new tokens, stopping after a stop token."""
        stop_ids = set(stop)
        seq, logits = self.prefill(tokens, resets, namespace=namespace)
        out: list[int] = []
        while len(out) < max_tokens:
            token = int(logits.argmax())
            out.append(token)
            if token in stop_ids or len(out) == max_tokens:
                break
            logits = self.extend(seq, [token])[-1]
        self.finish(seq)
        return out, seq

    def fork(self, seq: Sequence) -> Sequence:
        """A second sequence sharing every KV slot of ``seq`` so far (one more reference each)."""
        if seq.finished:
            raise ValueError("cannot fork a finished sequence")
        self._settle(seq)
        twin = Sequence(seq.tokens, seq.handles.copy(), seq.namespace, seq.stats)
        self.pool.retain(twin.handles)
        self.sequences.append(twin)
        return twin

    def finish(self, seq: Sequence, *, remember: bool = True) -> None:
        """Insert the finished sequence into the radix tree, then drop its own references."""
        if seq.finished:
            return
        self._settle(seq)
        if remember and seq.handles.size == len(seq.tokens):
            self._apply(self.planner.remember(seq.tokens, seq.handles, seq.namespace))
        self.pool.release(seq.handles)
        seq.finished = True
        self.sequences.remove(seq)

    # -- slots -----------------------------------------------------------------------------------

    def _settle(self, seq: Sequence) -> None:
        """Count the references ``seq`` is owed (:attr:`Sequence.owed`)."""
        if seq.owed or seq.owed_ckv:
            self.pool.retain_slots(*_owed_slots(seq))
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

    def references(self) -> list[np.ndarray]:
        """Every handle array that holds a slot reference: sequences, radix nodes, registry."""
        refs = [self.pool.reserved] + [seq.handles for seq in self.sequences]
        refs += list(self.planner.radix.values())
        refs += [entry.handles for entry in self.planner.registry.entries()]
        return refs

    def check(self) -> None:
        """Verify that every slot is free or referenced exactly as often as it is counted (the
        references sequences are owed not yet)."""
        owed = [_owed_slots(seq) for seq in self.sequences]
        self.pool.check(self.references(), uncounted=([c for c, _ in owed], [k for _, k in owed]))


def _owed_slots(seq: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """The (c_KV, k_r) slots whose references ``seq`` is owed."""
    ckv, kr = unpack(np.concatenate(seq.owed)) if seq.owed else (np.zeros(0, np.int64),) * 2
    return np.concatenate([ckv, *seq.owed_ckv]), kr
