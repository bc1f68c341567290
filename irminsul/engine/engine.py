"""The engine: a cache manager and a model runner over one KV pool, and a synchronous API.

:class:`Engine` wires the two roles together — the :class:`~.cache_manager.CacheManager` decides
which slots every row lives in, the :class:`~.model_runner.ModelRunner` moves the rows — and
serves sequences one call at a time (prefill, extend, generate, fork, finish): what tests,
benchmarks and the analyses use. The :class:`~.scheduler.Scheduler` batches requests over the
same engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch

from ..config import EngineConfig, default_slots
from ..model import MLAModel
from .cache_manager import CacheManager, Span
from .kv_pool import KVPool, unpack
from .model_runner import ModelRunner, Peers, StagedForward, resolve_backend
from .repair import nearest_the_end
from .sampler import greedy_token
from .sequence import Prefill, Sequence

# The live-PIC audit's recomputations run in a namespace of their own: requests' namespaces are
# 64-bit seeds (irminsul.cache.cdc.namespace_seed), never negative.
AUDIT_NAMESPACE = -1

Work = list[tuple[Sequence, np.ndarray, np.ndarray]]  # (sequence, tokens, positions) items


class Prepared(NamedTuple):
    """A batch whose slots and graph inputs are ready but its token ids
    (:meth:`Engine.prepare_batch`)."""

    work: Work
    appended: list[np.ndarray | None]
    staged: StagedForward


class Engine:
    """Prefill through the planner, decode against the split pool, keep slot accounting exact."""

    def __init__(self, model: MLAModel, config: EngineConfig | None = None, *,
                 runner: type[ModelRunner] = ModelRunner) -> None:
        """``config``: the mode, pool, budgets, kernels and graphs (default: EngineConfig()).
        ``runner``: the model runner's class (a measurement may swap the rotation)."""
        self.config = config = config or EngineConfig()
        self.model = model
        context = model.config.max_position_embeddings
        kernels, graphs = resolve_backend(model, config.kernels, config.graphs)
        weight = model.lm_head.weight
        slots = config.slots or default_slots(context)
        # Graphs pad batches with rows written to a slot of their own, outside the capacity.
        self.pool = KVPool(model.config.num_hidden_layers, slots, model.config.kv_lora_rank,
                           model.config.qk_rope_head_dim, num_kr_slots=config.kr_slots,
                           dtype=weight.dtype, device=weight.device, reserved=1 if graphs else 0)
        scratch = tuple(int(s[0]) for s in unpack(self.pool.reserved)) if graphs else None
        repair = config.mode == "live" and config.cache.recompute_share  # CacheBlend-style
        recent = config.cache.recompute_rule == "recent"  # a ranking with no check forward
        checked = repair and not recent
        self.runner = runner(model, self.pool.ckv, self.pool.kr, kernels=kernels, graphs=graphs,
                             rotation=config.mode == "live", scratch=scratch,
                             check_layer=config.cache.recompute_check_layer if checked else None,
                             check_rule=config.cache.recompute_rule)
        self.cache = CacheManager(
            config.cache, config.mode, self.pool, context, write_rows=self.runner.write_rows,
            latent_check=(nearest_the_end if recent else self.runner.check_latent) if repair
            else None)

    @property
    def sequences(self) -> list[Sequence]:
        """The sequences holding slots now."""
        return self.cache.sequences

    # -- prefill ---------------------------------------------------------------------------------

    def start_prefill(self, tokens: Iterable[int], resets: Iterable[int] = (), *,
                      namespace: int = 0) -> Prefill:
        """Plan a prompt and hold what the plan reuses; the work is done by :meth:`advance`."""
        return self.cache.start_prefill(tokens, resets, namespace=namespace)

    def advance(self, prefill: Prefill, budget: int) -> Span | None:
        """Serve the prefill's cached stretches (rotating what live hits reuse) and give its
        next ``budget`` tokens fresh slots; return those tokens and their positions, or None
        when nothing is left to compute. Call :meth:`run_batch` on them, then again."""
        span, reuses = self.cache.advance(prefill, budget)
        for reuse in reuses:
            self.runner.rotate(reuse)
        return span

    def complete_prefill(self, prefill: Prefill) -> None:
        """Register the prompt's new chunks and insert it into the radix tree; release the plan."""
        self.cache.complete_prefill(prefill)

    def abort_prefill(self, prefill: Prefill) -> None:
        """Give up a prefill: drop its references, keep the indexes as they were."""
        self.cache.abort_prefill(prefill)

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

    # -- heal ------------------------------------------------------------------------------------

    def heal_step(self, budget: int) -> int:
        """One forward of the heal in progress (or the next queued one, :meth:`CacheManager.
        next_heal`) over at most ``budget`` tokens, completing it when it is done; the tokens it
        computed (0: nothing to heal, or no free room for it now, which gives it up). For idle
        time only: nothing else may hold a plan meanwhile."""
        prefill = self.cache.next_heal()
        if prefill is None:
            return 0
        left = prefill.prompt.size - max(len(prefill.seq.handles), prefill.plan.prefix.length)
        if not self.cache.heal_room(min(budget, left)):
            self.cache.abort_heal()
            return 0
        try:
            span = self.advance(prefill, budget)
            if span is not None:
                logits = self.run_batch([(prefill.seq, *span)])[0]
                if logits.is_cuda:
                    # One heal forward in flight at most: a request that arrives next waits for
                    # it alone, not for every forward a loop of idle calls would have queued.
                    torch.cuda.synchronize(logits.device)
            if len(prefill.seq.handles) == prefill.prompt.size:
                self.cache.complete_heal(prefill)
        except BaseException:
            self.cache.abort_heal()
            raise
        return 0 if span is None else len(span[0])

    def heal(self, budget: int = 8192) -> int:
        """Run every queued heal to its end, ``budget`` tokens per forward (what an idle server
        does between requests); the tokens computed."""
        total = 0
        while self.cache.heal_pending:
            total += self.heal_step(budget)
        return total

    # -- forward ---------------------------------------------------------------------------------

    def run_batch(self, work: Work, *, all_logits: bool = False) -> list[torch.Tensor]:
        """One ragged forward over (sequence, tokens, positions) items: a prefill's tokens at
        the positions :meth:`advance` gave slots to, or new tokens appended at the sequence's
        end (a decode step, a teacher-forced continuation). Each token attends to every row of
        its sequence at or before its position; its rows are stored in its slot. Returns each
        item's logits: [n, vocab] with ``all_logits``, else [1, vocab] for its last token."""
        batch, appended = self.cache.begin_batch(work)
        ok = False
        try:
            logits = self.runner.forward(batch, all_logits=all_logits)
            ok = True
        finally:
            self.cache.end_batch(work, appended, ok)
        return logits

    def prepare_batch(self, work: Work) -> Prepared | None:
        """A batch of appended tokens (decode steps) made ready to replay from a CUDA graph —
        slots allocated, inputs written — before its token ids are known: the host work of a
        step done while the device still computes the one before. The tokens in ``work`` are
        placeholders; :meth:`run_prepared` takes the real ones, :meth:`discard` gives the slots
        back. None where the batch would not replay a graph, or the runner does not stage
        ahead. Nothing may run a forward between this and :meth:`run_prepared`."""
        if self.runner.graphs is None or not self.runner.stages_ahead:
            return None
        batch, appended = self.cache.begin_batch(work)
        try:
            staged = self.runner.stage(batch)
        except BaseException:
            self.cache.end_batch(work, appended, False)
            raise
        if staged is None:
            self.cache.end_batch(work, appended, False)
            return None
        return Prepared(work, appended, staged)

    def run_prepared(self, prepared: Prepared, tokens: np.ndarray | torch.Tensor
                     ) -> list[torch.Tensor]:
        """:meth:`run_batch` of a prepared batch, with its token ids (one per item): on the
        host, or int64 on the device (a step's argmax, never read back first)."""
        ok = False
        if not isinstance(tokens, torch.Tensor):
            tokens = np.asarray(tokens, dtype=np.int64)
        try:
            logits = self.runner.replay(prepared.staged, tokens)
            ok = True
        finally:
            self.cache.end_batch(prepared.work, prepared.appended, ok)
        return logits

    def discard(self, prepared: Prepared) -> None:
        """Give back what :meth:`prepare_batch` allocated, for a batch that will not run."""
        self.cache.end_batch(prepared.work, prepared.appended, False)

    def recompute(self, prompt: np.ndarray) -> torch.Tensor:
        """The logits [vocab] after ``prompt`` computed from scratch by the model's plain
        forward, no cache and no slot: through the runner, so every rank runs it."""
        return self.runner.recompute(prompt)

    def recompute_in_pool(self, prompt: np.ndarray, budget: int) -> torch.Tensor:
        """The logits [vocab] after ``prompt`` computed from scratch as a request's prefill is,
        ``budget`` tokens a forward (the kernels, attention read from the pool, the same
        arithmetic as serving: the live-PIC audit's reference, which a plain forward's bf16
        arithmetic would put 1e-5 to 1e-3 nats away), in a namespace no request uses, so nothing
        is reused, and given up at the end, so nothing it computed stays in the cache. Its slots
        are made room for as any prefill's are (the least recently used cached rows evicted
        where the free room is short). For idle time only, as :meth:`heal_step`."""
        prompt = np.asarray(prompt, dtype=np.int64)
        # Nothing fetched from a shared store either: it would register rows in this
        # namespace, which must stay empty.
        prefill = self.cache.start_prefill(prompt, namespace=AUDIT_NAMESPACE, fetch=False)
        logits = None
        try:
            while (span := self.advance(prefill, budget)) is not None:
                logits = self.run_batch([(prefill.seq, *span)])[0]
        finally:
            self.abort_prefill(prefill)  # its slots back, the indexes as they were
        return logits[-1]

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
        """Greedy decoding: up to ``max_tokens`` new tokens, stopping after a stop token. Raises
        :class:`~.sampler.NonFiniteLogits` (the sequence's slots freed) where the logits give no
        token to pick."""
        stop_ids = set(stop)
        seq, logits = self.prefill(tokens, resets, namespace=namespace)
        out: list[int] = []
        try:
            while len(out) < max_tokens:
                token = greedy_token(logits, len(out))
                out.append(token)
                if token in stop_ids or len(out) == max_tokens:
                    break
                logits = self.extend(seq, [token])[-1]
        except BaseException:
            self.finish(seq, remember=False)  # its slots back, as a failed prefill's
            raise
        self.finish(seq)
        return out, seq

    def fork(self, seq: Sequence) -> Sequence:
        """A second sequence sharing every KV slot of ``seq`` so far (one more reference each)."""
        return self.cache.fork(seq)

    def finish(self, seq: Sequence, *, remember: bool = True) -> None:
        """Insert the finished sequence into the radix tree, then drop its own references."""
        self.cache.finish(seq, remember=remember)

    def check(self) -> None:
        """Verify the slot accounting (:meth:`CacheManager.check`)."""
        self.cache.check()

    @property
    def peers(self) -> Peers | None:
        """The ranks this engine's model calls run in lockstep with (data-parallel attention),
        through its runner; None for an engine on its own (one process, or tensor parallel's
        leader, whose followers need no turns)."""
        return self.runner if self.runner.lockstep else None  # type: ignore[return-value]

    def close(self) -> None:
        """End the engine's use: what its runner holds elsewhere (under tensor parallel, the
        followers' copies of this engine) is released. Not used after."""
        self.runner.close()
