"""The serve path with live position-independent caching, one sequence at a time.

A prompt is served through the planner (Algorithm 1): exact-prefix tokens reuse their KV slots as
they are; a PIC hit shares the chunk's c_KV slots and gets its k_r rotated by δ into slots of its
own (gather–rotate–scatter); everything else — novel chunks, the carve-out — is prefilled in
order, attending to every row before it (cached, reused and new). New chunks are registered and
the prompt inserted into the radix tree; a finished sequence is inserted whole.

Modes: ``off`` is exact-prefix only (the SGLang-equivalent baseline); ``observer`` plans and
records would-be PIC hits but prefills them (outputs identical to ``off``); ``live`` serves them.
``rotate=False`` is naive reuse (shared c_KV *and* unrotated k_r), kept only to measure what the
δ-rotation buys.

Every slot reference is owned by a sequence, a radix node or a registry entry; when the pool runs
out the indexes are evicted (LRU), never what a sequence holds. :meth:`Engine.check` verifies the
accounting.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from ..cache.planner import Commit, Plan, Planner, Segment
from ..model import MLAModel
from ..model.mla import naive_from
from ..model.paged import PagedKV
from .kv_pool import KVPool, PoolExhausted, unpack

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

    tokens: list[int]
    handles: np.ndarray
    namespace: int
    stats: ServeStats = field(default_factory=ServeStats)
    finished: bool = False


@dataclass
class Prefill:
    """A prompt being served: its plan and the runs still to do."""

    seq: Sequence
    plan: Plan
    prompt: np.ndarray
    runs: list[tuple[str, int, int, Segment | None]]


class Engine:
    """Prefill through the planner, decode against the split pool, keep slot accounting exact."""

    def __init__(self, model: MLAModel, *, num_slots: int, mode: Mode = "live",
                 rotate: bool = True, capacity: int | None = None, s1: bool = True,
                 kernels: bool | None = None) -> None:
        """``kernels``: attend and rotate in place in the pool with the Triton kernels (default:
        on a CUDA device when triton is installed); otherwise each forward gathers its
        sequences' context rows and runs plain torch."""
        if mode not in MODES:
            raise ValueError(f"unknown cache mode {mode!r}; choose from {', '.join(MODES)}")
        cfg = model.config
        device = model.lm_head.weight.device
        if kernels is None:
            kernels = device.type == "cuda" and importlib.util.find_spec("triton") is not None
        self.model, self.mode, self.rotate, self.kernels = model, mode, rotate, kernels
        self.pool = KVPool(cfg.num_hidden_layers, num_slots, cfg.kv_lora_rank,
                           cfg.qk_rope_head_dim, dtype=model.lm_head.weight.dtype, device=device)
        self.planner = Planner(capacity=capacity, s1=s1, pic=mode != "off")
        self.sequences: list[Sequence] = []
        self._naive_from = naive_from(cfg)

    # -- prefill ---------------------------------------------------------------------------------

    def start_prefill(self, tokens: Iterable[int], resets: Iterable[int] = (), *,
                      namespace: int = 0) -> Prefill:
        """Plan a prompt and hold what the plan reuses; the work is done by :meth:`advance`."""
        prompt = np.asarray(list(tokens), dtype=np.int64)
        if prompt.size == 0:
            raise ValueError("empty prompt")
        if prompt.size > self.model.config.max_position_embeddings:
            raise ValueError(f"prompt of {prompt.size} tokens exceeds the model's context of "
                             f"{self.model.config.max_position_embeddings}")
        plan = self.planner.plan(prompt, resets, namespace=namespace)
        self.planner.acquire(plan)
        seq = Sequence(prompt.tolist(), np.zeros(0, dtype=np.int64), namespace)
        seq.stats.prompt_tokens = int(prompt.size)
        seq.stats.would_be_pic_tokens = plan.tokens_of("hit") if self.mode == "observer" else 0
        self.sequences.append(seq)
        return Prefill(seq, plan, prompt, list(self._runs(plan)))

    def advance(self, prefill: Prefill, budget: int) -> tuple[np.ndarray, int] | None:
        """Serve the prefill's cached runs up to its next computed span; return that span
        (tokens, start position), at most ``budget`` tokens of it, or None when nothing is left
        to compute. Call :meth:`run_batch` on the span, then :meth:`advance` again."""
        seq = prefill.seq
        while prefill.runs:
            kind, start, end, seg = prefill.runs[0]
            start = max(start, len(seq.handles))
            if start >= end:
                prefill.runs.pop(0)
                continue
            if kind == "compute":
                stop = min(end, start + max(budget, 1))
                seq.stats.prefilled_tokens += stop - start
                return prefill.prompt[start:stop], start
            prefill.runs.pop(0)
            if kind == "prefix":
                handles = prefill.plan.prefix.handles[start:end].copy()
                self.pool.retain(handles)
                seq.stats.prefix_tokens += end - start
            else:
                # Consecutive hits are reused in one gather-rotate-scatter, one δ per token.
                sources, deltas = [], []
                while True:
                    first = seg.offset + (start - seg.start)
                    sources.append(seg.entry.handles[first:first + end - start])
                    deltas.append(np.full(end - start, seg.delta, dtype=np.int64))
                    if not prefill.runs or prefill.runs[0][0] != "reuse":
                        break
                    _, start, end, seg = prefill.runs.pop(0)
                handles = self._reuse(np.concatenate(sources), np.concatenate(deltas))
                seq.stats.pic_tokens += len(handles)
            seq.handles = np.concatenate([seq.handles, handles])
        return None

    def complete_prefill(self, prefill: Prefill) -> None:
        """Register the prompt's new chunks and insert it into the radix tree; release the plan."""
        try:
            self._apply(self.planner.commit(prefill.plan, prefill.seq.handles))
        finally:
            self.planner.release(prefill.plan)

    def abort_prefill(self, prefill: Prefill) -> None:
        """Give up a prefill: drop its references, keep the indexes as they were."""
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

    def _runs(self, plan: Plan) -> list[tuple[str, int, int, Segment | None]]:
        """The plan as (kind, start, end, segment) runs: "prefix", "reuse" (a live PIC hit) or
        "compute". Adjacent computed segments fuse into one span, so observer mode runs exactly
        the forwards that off mode runs; and the last token is always computed, since its logits
        start the generation."""
        runs: list[tuple[str, int, int, Segment | None]] = []
        for seg in plan.segments:
            kind = ("prefix" if seg.kind == "prefix" else
                    "reuse" if seg.kind == "hit" and self.mode == "live" else "compute")
            if kind == "compute" and runs and runs[-1][0] == "compute":
                runs[-1] = ("compute", runs[-1][1], seg.end, None)
            else:
                runs.append((kind, seg.start, seg.end, None if kind == "compute" else seg))
        kind, start, end, seg = runs[-1]
        if kind != "compute":
            runs[-1] = (kind, start, end - 1, seg)
            runs.append(("compute", end - 1, end, None))
        return runs

    def _reuse(self, source: np.ndarray, deltas: np.ndarray) -> np.ndarray:
        """Share the source tokens' c_KV slots; give the sequence their k_r rotated by ``deltas``
        (one per token; or, for the naive-reuse study, copied unrotated) in fresh k_r slots, all
        layers at once."""
        self.make_room(len(source))
        ckv, kr_src = unpack(source)
        handles = self.pool.alloc_kr(ckv)
        _, kr_dst = unpack(handles)
        src = torch.from_numpy(kr_src).to(self.pool.kr.device)
        dst = torch.from_numpy(kr_dst).to(self.pool.kr.device)
        if self.kernels and self.rotate:
            from ..kernels import rotate_kr

            delta = torch.from_numpy(deltas.astype(np.int32)).to(self.pool.kr.device)
            rotate_kr(self.pool.kr, src, dst, delta, self.model.rotary)
            return handles
        base = self.pool.kr[:, src].transpose(0, 1)  # [tokens, layers, rope_dim]
        rotated = self.model.rotary.rotate(base, torch.from_numpy(deltas)) if self.rotate else base
        self.pool.kr[:, dst] = rotated.transpose(0, 1)
        return handles

    def run_batch(self, work: list[tuple[Sequence, np.ndarray, int]], *,
                  all_logits: bool = False) -> list[torch.Tensor]:
        """One ragged forward: each (sequence, tokens, start) runs its tokens at positions
        start.. after every row the sequence has; their rows are stored and appended to the
        sequence. Returns each item's logits: [n, vocab] with ``all_logits``, else [1, vocab]
        for its last token."""
        lengths = [len(tokens) for _, tokens, _ in work]
        self.make_room(sum(lengths))
        new = [self.pool.alloc(n) for n in lengths]
        try:
            ids = [torch.from_numpy(np.asarray(tokens, dtype=np.int64)) for _, tokens, _ in work]
            positions = [torch.arange(start, start + len(tokens)) for _, tokens, start in work]
            if self.kernels:
                logits = self.model.forward_paged(torch.cat(ids), torch.cat(positions), lengths,
                                                  self._paged(work, new),
                                                  last_only=not all_logits)
            else:
                outs = self.model.forward_batch(
                    ids, positions, [self.pool.rows(seq.handles) if seq.handles.size else None
                                     for seq, _, _ in work])
                for handles, out in zip(new, outs):
                    self.pool.write(handles, out.latents)
                logits = [out.logits if all_logits else out.logits[-1:] for out in outs]
        except BaseException:
            self.pool.release(np.concatenate(new))
            raise
        for (seq, _, _), handles in zip(work, new):
            seq.handles = np.concatenate([seq.handles, handles])
        return logits

    def _paged(self, work: list[tuple[Sequence, np.ndarray, int]],
               new: list[np.ndarray]) -> PagedKV:
        """Where the batch's rows go, and how each sequence attends: short segments with context
        (decode steps, carve-outs) through the kernel, the rest in the naive form."""
        from ..kernels import PagedLayout

        device = self.pool.ckv.device
        counts, ckv, kr, rows, naive, offset = [], [], [], [], [], 0
        for (seq, _, _), handles in zip(work, new):
            n, span = len(handles), slice(offset, offset + len(handles))
            offset += n
            if seq.handles.size == 0:
                naive.append((span, None, None))
            elif n >= self._naive_from:
                naive.append((span, *(torch.from_numpy(s).to(device) for s in unpack(seq.handles))))
            else:
                c, r = unpack(np.concatenate([seq.handles, handles]))
                counts.append(n)
                ckv.append(c)
                kr.append(r)
                rows.append(np.arange(span.start, span.stop))
        layout = (PagedLayout.build(counts, ckv, kr, self.model.config.num_attention_heads,
                                    device) if counts else None)
        take = (torch.from_numpy(np.concatenate(rows)).to(device) if rows and naive else None)
        new_ckv, new_kr = (torch.from_numpy(s).to(device) for s in unpack(np.concatenate(new)))
        return PagedKV(self.pool.ckv, self.pool.kr, new_ckv, new_kr, layout, take, naive)

    # -- decode ----------------------------------------------------------------------------------

    def extend(self, seq: Sequence, tokens: Iterable[int]) -> torch.Tensor:
        """Append tokens (a decode step, or a teacher-forced continuation); their logits [n, V]."""
        new = np.asarray(list(tokens), dtype=np.int64)
        if seq.finished:
            raise ValueError("sequence already finished")
        logits = self.run_batch([(seq, new, len(seq.tokens))], all_logits=True)[0]
        seq.tokens.extend(new.tolist())
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
        twin = Sequence(list(seq.tokens), seq.handles.copy(), seq.namespace, seq.stats)
        self.pool.retain(twin.handles)
        self.sequences.append(twin)
        return twin

    def finish(self, seq: Sequence, *, remember: bool = True) -> None:
        """Insert the finished sequence into the radix tree, then drop its own references."""
        if seq.finished:
            return
        if remember and seq.handles.size == len(seq.tokens):
            self._apply(self.planner.remember(np.asarray(seq.tokens), seq.handles, seq.namespace))
        self.pool.release(seq.handles)
        seq.finished = True
        self.sequences.remove(seq)

    # -- slots -----------------------------------------------------------------------------------

    def _apply(self, commit: Commit) -> None:
        for handles in commit.held:
            self.pool.retain(handles)
        for handles in commit.freed:
            self.pool.release(handles)

    def make_room(self, n: int) -> None:
        """Evict index entries (never what a sequence holds) until n fresh tokens fit."""
        while self.pool.free < n:
            freed = self.planner.evict(n - self.pool.free)
            if not freed:
                raise PoolExhausted(f"KV pool full: {n} slots needed, {self.pool.free} free, "
                                    "nothing evictable")
            for handles in freed:
                self.pool.release(handles)

    def references(self) -> list[np.ndarray]:
        """Every handle array that holds a slot reference: sequences, radix nodes, registry."""
        refs = [seq.handles for seq in self.sequences]
        refs += list(self.planner.radix.values())
        refs += [entry.handles for entry in self.planner.registry.entries()]
        return refs

    def check(self) -> None:
        """Verify that every slot is free or referenced exactly as often as it is counted."""
        self.pool.check(self.references())
