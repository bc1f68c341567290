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

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from ..cache.planner import Commit, Planner
from ..model import MLAModel
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


@dataclass
class Sequence:
    """A request's tokens and the pool handles of their KV rows (one reference each)."""

    tokens: list[int]
    handles: np.ndarray
    namespace: int
    stats: ServeStats = field(default_factory=ServeStats)
    finished: bool = False


class Engine:
    """Prefill through the planner, decode against the split pool, keep slot accounting exact."""

    def __init__(self, model: MLAModel, *, num_slots: int, mode: Mode = "live",
                 rotate: bool = True, capacity: int | None = None, s1: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown cache mode {mode!r}; choose from {', '.join(MODES)}")
        cfg = model.config
        device = model.lm_head.weight.device
        self.model, self.mode, self.rotate = model, mode, rotate
        self.pool = KVPool(cfg.num_hidden_layers, num_slots, cfg.kv_lora_rank,
                           cfg.qk_rope_head_dim, dtype=model.lm_head.weight.dtype, device=device)
        self.planner = Planner(capacity=capacity, s1=s1, pic=mode != "off")
        self.sequences: list[Sequence] = []
        self._rank = cfg.kv_lora_rank

    # -- prefill ---------------------------------------------------------------------------------

    def prefill(self, tokens: Iterable[int], resets: Iterable[int] = (), *,
                namespace: int = 0) -> tuple[Sequence, torch.Tensor]:
        """Serve a prompt; returns its sequence and the logits [vocab] after its last token."""
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
        self.sequences.append(seq)
        logits = None
        try:
            kind = "compute"
            for kind, start, end, seg in self._runs(plan):
                if kind == "prefix":
                    handles = plan.prefix.handles.copy()
                    self.pool.retain(handles)
                    seq.stats.prefix_tokens += end - start
                elif kind == "reuse":
                    handles = self._reuse(seg.entry.handles[seg.offset:seg.offset + seg.size],
                                          seg.delta)
                    seq.stats.pic_tokens += end - start
                else:
                    logits, handles = self._compute(seq, prompt[start:end], start)
                    seq.stats.prefilled_tokens += end - start
                seq.handles = np.concatenate([seq.handles, handles])
            seq.stats.would_be_pic_tokens = plan.tokens_of("hit") if self.mode == "observer" else 0
            if kind != "compute":
                # The prompt's last token came from a cache, but its logits are needed:
                # recompute that one token.
                self.pool.release(seq.handles[-1:])
                seq.handles = seq.handles[:-1]
                logits, handles = self._compute(seq, prompt[-1:], prompt.size - 1)
                seq.handles = np.concatenate([seq.handles, handles])
            self._apply(self.planner.commit(plan, seq.handles))
        except BaseException:
            self.finish(seq, remember=False)
            raise
        finally:
            self.planner.release(plan)
        return seq, logits[-1]

    def _runs(self, plan) -> Iterable[tuple[str, int, int, object]]:
        """The plan as (kind, start, end, segment) runs: "prefix", "reuse" (a live PIC hit) or
        "compute". Adjacent computed segments fuse into one forward, so observer mode runs exactly
        the forwards that off mode runs."""
        pending = None
        for seg in plan.segments:
            kind = ("prefix" if seg.kind == "prefix" else
                    "reuse" if seg.kind == "hit" and self.mode == "live" else "compute")
            if kind == "compute":
                pending = (pending[0], seg.end) if pending else (seg.start, seg.end)
                continue
            if pending:
                yield "compute", pending[0], pending[1], None
                pending = None
            yield kind, seg.start, seg.end, seg
        if pending:
            yield "compute", pending[0], pending[1], None

    def _reuse(self, source: np.ndarray, delta: int) -> np.ndarray:
        """Share the source tokens' c_KV slots; give the sequence k_r rotated by δ (or, for the
        naive-reuse study, copied unrotated) in fresh k_r slots."""
        self._make_room(len(source))
        ckv, kr_src = unpack(source)
        handles = self.pool.alloc_kr(ckv)
        _, kr_dst = unpack(handles)
        src = torch.from_numpy(kr_src).to(self.pool.kr.device)
        dst = torch.from_numpy(kr_dst).to(self.pool.kr.device)
        for layer in range(self.pool.kr.shape[0]):
            base = self.pool.kr[layer, src]
            self.pool.kr[layer, dst] = (self.model.rotary.rotate(base, delta) if self.rotate
                                        else base)
        return handles

    def _compute(self, seq: Sequence, tokens: np.ndarray,
                 start: int) -> tuple[torch.Tensor, np.ndarray]:
        """Run tokens at positions start.. after every row the sequence has; store their rows."""
        self._make_room(len(tokens))
        context = self.pool.rows(seq.handles) if seq.handles.size else None
        out = self.model.forward(torch.from_numpy(tokens),
                                 torch.arange(start, start + len(tokens)), context)
        handles = self.pool.alloc(len(tokens))
        self.pool.write(handles, out.latents)
        return out.logits, handles

    # -- decode ----------------------------------------------------------------------------------

    def extend(self, seq: Sequence, tokens: Iterable[int]) -> torch.Tensor:
        """Append tokens (a decode step, or a teacher-forced continuation); their logits [n, V]."""
        new = np.asarray(list(tokens), dtype=np.int64)
        if seq.finished:
            raise ValueError("sequence already finished")
        logits, handles = self._compute(seq, new, len(seq.tokens))
        seq.handles = np.concatenate([seq.handles, handles])
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

    def _make_room(self, n: int) -> None:
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
