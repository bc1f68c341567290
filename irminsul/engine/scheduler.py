"""Continuous batching: requests move waiting → prefill → decode → finished, one step at a time.

Each :meth:`Scheduler.step` builds one ragged batch: a token for every decoding request, then
prefill spans (long prompts in chunks of at most ``chunk_tokens``) up to ``batch_tokens`` in all,
and runs it as a single forward. A request is planned first and admitted only when the pool can
hold the slots its plan will allocate — c_KV and k_r for every computed token and ``max_tokens``,
k_r alone for every reused one — on top of what running requests' plans may still allocate (the
engine evicts index entries to make room, never anything a request holds), so an admitted request
never runs out of slots mid-flight. Otherwise its plan is dropped and room is made as if it reused
nothing, then it is planned again; if even that does not fit, it waits for a request to leave.
A request whose plan would compute content that a prefill in flight is computing (agents sent
together with the same tool schemas or documents) waits for that prefill to register it, and then
reuses it, rather than computing it a second time beside it; requests behind it go ahead.

One request never fails another: an error while planning, serving, sampling or finishing one
request finishes that request alone (reason ``"error"``, its message in :attr:`StepOutput.error`). A
batched forward that raises is run again request by request, so only the request it fails on is
lost (a forward writes each row to the same slot every time, so running it again is harmless).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import torch

from .audit import PicAudit
from .engine import Engine, Prepared
from .kv_pool import PoolExhausted
from .sampler import NonFiniteLogits, SamplingParams, greedy_tokens, request_generator, sample
from .sequence import Prefill, Sequence, ServeStats

log = logging.getLogger(__name__)
AUDIT_WARN_KL = 0.02  # an audited request this far from recomputation is logged (the gate's limit)

State = Literal["waiting", "prefill", "decode", "finished"]


class PromptTooLong(ValueError):
    """The prompt plus ``max_tokens`` can never fit the model's context or the KV pool."""


@dataclass
class Request:
    """One generation request and its progress."""

    id: str
    prompt: list[int]
    params: SamplingParams
    resets: tuple[int, ...] = ()
    namespace: int = 0
    state: State = "waiting"
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prefill: Prefill | None = None
    seq: Sequence | None = None
    generator: np.random.Generator = field(default_factory=np.random.default_rng)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    # Prefills landed when it last chose to await shared content (-1: never): it is planned
    # again only once another lands, since until then what it awaits can only grow.
    awaited_at: int = -1

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None
    stats: ServeStats | None  # where the prompt came from, once prefilled
    ttft: float | None
    error: str | None = None  # why the request failed (finish_reason "error")


class Limits(NamedTuple):
    """What a request may ask for: the model's context and the KV pool's size, in tokens."""

    context: int
    pool_capacity: int
    vocab_size: int


class Load(NamedTuple):
    """The scheduler's load now."""

    running: int
    waiting: int
    pool_capacity: int
    pool_free: int
    graph_replays: int  # forwards replayed from a CUDA graph so far
    failed: int  # requests failed by an error of their own so far
    healed_tokens: int  # rows recomputed by heals so far


_PLACEHOLDER = np.zeros(1, dtype=np.int64)  # a prepared decode step's token, written later


class _Prepared(NamedTuple):
    requests: list[Request]  # the running requests it was made for, in order
    batch: Prepared


class _Ahead(NamedTuple):
    """A decode step launched before the host read the tokens it takes (they went from the
    device's argmax straight into its inputs): its requests, in order, and their logits."""

    requests: list[Request]
    logits: list[torch.Tensor]


class Scheduler:
    """Admits, batches and finishes requests over one :class:`Engine`: its cache manager plans
    and holds, its model runner computes (through :meth:`Engine.advance` and
    :meth:`Engine.run_batch`)."""

    def __init__(self, engine: Engine, *, batch_tokens: int | None = None,
                 chunk_tokens: int | None = None, max_running: int | None = None) -> None:
        """Budgets not given are the engine config's (:class:`~irminsul.config.EngineConfig`)."""
        self.engine, self.cache = engine, engine.cache
        config = engine.config
        self.batch_tokens = batch_tokens or config.batch_tokens
        self.chunk_tokens = chunk_tokens or config.chunk_tokens
        # No cap of its own: the pool decides admission; every running request decodes a token
        # in every step, so at most batch_tokens run.
        self.max_running = min(max_running or config.max_running or self.batch_tokens,
                               self.batch_tokens)
        self.await_shared = config.await_shared
        self.heal_tokens = config.heal_tokens
        self.idle_delay = config.idle_delay_s
        self._last_step = -float("inf")  # perf_counter() when the latest step returned
        model = engine.model.config
        self.limits = Limits(model.max_position_embeddings, engine.pool.capacity,
                             model.vocab_size)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._ids = itertools.count()
        # Requests that left (finished, aborted, dropped) so far; the request that last did not
        # fit and that count then: it is planned again only once another has left, and the
        # requests behind it wait for it (those ahead of it, awaiting shared content, do not).
        self._left, self._blocked_at = 0, -1
        self._blocked: Request | None = None
        self._landed = 0  # admitted prefills completed or given up so far
        self.failed = 0
        # A sampled share of what live PIC served, recomputed when there is nothing else to do.
        self.audit = PicAudit(config.pic_audit_rate if config.mode == "live" else 0.0)
        self._prepared: _Prepared | None = None  # the next step's batch, made ready ahead
        self._ahead: _Ahead | None = None  # the next step's forward, already launched
        self.prepared_steps = 0  # steps that ran a batch prepared ahead so far
        self.overlapped_steps = 0  # of those, launched before the host read their tokens

    def add(self, prompt: Iterable[int], params: SamplingParams, *, resets: Iterable[int] = (),
            namespace: int = 0, request_id: str | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError for a prompt that can never run."""
        prompt = [int(t) for t in prompt]
        context, capacity = self.limits.context, self.limits.pool_capacity
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) + params.max_tokens > context:
            raise PromptTooLong(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds the model's context of {context} tokens")
        if len(prompt) + params.max_tokens > capacity:
            raise PromptTooLong(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds the KV pool of {capacity} tokens")
        request = Request(request_id or f"req-{next(self._ids)}", prompt, params, tuple(resets),
                          namespace, generator=request_generator(params.seed))
        self.waiting.append(request)
        return request.id

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def idle_pending(self) -> bool:
        """Whether :meth:`run_idle` has anything to do (an audit or a heal)."""
        return self.audit.pending or self.cache.heal_pending

    def idle_wait(self) -> float | None:
        """Seconds until :meth:`run_idle` may run what is pending (0: now), counted from the
        latest step (``idle_delay_s``); None when there is nothing to run."""
        if self.has_work() or not self.idle_pending():
            return None
        return max(0.0, self._last_step + self.idle_delay - time.perf_counter())

    def run_idle(self) -> bool:
        """When nothing else has needed the device for ``idle_delay_s``: one audit recomputation
        (:meth:`run_audit`), else one forward of a heal (:meth:`Engine.heal_step`,
        ``heal_tokens`` at most); whether anything ran. A failing heal is logged and given up:
        it never costs a request anything."""
        if self.idle_wait() != 0.0:
            return False
        if self.run_audit():
            return True
        if not self.cache.heal_pending:
            return False
        try:
            self.engine.heal_step(self.heal_tokens)
        except Exception as err:
            log.warning("heal failed: %r", err)
        return True

    def run_audit(self) -> bool:
        """Recompute one request the audit kept (:mod:`.audit`), when nothing else needs the
        device; whether one ran. A failing recomputation is logged and dropped: the audit never
        costs a request anything."""
        if self.has_work() or not self.audit.pending:
            return False
        try:
            kl = self.audit.run(lambda prompt: self.engine.recompute_in_pool(
                prompt, self.chunk_tokens))
        except Exception as err:
            log.warning("PIC audit recomputation failed: %r", err)
            return True
        if kl is not None and kl > AUDIT_WARN_KL:
            log.warning("PIC audit: a served request's first token is %.4f nats from full "
                        "recomputation (above %.2f)", kl, AUDIT_WARN_KL)
        return True

    def load(self) -> Load:
        """Requests in flight and the pool's use, for metrics."""
        pool = self.engine.pool
        return Load(len(self.running), len(self.waiting), pool.capacity, pool.free,
                    self.engine.runner.graph_replays, self.failed, self.cache.healed_tokens)

    def abort(self, request_id: str, reason: str = "abort", *, remember: bool = True) -> bool:
        """Stop a request wherever it is (a dropped client, a stop string seen by the caller)
        and free its slots. Returns whether it was found. ``remember``: keep its rows in the
        prefix index, as a finished request's; False where they may not all have been written
        (a step that failed part way)."""
        self._discard_prepared()
        for request in self.waiting:
            if request.id == request_id:
                self.waiting.remove(request)
                request.state, request.finish_reason = "finished", reason
                self._left += 1
                return True
        for request in self.running:
            if request.id == request_id:
                self._finish(request, reason, remember=remember)
                return True
        return False

    def drop(self, request_id: str) -> None:
        """Remove a request from the queues without touching the engine: the last resort when
        :meth:`abort` itself raised, so the loop does not fail on it forever (its slots may
        leak; ``Engine.check`` would say so)."""
        self._discard_prepared()
        for request in self.running + self.waiting:
            if request.id == request_id:
                if request.state == "prefill" and request.prefill is not None:
                    # Its missed chunks will never land: requests awaiting them must not wait
                    # on (they are planned again once a prefill lands); its plan's holds go.
                    self._landed += 1
                    try:
                        self.cache.forget_prefill(request.prefill)
                    except Exception:
                        log.exception("forgetting the prefill of dropped %s failed", request.id)
                # Finished: a step launched ahead for it neither samples nor emits it.
                request.state, request.finish_reason = "finished", "error"
        self.running = [r for r in self.running if r.id != request_id]
        self.waiting = [r for r in self.waiting if r.id != request_id]
        self._left += 1

    def _reserved(self) -> tuple[int, int]:
        """(c_KV, k_r) slots running requests may still allocate."""
        ckv = kr = 0
        for r in self.running:
            decode = r.params.max_tokens - len(r.output)  # tokens still to append, at most
            plan = r.prefill.slots_to_come() if r.state == "prefill" else (0, 0)
            ckv, kr = ckv + plan[0] + decode, kr + plan[1] + decode
        return ckv, kr

    def _admit(self, outputs: list[StepOutput]) -> None:
        i = 0  # waiting requests before it are waiting for shared content to land
        while i < len(self.waiting) and len(self.running) < self.max_running:
            request = self.waiting[i]
            if request is self._blocked and self._blocked_at == self._left:
                return  # no room for it yet: still none, as no request has left since
            if request.awaited_at == self._landed:
                i += 1
                continue
            try:
                prefill = self._fit(request)
            except Exception as err:  # planning this prompt failed: it alone is lost
                self.waiting.pop(i)
                outputs.append(self._fail(request, err, "planning"))
                continue
            if prefill is None:  # wait for a running request to finish
                self._blocked, self._blocked_at = request, self._left
                return
            if isinstance(prefill, str):  # "await"
                request.awaited_at = self._landed
                i += 1
                continue
            self.waiting.pop(i)
            request.prefill, request.seq, request.state = prefill, prefill.seq, "prefill"
            self.running.append(request)

    def _fit(self, request: Request) -> Prefill | Literal["await"] | None:
        """The request planned, with room made for what its plan will allocate on top of what
        running requests may; else room as if it reused nothing (evicting what the first plan
        held, which can be all that stood in the way), planned again; else None. "await" when
        the plan would compute at least ``await_shared`` tokens that prefills in flight are
        computing (it is planned again next step, and hits them once they land)."""
        held_ckv, held_kr = self._reserved()
        decode = request.params.max_tokens
        prefill = self.cache.start_prefill(request.prompt, request.resets,
                                            namespace=request.namespace)
        if self.await_shared and prefill.awaited >= self.await_shared:
            self.cache.abort_prefill(prefill)
            return "await"
        ckv, kr = prefill.slots_to_come()
        try:
            self.cache.make_room(held_ckv + ckv + decode, held_kr + kr + decode)
            return prefill
        except PoolExhausted:
            self.cache.abort_prefill(prefill)
        except BaseException:
            self.cache.abort_prefill(prefill)
            raise
        fresh = len(request.prompt) + decode
        try:
            self.cache.make_room(held_ckv + fresh, held_kr + fresh)
        except PoolExhausted:
            if self.cache.healing is None:
                return None
            self.cache.abort_heal()  # idle work never keeps a request out
            return self._fit(request)
        # Whatever this plan reuses needs fewer slots than computing it, which now fit; not so
        # a chunk fetched from the shared store (its own rows besides the request's k_r), so
        # this plan reuses only what the engine holds.
        return self.cache.start_prefill(request.prompt, request.resets,
                                         namespace=request.namespace, fetch=False)

    def step(self) -> list[StepOutput]:
        """Admit what fits, run one batch, sample, and report what changed (requests that
        failed on their own included).

        In a step where every running request decodes and none waits, the next step's batch is
        prepared (:meth:`Engine.prepare_batch`: slots, graph inputs) after this one's forward
        is launched and before its tokens are read back, while the device computes: the next
        step then only writes its token ids and replays. It is given back if anything changed
        in between (a request stopped, came or left)."""
        try:
            return self._step()
        finally:  # idle work waits idle_delay_s from here
            self._last_step = time.perf_counter()

    def _step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ready = [(r, out[-1]) for r, out in zip(ahead.requests, ahead.logits)
                     if r.state == "decode"]  # not the ones that stopped meanwhile
            if ready:
                return self._sample_and_emit(ready, outputs)
        prepared = self._claim_prepared()
        if prepared is None:
            self._admit(outputs)
        work: list[tuple[Request, np.ndarray, np.ndarray]] = []
        budget = self.batch_tokens
        for request in self.running:
            if request.state == "decode":
                at = len(request.seq.tokens)
                work.append((request, np.asarray(request.output[-1:]), np.array([at])))
                budget -= 1
        for request in list(self.running):
            if request.state == "prefill" and budget > 0:
                try:
                    span = self.engine.advance(request.prefill, min(budget, self.chunk_tokens))
                except Exception as err:
                    outputs.append(self._fail(request, err, "serving its cached KV"))
                    continue
                if span is not None:
                    work.append((request, *span))
                    budget -= len(span[0])
        if not work:
            return outputs
        ready: list[tuple[Request, torch.Tensor]] = []  # requests to sample, and their logits
        for (request, tokens, _), out in zip(work, self._forward(work, outputs, prepared)):
            if out is None:
                continue  # failed in the forward
            try:
                if request.state == "decode":
                    request.seq.append(tokens)
                elif request.seq.handles.size < len(request.prompt):
                    continue  # more prompt to prefill (the last prompt token is always computed)
                else:
                    try:
                        self.cache.complete_prefill(request.prefill)
                    finally:  # the plan is released either way: the sequence is what is left
                        request.state = "decode"
                        self._landed += 1
                    request.first_token_time = time.perf_counter()
                    stats = request.seq.stats
                    self.audit.consider(request.seq.tokens, out[-1],
                                        stats.pic_tokens + stats.derived_prefix_tokens)
            except Exception as err:
                outputs.append(self._fail(request, err, "completing its prefill"))
                continue
            ready.append((request, out[-1]))
        return self._sample_and_emit(ready, outputs)

    def _sample_and_emit(self, ready: list[tuple[Request, torch.Tensor]],
                         outputs: list[StepOutput]) -> list[StepOutput]:
        """The step's tokens sampled and reported, the next step prepared (and where it can
        be, launched) while the device still computes this one."""
        self._prepare_next()
        tokens = self._launch_ahead(ready, outputs)
        for request, token in (self._sample(ready, outputs) if tokens is None else tokens):
            outputs.append(self._emit(request, token))
        if self._prepared is not None and not self._unchanged(self._prepared):
            self._discard_prepared()
        return outputs

    def _launch_ahead(self, ready: list[tuple[Request, torch.Tensor]],
                      outputs: list[StepOutput]) -> list[tuple[Request, int]] | None:
        """Overlap the host's per-step work with the device: when the next step is prepared
        and every request here samples greedily, their argmax feeds the next step's inputs on
        the device and that step is launched *before* the tokens are read back; the host then
        reports this step while the device computes the next (:attr:`_ahead`, landed by the
        next :meth:`step`). Returns this step's tokens, or None where it did not launch (the
        caller samples as usual). A request that stops on the token it just sampled, or whose
        logits give none (failed here, into ``outputs``), leaves a wasted row in the launched
        step, which the next step skips."""
        prepared = self._prepared
        if prepared is None or not all(r.params.greedy for r, _ in ready):
            return None
        where = {id(r): i for i, (r, _) in enumerate(ready)}
        if any(id(r) not in where for r in prepared.requests):
            return None
        self._prepared = None
        picks = [where[id(r)] for r in prepared.requests]
        try:
            picked = greedy_tokens([logits for _, logits in ready])
            ids = picked[0]
            read = picked.cpu() if not ids.is_cuda else torch.empty(
                picked.shape, dtype=ids.dtype, pin_memory=True).copy_(picked, non_blocking=True)
            sampled = torch.cuda.Event() if ids.is_cuda else None
            if sampled is not None:
                sampled.record()  # the read-back's end, before the next step is queued
            feed = ids if picks == list(range(len(ready))) else ids[
                torch.tensor(picks, device=ids.device)]
        except Exception as err:  # the usual path samples (and fails) each request alone
            log.debug("launching the next step ahead failed: %r", err)
            self.engine.discard(prepared.batch)
            return None
        try:
            logits = self.engine.run_prepared(prepared.batch, feed)
        except Exception as err:  # its slots are back: the next step plans as usual
            log.debug("a step launched ahead did not run: %r", err)
            logits = None
        if sampled is not None:
            sampled.synchronize()
        tokens, finite = read.tolist()
        if logits is not None:
            for request, i in zip(prepared.requests, picks):
                request.seq.append(np.array([tokens[i]]))  # the token its launched row takes
            self._ahead = _Ahead(prepared.requests, logits)
            self.prepared_steps += 1
            self.overlapped_steps += 1
        return self._picked(ready, tokens, finite, outputs)

    def _picked(self, ready: list[tuple[Request, torch.Tensor]], tokens: list[int],
                finite: list[int], outputs: list[StepOutput]) -> list[tuple[Request, int]]:
        """The greedy tokens of ``ready`` (:func:`greedy_tokens`' two rows, read back); a
        request whose logits gave no token is failed alone, into ``outputs``."""
        picked: list[tuple[Request, int]] = []
        for (request, _), token, ok in zip(ready, tokens, finite):
            if ok:
                picked.append((request, token))
            else:
                outputs.append(self._fail(request, NonFiniteLogits.after(len(request.output)),
                                          "sampling"))
        return picked

    def _prepare_next(self) -> None:
        """Prepare the next step's batch: when every running request decodes and none waits,
        the requests this step's tokens will not finish by length, each appending one token."""
        if self.waiting or any(r.state != "decode" for r in self.running):
            return
        going = [r for r in self.running if len(r.output) + 1 < r.params.max_tokens]
        if not going:
            return
        work = [(r.seq, _PLACEHOLDER, np.array([len(r.seq.tokens)])) for r in going]
        try:
            batch = self.engine.prepare_batch(work)
        except Exception as err:  # e.g. no room now: the next step plans as usual
            log.debug("preparing the next step failed: %r", err)
            return
        if batch is not None:
            self._prepared = _Prepared(going, batch)

    def _unchanged(self, prepared: _Prepared) -> bool:
        """Whether the running requests are still exactly those ``prepared`` was made for."""
        return (len(self.running) == len(prepared.requests)
                and all(a is b for a, b in zip(self.running, prepared.requests)))

    def _claim_prepared(self) -> Prepared | None:
        """The prepared batch, if this step runs exactly it (else given back)."""
        prepared = self._prepared
        if prepared is None:
            return None
        if self.waiting or not self._unchanged(prepared):
            self._discard_prepared()
            return None
        self._prepared = None
        return prepared.batch

    def check(self) -> None:
        """The engine's slot accounting verified (:meth:`Engine.check`), a batch prepared
        ahead given back first (its slots are held by no request yet)."""
        self._discard_prepared()
        self.engine.check()

    def _discard_prepared(self) -> None:
        if self._prepared is not None:
            prepared, self._prepared = self._prepared, None
            self.engine.discard(prepared.batch)

    def _sample(self, ready: list[tuple[Request, torch.Tensor]], outputs: list[StepOutput]
                ) -> list[tuple[Request, int]]:
        """Each request's next token. Greedy requests take one argmax over all their logits
        and one read back to the host, not one of each per request; sampled ones draw from
        their own seeded generators. A request whose sampling fails is failed alone."""
        tokens: list[tuple[Request, int]] = []
        greedy = [(r, logits) for r, logits in ready if r.params.greedy]
        alone = [(r, logits) for r, logits in ready if not r.params.greedy]
        if greedy:
            try:
                ids, finite = greedy_tokens([logits for _, logits in greedy]).tolist()
            except Exception:
                alone = greedy + alone  # find the one at fault: each on its own
            else:
                tokens += self._picked(greedy, ids, finite, outputs)
        for request, logits in alone:
            try:
                tokens.append((request, sample(logits, request.params, request.generator)))
            except NonFiniteLogits:  # said with how far the request got
                outputs.append(self._fail(request, NonFiniteLogits.after(len(request.output)),
                                          "sampling"))
            except Exception as err:
                outputs.append(self._fail(request, err, "sampling"))
        return tokens

    def _forward(self, work: list[tuple[Request, np.ndarray, np.ndarray]],
                 outputs: list[StepOutput], prepared: Prepared | None = None
                 ) -> list[torch.Tensor | None]:
        """Each item's logits; None for a request the forward failed on (failed here). A
        prepared batch (``work``'s decode steps) replays with its token ids."""
        if prepared is not None:
            try:
                logits = self.engine.run_prepared(
                    prepared, np.concatenate([tokens for _, tokens, _ in work]))
                self.prepared_steps += 1
                return logits
            except Exception as err:  # its slots are back: run the batch as usual below
                log.debug("a prepared step did not run: %r", err)
        try:
            return self.engine.run_batch([(r.seq, tokens, at) for r, tokens, at in work])
        except Exception as err:
            if len(work) == 1:
                outputs.append(self._fail(work[0][0], err, "the forward"))
                return [None]
        # One of them breaks the batch: run each alone, so only that one is lost.
        logits: list[torch.Tensor | None] = []
        for request, tokens, at in work:
            try:
                logits.append(self.engine.run_batch([(request.seq, tokens, at)])[0])
            except Exception as err:
                outputs.append(self._fail(request, err, "the forward"))
                logits.append(None)
        return logits

    def _fail(self, request: Request, err: Exception, where: str) -> StepOutput:
        """Finish a request an error of its own stopped (its slots freed, nothing of it kept in
        the indexes) and say why."""
        log.warning("request %s failed in %s: %r", request.id, where, err)
        self.failed += 1
        if request.state == "waiting":
            request.state, request.finish_reason = "finished", "error"
            self._left += 1
        else:
            self._finish(request, "error", remember=False)
        return StepOutput(request.id, [], True, "error", None, request.ttft,
                          error=f"{where} failed: {err}")

    def _emit(self, request: Request, token: int) -> StepOutput:
        request.output.append(token)
        stats = request.seq.stats if len(request.output) == 1 else None
        reason = ("stop" if token in request.params.stop_token_ids else
                  "length" if len(request.output) >= request.params.max_tokens else None)
        if reason:
            try:
                self._finish(request, reason)
            except Exception as err:  # remembering its rows failed: not the step's other requests
                return self._fail(request, err, "finishing")
        return StepOutput(request.id, [token], reason is not None, reason, stats, request.ttft)

    def _finish(self, request: Request, reason: str, *, remember: bool = True) -> None:
        if request.state == "prefill":
            self.cache.abort_prefill(request.prefill)
            self._landed += 1
        elif request.seq is not None:
            self.cache.finish(request.seq, remember=remember)
        request.state, request.finish_reason = "finished", reason
        self.running.remove(request)
        self._left += 1
