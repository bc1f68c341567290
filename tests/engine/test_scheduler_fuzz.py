"""Seeded random workloads through the Scheduler on CPU, checked step by step and at the end.

Each seed draws an engine configuration (mode off / observer / live, heal on or off, repair on
or off, regions and head probes on or off, an index capacity or none, a KV pool small enough
that requests wait for room and the indexes are evicted again and again, more or fewer k_r
slots than c_KV ones, small batch and chunk budgets, a cap on running requests or none,
waiting for shared content or not) and a workload: prompts built from a few shared documents
behind headers from a small set (so chunks move and exact prefixes recur), follow-up turns of
finished requests (prompt + output + more), exact resends, three namespaces, random max_tokens
and stop tokens, some sampled requests, requests added while others run, random aborts (with or
without remembering their rows, of waiting, running and already finished requests), and idle
work (heals, audits) run partly between bursts.

Checked after every step, against the reference kept here (each request's expected life):
``Scheduler.check()`` (the engine's slot accounting: every slot's count equals its references);
the requests the scheduler holds are exactly the ones the reference says are unfinished, no
more running than max_running, the engine's sequences are exactly theirs (and a heal's); no
request emits after it finished, and none fails (an admitted request never runs out of slots);
progress (no step leaves work waiting with nothing running twice in a row); every plan serves
only live registry entries of its own namespace, equal to the prompt's tokens, never below
position 32; the exact prefix served never exceeds the longest common prefix with the other
sequences of its namespace (brute force).

Checked at the end: every request finished or was aborted exactly once, with the right reason
(length, stop, abort); the free-slot count returns to the pool's capacity once the indexes are
cleared (no slot leaks) and nothing is left in flight; and greedy outputs equal the cache-off
engine's greedy outputs (teacher-forced, so a near-tie broken the other way by different
arithmetic is told apart from a wrong token) — for every request in off and observer mode and
with a one-layer model (where position-independent reuse is exact), and in live mode with three
layers for every request whose rows were all exact (no PIC hit, no derived prefix).

``IRMINSUL_FUZZ_SEEDS`` / ``IRMINSUL_FUZZ_STEPS`` run more seeds / longer workloads locally.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from fixtures.tiny_models import build

from irminsul.cache.plan import Plan
from irminsul.config import CacheConfig, EngineConfig
from irminsul.engine import Engine, PromptTooLong, SamplingParams, Scheduler, StepOutput
from irminsul.model import MLAModel, load_model

V = 97  # the tiny models' vocabulary
SEEDS = int(os.environ.get("IRMINSUL_FUZZ_SEEDS", "8"))
STEPS = int(os.environ.get("IRMINSUL_FUZZ_STEPS", "160"))
TIE = 1e-4  # a token within this share of the logits' scale of the best is a tie, not a bug

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, MLAModel]:
    """Tiny DeepSeek-V3-like checkpoints: one layer (PIC is exact) and three (it is not)."""
    out = {}
    for layers in (1, 3):
        directory = tmp_path_factory.mktemp(f"fuzz_v3_{layers}layer")
        build("v3_like", directory, layers=layers)
        out[layers] = load_model(directory)
    return out


@dataclass(eq=False)
class Tracked:
    """The reference's view of one request."""

    id: str
    prompt: list[int]
    params: SamplingParams
    namespace: int
    resets: list[int]
    out: list[int] = field(default_factory=list)
    finishes: int = 0  # finished outputs plus successful aborts: must end at exactly 1
    reason: str | None = None
    stats: object | None = None

    @property
    def done(self) -> bool:
        return self.finishes > 0


def _lcp(a: list[int], b: list[int]) -> int:
    return len(os.path.commonprefix([a, b]))  # element-wise: works on any sequences


class Workload:
    """One seed: the engine, the scheduler, the workload and the reference."""

    def __init__(self, models: dict[int, MLAModel], seed: int) -> None:
        self.rng = rng = np.random.default_rng(1000 + seed)
        self.mode = ["live", "off", "observer", "live", "live", "live"][seed % 6]
        self.layers = 1 if seed % 2 == 0 else 3
        self.model = models[self.layers]
        heal = self.mode == "live" and bool(rng.random() < 0.5)
        self.docs = [rng.integers(0, V, int(rng.integers(30, 170))).tolist() for _ in range(4)]
        self.headers = [rng.integers(0, V, n).tolist() for n in (0, 10, 33, 45)]
        self.max_prompt = 45 + 3 * 170 + 12
        # Room for the largest request and a little more: requests wait for each other, and
        # the indexes are evicted to admit nearly every one.
        # (A heal never evicts: it needs free slots, so with heal on the pool is larger.)
        slots = self.max_prompt + 8 + int(rng.choice([1200, 2500] if heal else [8, 200, 900]))
        kr_slots, r = None, rng.random()
        if r < 0.25:  # more k_r slots than c_KV ones: sessions sharing moved content
            kr_slots = slots + int(rng.integers(100, 600))
        elif r < 0.4:  # fewer: the k_r space is the one that runs out
            slots, kr_slots = slots + int(rng.integers(100, 600)), slots
        live = self.mode == "live"
        cache = CacheConfig(
            heal=heal, capacity=[None, None, 400, 1200][int(rng.integers(4))],
            regions=bool(rng.random() < 0.8), head_probe=bool(rng.random() < 0.8),
            # Repair computes some reused tokens (live only; the check layer needs two layers).
            recompute_head=int(rng.choice([0, 0, 8])) if live else 0,
            recompute_share=0.25 if live and self.layers > 1 and rng.random() < 0.3 else 0.0)
        self.config = EngineConfig(
            mode=self.mode, slots=slots, kr_slots=kr_slots,
            batch_tokens=int(rng.choice([48, 128, 512])),
            chunk_tokens=int(rng.choice([16, 64, 256])),
            max_running=[None, None, 1, 3][int(rng.integers(4))],
            await_shared=int(rng.choice([0, 48, 96])), pic_audit_rate=0.5, idle_delay_s=0.0,
            heal_tokens=int(rng.choice([32, 256])), cache=cache)
        self.engine = Engine(self.model, self.config)
        self.scheduler = Scheduler(self.engine)
        self.requests: dict[str, Tracked] = {}
        self.order: list[Tracked] = []
        self.plans = 0
        self._watch_plans()

    # -- what every plan may serve -----------------------------------------------------------

    def _watch_plans(self) -> None:
        """Check each plan as the cache manager makes it: hits are live entries of the plan's
        namespace holding the prompt's very tokens, at or past the carve-out."""
        planner = self.engine.cache.planner
        plan_tail = planner.plan_tail

        def checked(tokens: np.ndarray, prefix: object, resets: object = (), *,
                    namespace: int = 0) -> Plan:
            plan = plan_tail(tokens, prefix, resets, namespace=namespace)
            self.plans += 1
            for s in plan.hits:
                e = s.entry
                assert e.registered and e.namespace == namespace, "a hit on a dead or foreign entry"
                assert s.start >= planner.config.carve_out, "reuse below the carve-out"
                assert np.array_equal(e.tokens[s.offset:s.offset + s.size], tokens[s.start:s.end])
            return plan

        planner.plan_tail = checked  # an instance attribute: this engine only

    # -- the workload ------------------------------------------------------------------------

    def make_prompt(self, fan_out: tuple[list[list[int]], int] | None = None
                    ) -> tuple[list[int], list[int], int]:
        """A prompt; with ``fan_out`` (documents, namespace), one of agents sent together:
        those documents behind a header of its own."""
        rng = self.rng
        finished = [t for t in self.order if t.done and t.out]
        r = 1.0 if fan_out else rng.random()
        if finished and r < 0.4:
            base = finished[int(rng.integers(len(finished)))]
            ns = base.namespace if rng.random() < 0.8 else int(rng.integers(3))
            if r < 0.3:  # a follow-up turn: its exact prefix includes the earlier output
                tokens = base.prompt + base.out + rng.integers(0, V, int(rng.integers(1, 12))).tolist()
                resets = base.resets + [len(base.prompt) + len(base.out)]
            else:  # resent as it was
                tokens, resets = list(base.prompt), list(base.resets)
            if len(tokens) <= self.max_prompt:
                return tokens, resets, ns
        tokens = list(self.headers[int(rng.integers(len(self.headers)))])
        tokens += rng.integers(0, V, int(rng.integers(0, 6))).tolist()
        resets: list[int] = []
        docs, ns = fan_out or ([self.docs[j] for j in rng.permutation(len(self.docs))[
            :int(rng.integers(1, 4))].tolist()], int(rng.integers(3)))
        for doc in docs:
            if rng.random() < 0.9:
                resets.append(len(tokens))
                if rng.random() < 0.4:  # a document of two messages: a run of regions
                    resets.append(len(tokens) + len(doc) // 2)
            tokens += doc
        if rng.random() < 0.6:  # the question as a message of its own
            resets.append(len(tokens))
        tokens += rng.integers(0, V, int(rng.integers(0, 13))).tolist()
        return tokens, [r for r in resets if 0 < r <= len(tokens)], ns

    def add(self, fan_out: tuple[list[list[int]], int] | None = None) -> None:
        rng = self.rng
        prompt, resets, ns = self.make_prompt(fan_out)
        stop = tuple(rng.integers(0, V, int(rng.integers(0, 3))).tolist())
        # Mostly short answers; some long ones, whose decode slots admission must set aside.
        max_tokens = int(rng.integers(1, 9) if rng.random() < 0.7 else rng.integers(9, 41))
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop,
                                temperature=0.0 if rng.random() < 0.85 else 0.8,
                                seed=int(rng.integers(1 << 30)))
        capacity = self.engine.pool.capacity
        if len(prompt) + params.max_tokens > capacity:  # the reference: refused up front
            with pytest.raises(PromptTooLong):
                self.scheduler.add(prompt, params, resets=resets, namespace=ns)
            return
        request_id = self.scheduler.add(prompt, params, resets=resets, namespace=ns)
        assert request_id not in self.requests
        tracked = Tracked(request_id, prompt, params, ns, resets)
        self.requests[request_id] = tracked
        self.order.append(tracked)

    def abort(self) -> None:
        """Abort any request, finished ones included: found exactly when it was not done."""
        if not self.order:
            return
        # Mostly a request in flight (a prefill cut short, a decode stopped), else any.
        running = [self.requests[r.id] for r in self.scheduler.running]
        prefilling = [self.requests[r.id] for r in self.scheduler.running if r.state == "prefill"]
        r = self.rng.random()
        pool = (prefilling if prefilling and r < 0.35 else running if running and r < 0.7
                else self.order)
        t = pool[int(self.rng.integers(len(pool)))]
        found = self.scheduler.abort(t.id, "abort", remember=bool(self.rng.random() < 0.6))
        assert found == (not t.done), f"abort of {t.id} returned {found}"
        if found:
            t.finishes += 1
            t.reason = "abort"

    def absorb(self, outputs: list[StepOutput]) -> None:
        """A step's outputs into the reference: nothing after a finish, nothing failed."""
        for out in outputs:
            t = self.requests[out.request_id]
            assert not t.done, f"{t.id} emitted after it finished"
            assert out.error is None, f"{t.id} failed: {out.error}"
            assert len(out.new_tokens) == 1
            t.out += out.new_tokens
            if out.stats is not None:
                assert t.stats is None and len(t.out) == 1, "stats come with the first token"
                t.stats = out.stats
            assert out.finished == (out.finish_reason is not None)
            if out.finished:
                t.finishes += 1
                t.reason = out.finish_reason

    def check_step(self) -> None:
        scheduler, engine = self.scheduler, self.engine
        scheduler.check()  # every slot's count equals its references
        assert scheduler.failed == 0, "a request failed (an admitted one ran out of slots?)"
        running = {r.id for r in scheduler.running}
        waiting = {r.id for r in scheduler.waiting}
        assert not running & waiting
        assert len(scheduler.running) <= scheduler.max_running
        assert running | waiting == {t.id for t in self.order if not t.done}, (
            "the scheduler holds other requests than the unfinished ones")
        assert all(r.state in ("prefill", "decode") for r in scheduler.running)
        assert all(r.state == "waiting" for r in scheduler.waiting)
        # A request set aside to wait for shared content (planned again only once another
        # prefill lands) waits on a prefill that is still in flight: else nothing would ever
        # wake it up but unrelated traffic. (_landed: the scheduler's count of landings.)
        if any(r.awaited_at == scheduler._landed for r in scheduler.waiting):
            assert any(r.state == "prefill" for r in scheduler.running), (
                "a request waits for shared content that nothing is computing")
        seqs = {id(r.seq) for r in scheduler.running}
        healing = engine.cache.healing
        if healing is not None:
            seqs.add(id(healing.seq))
        assert {id(s) for s in engine.sequences} == seqs, "a sequence outlived its request"

    def check_served(self, t: Tracked) -> None:
        """Where the prompt came from adds up, and the prefix served from the radix tree is one
        another sequence of its namespace really shares (brute force over every request's
        prompt + output: a bound, as the tree holds no more than what they sent)."""
        s = t.stats
        cached = s.prefix_tokens + s.derived_prefix_tokens
        assert cached + s.pic_tokens + s.prefilled_tokens == s.prompt_tokens == len(t.prompt)
        assert s.pic_tokens == s.derived_prefix_tokens == 0 or self.mode == "live"
        assert s.would_be_pic_tokens == 0 or self.mode == "observer"
        earlier = [o.prompt + o.out for o in self.order
                   if o is not t and o.namespace == t.namespace]
        assert cached <= max((_lcp(t.prompt, e) for e in earlier), default=0), (
            "a prefix served from another namespace or from nowhere")

    # -- the run -----------------------------------------------------------------------------

    def step(self, stalls: int) -> int:
        scheduler = self.scheduler
        outputs = scheduler.step()
        self.absorb(outputs)
        self.check_step()
        # Progress: work waiting with nothing running and nothing emitted can only wait for
        # something that will never happen (a request to leave, a prefill to land).
        stuck = bool(scheduler.waiting) and not scheduler.running and not outputs
        stalls = stalls + 1 if stuck else 0
        assert stalls < 2, "the scheduler stalls: requests wait with nothing running"
        return stalls

    def idle(self, calls: int) -> None:
        """Up to ``calls`` idle calls (a heal forward or an audit each), checked after each."""
        for _ in range(calls):
            if not self.scheduler.run_idle():
                break
            self.check_step()

    def run(self, steps: int) -> None:
        rng, scheduler = self.rng, self.scheduler
        stalls = 0
        for _ in range(steps):
            r = rng.random()
            if r < 0.3:  # requests arrive while others run
                if rng.random() < 0.25:  # agents sent together, sharing documents
                    docs = [self.docs[j] for j in rng.permutation(len(self.docs))[
                        :int(rng.integers(0, 2))].tolist()]
                    # ... often a new one too (a retrieved document): one computes it, the
                    # others wait for it, unless await_shared is 0
                    if not docs or rng.random() < 0.5:
                        docs.append(rng.integers(0, V, int(rng.integers(120, 300))).tolist())
                    fan_out = (docs, int(rng.integers(3)))
                    for _ in range(int(rng.integers(2, 5))):
                        self.add(fan_out)
                else:
                    for _ in range(int(rng.integers(1, 3))):
                        self.add()
            elif r < 0.38:
                self.abort()
            elif r < 0.44:  # a lull: everything finishes and idle work starts
                stalls = self.drain(stalls)
            if scheduler.has_work():
                stalls = self.step(stalls)
            else:
                self.idle(int(rng.integers(0, 4)))  # maybe cut short by the next request
        self.drain(stalls)
        self.idle(10_000)
        assert not scheduler.idle_pending()
        self.check_end()

    def drain(self, stalls: int) -> int:
        for _ in range(2000):
            if not self.scheduler.has_work():
                return stalls
            stalls = self.step(stalls)
        raise AssertionError("requests never finished")

    def check_end(self) -> None:
        engine, scheduler = self.engine, self.scheduler
        for t in self.order:
            assert t.finishes == 1, f"{t.id} finished {t.finishes} times"
            stop, n = set(t.params.stop_token_ids), t.params.max_tokens
            assert len(t.out) <= n and not stop & set(t.out[:-1])
            if t.reason == "abort":
                assert len(t.out) < n and not stop & set(t.out)
            elif t.out and t.out[-1] in stop:
                assert t.reason == "stop"
            else:
                assert t.reason == "length" and len(t.out) == n
            if t.stats is not None:
                self.check_served(t)
        # No slot leaks: nothing holds a slot but the indexes, and once they are cleared every
        # slot is free again, in both slot spaces; nothing is left in flight.
        assert not engine.sequences and engine.cache.healing is None
        scheduler.check()
        engine.cache.clear()
        scheduler.check()
        pool = engine.pool
        assert pool.ckv_slots.free == pool.num_slots and pool.kr_slots.free == pool.num_kr_slots
        # (private, but a count left behind makes later requests wait for nothing)
        assert not engine.cache._in_flight, "prefills still counted in flight"
        self.check_outputs()

    def check_outputs(self) -> None:
        """Greedy outputs against the cache-off engine, teacher-forced: the prompt prefilled
        and the output fed back, each token must be that engine's greedy choice (or tie)."""
        reference = Engine(self.model, EngineConfig(mode="off", slots=self.max_prompt + 64))
        compared = 0
        for t in self.order:
            if not t.out or not t.params.greedy:
                continue
            s = t.stats
            exact = s.pic_tokens == 0 and s.derived_prefix_tokens == 0
            if self.mode == "live" and self.layers > 1 and not exact:
                continue  # reused rows of a deep model are close, not equal
            seq, last = reference.prefill(t.prompt)
            rows = [last[None]]
            if len(t.out) > 1:
                rows.append(reference.extend(seq, t.out[:-1]))
            reference.finish(seq, remember=False)  # the reference keeps no cache
            logits = torch.cat(rows).float()
            best = logits.argmax(-1).tolist()
            if best != t.out:  # a near-tie the other way is fine; a wrong token is not
                chosen = logits[torch.arange(len(t.out)), torch.tensor(t.out)]
                gap = logits.max(-1).values - chosen
                assert float(gap.max()) <= TIE * float(logits.abs().max()), (
                    f"{t.id} ({self.mode}, {self.layers} layers, stats {s}): {t.out} != {best}")
            compared += 1
        reference.check()
        assert compared > 0


@pytest.mark.parametrize("seed", range(SEEDS))
def test_scheduler_workload_against_reference(models: dict[int, MLAModel], seed: int) -> None:
    """A random workload: invariants after every step, lives and outputs at the end."""
    workload = Workload(models, seed)
    workload.run(STEPS)
    assert len(workload.order) >= 10 and workload.plans > 0
