"""Continuous batching: batched, chunked, interleaved serving gives what serving alone gives."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from fixtures.tiny_models import build

from irminsul.config import CacheConfig, EngineConfig
from irminsul.engine import Engine, SamplingParams, Scheduler
from irminsul.engine.scheduler import sample
from irminsul.model import load_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v3")
    build("v3_like", directory)
    return load_model(directory)


def _prompts(seed: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 97, int(rng.integers(80, 260))) for _ in range(4)]
    return [np.concatenate([rng.integers(0, 97, int(rng.integers(3, 50)))]
                           + [docs[j] for j in rng.permutation(4)[:2]]) for _ in range(count)]


def _drain(scheduler: Scheduler, ids: list[str]) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {i: [] for i in ids}
    while scheduler.has_work():
        for out in scheduler.step():
            outs[out.request_id] += out.new_tokens
        scheduler.engine.check()  # slot accounting exact after every step
    return outs


@pytest.mark.parametrize("mode", ["off", "observer"])
def test_batched_outputs_equal_solo_outputs(model, mode: str) -> None:
    """Twelve requests batched together, prefilled in 64-token chunks under a 200-token batch
    budget, produce the greedy outputs each gets alone on a fresh engine (exact-prefix only)."""
    prompts = _prompts(0, 12)
    rng = np.random.default_rng(1)
    lengths = [int(rng.integers(1, 7)) for _ in prompts]
    scheduler = Scheduler(Engine(model, EngineConfig(slots=4000, mode=mode)), batch_tokens=200,
                          chunk_tokens=64)
    ids = [scheduler.add(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, lengths)]
    outs = _drain(scheduler, ids)
    for request_id, prompt, n in zip(ids, prompts, lengths):
        alone, _ = Engine(model, EngineConfig(slots=4000, mode="off")).generate(prompt, n)
        assert outs[request_id] == alone


def test_greedy_matches_full_recomputation(model) -> None:
    """The scheduler's greedy tokens equal argmax decoding with full forwards, no cache."""
    prompt = _prompts(2, 1)[0]
    scheduler = Scheduler(Engine(model, EngineConfig(slots=2000)), chunk_tokens=50)
    request = scheduler.add(prompt, SamplingParams(max_tokens=5))
    got = _drain(scheduler, [request])[request]
    seq = list(prompt)
    for _ in range(5):
        seq.append(int(model.logits(torch.tensor(seq))[-1].argmax()))
    assert got == seq[len(prompt):]


def test_admission_waits_for_slots(model) -> None:
    """With room for about one request at a time, all still finish, never overcommitting."""
    prompts = _prompts(3, 4)
    need = max(p.size for p in prompts) + 4
    scheduler = Scheduler(Engine(model, EngineConfig(slots=need + 10, mode="live")))
    ids = [scheduler.add(p, SamplingParams(max_tokens=4)) for p in prompts]
    first = scheduler.step()
    assert len(scheduler.running) == 1 and len(scheduler.waiting) == 3
    outs = _drain(scheduler, ids)
    for out in first:
        outs[out.request_id] = out.new_tokens + outs[out.request_id]
    assert all(len(v) == 4 for v in outs.values())


def test_abort_frees_slots(model) -> None:
    engine = Engine(model, EngineConfig(slots=3000))
    scheduler = Scheduler(engine, chunk_tokens=32)
    a = scheduler.add(_prompts(4, 1)[0], SamplingParams(max_tokens=50))
    b = scheduler.add(_prompts(5, 1)[0], SamplingParams(max_tokens=50))
    scheduler.step()
    assert scheduler.abort(a) and scheduler.abort(b, reason="stop")
    assert not scheduler.has_work() and not engine.sequences
    engine.check()
    assert not scheduler.abort("nope")


def test_abort_without_remembering_keeps_no_rows(model) -> None:
    """A decoding request aborted keeps its decoded rows in the prefix index beside its prompt's
    (which its prefill committed): a later request that continues it matches them. Aborted
    with remember=False, as after a failed step whose rows may be unwritten, it keeps only the
    prompt's."""
    prompt = _prompts(6, 1)[0]
    for remember in (True, False):
        engine = Engine(model, EngineConfig(slots=3000))
        scheduler = Scheduler(engine)
        request = scheduler.add(prompt, SamplingParams(max_tokens=50))
        output: list[int] = []
        while len(output) < 4:  # prefilled, then decoding
            output += [t for o in scheduler.step() for t in o.new_tokens]
        assert scheduler.abort(request, "error", remember=remember)
        engine.check()
        match = engine.cache.planner.radix.match_prefix(np.concatenate([prompt, output]))
        # The last token's row is computed by the step after it: the rows end one before.
        assert match.length == (prompt.size + len(output) - 1 if remember else prompt.size)


def test_drop_leaves_the_queues_without_touching_the_engine(model) -> None:
    """drop (the server's last resort when abort raises) removes a request from both queues;
    its sequence stays in the engine, which check() still accounts for."""
    engine = Engine(model, EngineConfig(slots=3000))
    scheduler = Scheduler(engine, chunk_tokens=32, max_running=1)
    a = scheduler.add(_prompts(4, 1)[0], SamplingParams(max_tokens=50))
    b = scheduler.add(_prompts(5, 1)[0], SamplingParams(max_tokens=50))
    scheduler.step()
    assert [r.id for r in scheduler.running] == [a] and [r.id for r in scheduler.waiting] == [b]
    scheduler.drop(a)
    scheduler.drop(b)
    assert not scheduler.has_work() and len(engine.sequences) == 1
    engine.check()


def test_rejects_what_can_never_run(model) -> None:
    scheduler = Scheduler(Engine(model, EngineConfig(slots=100)))
    with pytest.raises(ValueError, match="exceeds the KV pool of 100 tokens"):
        scheduler.add(list(range(90)), SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        scheduler.add([1] * 4000, SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="empty prompt"):
        scheduler.add([], SamplingParams())


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(top_k=-2)])
def test_invalid_sampling_parameters(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_sampling_rules() -> None:
    """top_k=1 and a tiny top_p are greedy; a seed makes sampling reproducible; sampling at
    temperature 1 follows the softmax (checked by frequency)."""
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0])
    g = np.random.default_rng()
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1), g) == 1
    assert sample(logits, SamplingParams(temperature=1.0, top_p=1e-3), g) == 1
    draws = [sample(logits, SamplingParams(temperature=1.0), np.random.default_rng(s))
             for s in range(8)]
    again = [sample(logits, SamplingParams(temperature=1.0), np.random.default_rng(s))
             for s in range(8)]
    assert draws == again
    g = np.random.default_rng(0)
    counts = np.bincount([sample(logits, SamplingParams(temperature=1.0), g)
                          for _ in range(4000)], minlength=4) / 4000
    assert np.allclose(counts, logits.softmax(-1).numpy(), atol=0.03)
    top2 = {sample(logits, SamplingParams(temperature=1.0, top_k=2), g) for _ in range(200)}
    assert top2 == {1, 2}


def test_every_bit_of_a_seed_counts(model) -> None:
    """A seed is 64 bits (OpenAI's API takes any 64-bit integer): seeds that differ only above
    the low 32 bits, or by sign, draw their own tokens; each seed again draws the same ones.
    (torch's CPU generator kept only the low 32 bits: 1 and 2**32 + 1 drew the same.)"""
    prompt = _prompts(8, 1)[0]
    seeds = (1, 2**32 + 1, 2**62 + 1, -(2**63) + 1)

    def draw(seed: int) -> list[int]:
        scheduler = Scheduler(Engine(model, EngineConfig(slots=2000)))
        # At a high temperature the tiny model's next token is close to uniform over its
        # vocabulary: two independent draws of 12 tokens agree with probability ~0.
        request = scheduler.add(prompt, SamplingParams(max_tokens=12, temperature=5.0,
                                                       seed=seed))
        return _drain(scheduler, [request])[request]

    outputs = [draw(seed) for seed in seeds]
    assert len({tuple(out) for out in outputs}) == len(seeds), outputs
    assert draw(seeds[1]) == outputs[1]


def test_ragged_batch_equals_separate_forwards(model) -> None:
    """forward_batch over sequences with different contexts equals one forward per sequence."""
    rng = np.random.default_rng(6)
    items = []
    for n_ctx, n_new in ((0, 7), (30, 1), (12, 5)):
        ids = torch.from_numpy(rng.integers(0, 97, n_ctx + n_new))
        ctx = model.forward(ids[:n_ctx], torch.arange(n_ctx)).latents if n_ctx else None
        items.append((ids[n_ctx:], torch.arange(n_ctx, n_ctx + n_new), ctx))
    batched = model.forward_batch(*zip(*items))
    for (ids, pos, ctx), out in zip(items, batched):
        single = model.forward(ids, pos, ctx)
        assert torch.allclose(out.logits, single.logits, atol=1e-5)
        for a, b in zip(out.latents, single.latents):
            assert torch.allclose(a, b, atol=1e-5)


def test_requests_sharing_a_document_are_admitted_by_their_plans(model) -> None:
    """Admission counts what a request's plan will allocate: requests reusing a cached
    document at shifted positions need k_r slots for it, not c_KV ones. With k_r room for all of
    them and c_KV room for their own tokens, three run together; with as many k_r slots as c_KV
    ones, one at a time. All finish and the accounting holds."""
    rng = np.random.default_rng(7)
    doc, tokens = rng.integers(0, 97, 300), 4
    prompts = []
    for i in range(4):
        header = rng.integers(0, 97, 40 + 5 * i)  # the document past the sink's 32
        header[0] = i  # no exact prefix in common
        prompts.append(np.concatenate([header, doc]))
    first = len(prompts[0]) + tokens  # held by the indexes once served
    own = sum(len(p) - len(doc) + tokens for p in prompts[1:])  # each request's own tokens
    shared = sum(len(p) + tokens for p in prompts[1:])  # its k_r, the document's included
    admitted = {}
    for name, kr_slots in (("split", first + shared + 8), ("equal", None)):
        engine = Engine(model, EngineConfig(slots=first + own + 8, kr_slots=kr_slots, mode="live"))
        scheduler = Scheduler(engine)
        _drain(scheduler, [scheduler.add(prompts[0], SamplingParams(max_tokens=tokens),
                                         resets=[len(prompts[0]) - len(doc)])])
        ids = [scheduler.add(p, SamplingParams(max_tokens=tokens), resets=[len(p) - len(doc)])
               for p in prompts[1:]]
        first_step = scheduler.step()
        admitted[name] = len(scheduler.running)
        outs = _drain(scheduler, ids)
        for out in first_step:
            outs[out.request_id] += out.new_tokens
        assert all(len(out) == tokens for out in outs.values())
    assert admitted == {"split": 3, "equal": 1}


def test_no_fixed_cap_on_running_requests(model) -> None:
    """Without max_running, the pool decides: 100 short requests all run at once when it holds
    them (the old cap was 64); in a pool for 40 of them, 40 run and the rest wait."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 97, 20) for _ in range(100)]
    for slots, expect in ((100 * 24, 100), (40 * 24, 40)):
        scheduler = Scheduler(Engine(model, EngineConfig(slots=slots)), batch_tokens=4096)
        ids = [scheduler.add(p, SamplingParams(max_tokens=4)) for p in prompts]
        first = scheduler.step()
        assert len(scheduler.running) == expect and len(scheduler.waiting) == 100 - expect
        outs = _drain(scheduler, ids)
        for out in first:
            outs[out.request_id] = out.new_tokens + outs[out.request_id]
        assert all(len(tokens) == 4 for tokens in outs.values())
    # Every running request decodes a token per step: batch_tokens bounds them.
    assert Scheduler(Engine(model, EngineConfig(slots=100)), batch_tokens=32).max_running == 32


def _shared_body_requests(count: int) -> tuple[list[np.ndarray], list[list[int]]]:
    """``count`` prompts: a header of their own, one shared 600-token body (a document, tool
    schemas), a question of their own; resets at the body's edges, as message starts."""
    rng = np.random.default_rng(9)
    body = rng.integers(0, 97, 600)
    prompts, resets = [], []
    for _ in range(count):
        header = rng.integers(0, 97, int(rng.integers(40, 60)))
        question = rng.integers(0, 97, 12)
        prompts.append(np.concatenate([header, body, question]))
        resets.append([len(header), len(header) + len(body)])
    return prompts, resets


@pytest.mark.parametrize("await_shared", [0, 256])
def test_requests_sent_together_compute_shared_content_once(model, await_shared: int) -> None:
    """Eight requests sharing a 600-token body arrive together. Without waiting (0), each
    computes the body beside the others: no PIC hits. With waiting, the first computes and
    registers it while the others wait, then they reuse it (live PIC): most of the body is
    served from the cache, and every request still gets its tokens."""
    prompts, resets = _shared_body_requests(8)
    scheduler = Scheduler(Engine(model, EngineConfig(slots=8000, mode="live",
                                                     await_shared=await_shared)),
                          batch_tokens=256, chunk_tokens=128)
    plans = []
    start_prefill = scheduler.cache.start_prefill
    scheduler.cache.start_prefill = lambda *a, **kw: plans.append(1) or start_prefill(*a, **kw)
    ids = [scheduler.add(p, SamplingParams(max_tokens=3), resets=r)
           for p, r in zip(prompts, resets)]
    stats, tokens = {}, {i: [] for i in ids}
    while scheduler.has_work():
        for out in scheduler.step():
            tokens[out.request_id] += out.new_tokens
            if out.stats is not None:
                stats[out.request_id] = out.stats
        scheduler.engine.check()
    assert all(len(t) == 3 for t in tokens.values())
    pic = [stats[i].pic_tokens for i in ids]
    if await_shared:
        assert pic[0] == 0 and min(pic[1:]) >= 400
        # A waiting request is planned again only when a prefill lands (here: the first's),
        # not on every step of it: once to wait, once to be admitted.
        assert len(plans) == 1 + 2 * 7
    else:
        assert sum(pic) == 0 and len(plans) == 8


def test_a_request_blocked_for_room_does_not_hold_back_one_awaiting_ahead_of_it(model) -> None:
    """W arrives right behind A, whose shared body it awaits; C, a large unrelated prompt,
    arrives behind W and does not fit while A runs. Once A's prefill lands W reuses the body and
    fits: it must be admitted then, exactly as in the same run without C (a later request never
    delays an earlier one), not only once A has decoded all its tokens and left."""
    prompts, resets = _shared_body_requests(2)
    big = np.random.default_rng(10).integers(0, 97, 900)

    def first_token_step(with_c: bool) -> int:
        engine = Engine(model, EngineConfig(slots=1450, mode="live", await_shared=256))
        scheduler = Scheduler(engine, batch_tokens=256, chunk_tokens=128)
        a = scheduler.add(prompts[0], SamplingParams(max_tokens=50), resets=resets[0])
        w = scheduler.add(prompts[1], SamplingParams(max_tokens=3), resets=resets[1])
        ids = [a, w] + ([scheduler.add(big, SamplingParams(max_tokens=3))] if with_c else [])
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        first, step = None, 0
        while scheduler.has_work():
            step += 1
            for out in scheduler.step():
                tokens[out.request_id] += out.new_tokens
                if out.request_id == w and first is None:
                    first = step
                    assert out.stats.pic_tokens >= 400  # W reused A's body
            engine.check()
        assert [len(tokens[i]) for i in ids] == [50] + [3] * (len(ids) - 1)
        return first

    alone = first_token_step(with_c=False)
    assert alone < 20  # admitted right after A's prefill, long before A's 50 tokens
    assert first_token_step(with_c=True) == alone


def test_observer_never_waits_for_shared_content(model) -> None:
    """Observer computes its hits anyway: waiting would only delay a request, so all eight are
    admitted at once."""
    prompts, resets = _shared_body_requests(8)
    scheduler = Scheduler(Engine(model, EngineConfig(slots=8000, mode="observer")),
                          batch_tokens=256, chunk_tokens=128)
    for p, r in zip(prompts, resets):
        scheduler.add(p, SamplingParams(max_tokens=3), resets=r)
    scheduler.step()
    assert len(scheduler.running) == 8 and not scheduler.waiting


HEAL = CacheConfig(heal=True)


def _turns(seed: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """A source prompt and a turn reusing its document behind another header (past the sink)."""
    rng = np.random.default_rng(seed)
    doc = rng.integers(0, 97, 300)
    first, second = rng.integers(0, 97, 40), rng.integers(0, 97, 60)
    second[0] = (first[0] + 1) % 97
    return np.concatenate([first, doc]), np.concatenate([second, doc]), [60]


def test_idle_time_heals_a_reusing_turn(model) -> None:
    """Between turns the scheduler recomputes, heal_tokens per idle call, the rows a turn
    reused: its follow-up is then served as an exact prefix whose greedy tokens equal full
    recomputation's, and nothing is left pending."""
    source, turn, resets = _turns(11)
    scheduler = Scheduler(Engine(model, EngineConfig(slots=4000, mode="live", heal_tokens=64,
                                                     idle_delay_s=0.0, cache=HEAL)))
    assert not scheduler.run_idle()
    _drain(scheduler, [scheduler.add(source, SamplingParams(max_tokens=2), resets=[40])])
    request = scheduler.add(turn, SamplingParams(max_tokens=3), resets=resets)
    first = _drain(scheduler, [request])[request]
    assert scheduler.idle_pending()
    calls = 0
    while scheduler.run_idle():
        calls += 1
        scheduler.engine.check()
    assert calls >= 5 and not scheduler.idle_pending()  # 300+ rows, 64 per call
    follow = np.concatenate([turn, first, np.arange(5)])
    request = scheduler.add(follow, SamplingParams(max_tokens=3))
    stats = None
    outs: list[int] = []
    while scheduler.has_work():
        for out in scheduler.step():
            outs += out.new_tokens
            stats = out.stats or stats
    assert stats.prefix_tokens == len(turn) + len(first) - 1  # the last output was never fed
    assert stats.derived_prefix_tokens == stats.pic_tokens == 0
    ids = list(follow)
    for _ in range(3):
        ids.append(int(model.logits(torch.tensor(ids))[-1].argmax()))
    assert outs == ids[len(follow):]


def test_a_request_arriving_mid_heal_takes_its_room(model) -> None:
    """A heal paused between idle calls holds fresh slots; a request that needs them gives the
    heal up and runs. Nothing leaks."""
    source, turn, resets = _turns(12)
    engine = Engine(model, EngineConfig(slots=1100, mode="live", heal_tokens=64,
                                        idle_delay_s=0.0, cache=HEAL))
    scheduler = Scheduler(engine)
    _drain(scheduler, [scheduler.add(source, SamplingParams(max_tokens=2), resets=[40])])
    _drain(scheduler, [scheduler.add(turn, SamplingParams(max_tokens=2), resets=resets)])
    assert scheduler.run_idle() and engine.cache.healing is not None
    big = np.random.default_rng(13).integers(0, 97, 1100 - 8)
    big[0] = (source[0] + 2) % 97
    request = scheduler.add(big, SamplingParams(max_tokens=4))
    out = _drain(scheduler, [request])[request]
    assert len(out) == 4 and engine.cache.healing is None
    scheduler.check()


def test_idle_work_waits_for_the_idle_delay(model) -> None:
    """A heal is due only idle_delay_s after the latest step: run_idle declines before, and
    idle_wait says how long is left."""
    source, turn, resets = _turns(14)
    scheduler = Scheduler(Engine(model, EngineConfig(slots=4000, mode="live", idle_delay_s=0.3,
                                                     cache=HEAL)))
    _drain(scheduler, [scheduler.add(source, SamplingParams(max_tokens=2), resets=[40])])
    _drain(scheduler, [scheduler.add(turn, SamplingParams(max_tokens=2), resets=resets)])
    wait = scheduler.idle_wait()
    assert wait is not None and 0.0 < wait <= 0.3
    assert not scheduler.run_idle() and scheduler.idle_pending()
    time.sleep(wait)
    assert scheduler.idle_wait() == 0.0 and scheduler.run_idle()
