"""The serving engine end to end, against references that use no cache at all.

The reference for every output is the model's own full forward ``model.logits(ids)`` (greedy
decoding recomputes the whole growing sequence each step) or a fresh engine with caching off that
serves the request alone; the reference for slot accounting is ``engine.check()`` (every slot's
count equals the references the sequences and indexes hold) after every operation.

Tiny random DeepSeek-V3-like checkpoints (vocab 97, hidden 64): three layers (MoE in layers 1-2)
for multi-layer properties, one layer where position-independent reuse with δ-rotation must be
exact.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from fixtures.tiny_models import build

import irminsul.cache.planner as planner_module
import irminsul.cache.registry as registry_module
from irminsul.analysis.consistency import NaiveReuseRunner
from irminsul.cache.cdc import chunk_boundaries
from irminsul.config import CacheConfig, EngineConfig
from irminsul.engine import Engine, ModelRunner, PoolExhausted, SamplingParams, Scheduler
from irminsul.engine.kv_pool import unpack
from irminsul.model import MLAModel, load_model

V = 97


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model3(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v3_3layer")
    build("v3_like", directory, layers=3)
    return load_model(directory)


@pytest.fixture(scope="module")
def models1(tmp_path_factory):
    out = {}
    for case in ("v2_lite_like", "v3_like"):
        directory = tmp_path_factory.mktemp(f"{case}_1layer")
        build(case, directory, layers=1)
        out[case] = load_model(directory)
    return out


# -- references ------------------------------------------------------------------------------------

def greedy_reference(model, prompt, max_tokens: int, stop=()) -> list[int]:
    """Greedy decoding by full recomputation: argmax of model.logits on the growing sequence."""
    ids = [int(t) for t in prompt]
    out: list[int] = []
    while len(out) < max_tokens:
        token = int(model.logits(torch.tensor(ids))[-1].argmax())
        out.append(token)
        if token in set(stop):
            break
        ids.append(token)
    return out


def fresh_generate(model, prompt, max_tokens: int, stop=()) -> list[int]:
    """The request served alone by a fresh engine with caching off."""
    engine = Engine(model, EngineConfig(slots=len(prompt) + max_tokens + 1, mode="off"))
    out, _ = engine.generate(list(prompt), max_tokens, stop=stop)
    engine.check()
    return out


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, from logits, in float64."""
    lp = torch.log_softmax(p_logits.double(), dim=-1)
    lq = torch.log_softmax(q_logits.double(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def shifted_docs(seed: int):
    """A source prompt (header 40, doc A 300, doc B 250) and a target reusing both documents
    reordered and shifted (header 75, B, A, a question of 24), with resets at document starts,
    plus a 16-token continuation to teacher-force."""
    rng = np.random.default_rng(seed)
    doc_a, doc_b = rng.integers(0, V, 300), rng.integers(0, V, 250)
    h1, h2 = rng.integers(0, V, 40), rng.integers(0, V, 75)
    h2[0] = (h1[0] + 1) % V  # no exact prefix in common
    question, cont = rng.integers(0, V, 24), rng.integers(0, V, 16)
    source = np.concatenate([h1, doc_a, doc_b])
    target = np.concatenate([h2, doc_b, doc_a, question])
    return source, [40, 340], target, [75, 325, 625], cont


# -- 1. exact prefix ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["off", "observer", "live"])
def test_exact_prefix_hit_outputs_equal_no_cache(model3, mode: str) -> None:
    """After P1 was served, a prompt P2 sharing a long prefix with it is served from the radix tree
    for exactly the true common prefix, and greedy outputs equal a fresh engine's and full
    recomputation's. Also a follow-up turn P1 + output + new tokens reuses the generated tokens."""
    rng = np.random.default_rng(1)
    p1 = rng.integers(0, V, 300).tolist()
    p2 = p1[:200] + rng.integers(0, V, 60).tolist()
    p2[200] = (p1[200] + 1) % V  # diverges exactly at 200
    engine = Engine(model3, EngineConfig(slots=2000, mode=mode))
    out1, seq1 = engine.generate(p1, 6)
    stored = [p1 + out1[:-1]]  # the last output token is never run, so never cached
    assert out1 == greedy_reference(model3, p1, 6)
    engine.check()

    out2, seq2 = engine.generate(p2, 8)
    engine.check()
    assert seq2.stats.prefix_tokens == max(common_prefix(p2, s) for s in stored) == 200
    assert seq2.stats.prefilled_tokens == len(p2) - 200
    assert seq2.stats.pic_tokens == 0
    assert out2 == fresh_generate(model3, p2, 8) == greedy_reference(model3, p2, 8)
    stored.append(p2 + out2[:-1])

    p3 = p1 + out1 + rng.integers(0, V, 20).tolist()
    out3, seq3 = engine.generate(p3, 5)
    engine.check()
    expected = max(common_prefix(p3, s) for s in stored)
    assert expected == len(p1) + len(out1) - 1
    assert seq3.stats.prefix_tokens == expected
    assert out3 == fresh_generate(model3, p3, 5) == greedy_reference(model3, p3, 5)


def test_whole_prompt_cached_still_gives_its_logits(model3) -> None:
    """A prompt that is entirely in the radix tree (served before) gets correct last-token logits
    (the last token is recomputed) and the same greedy output; tokens add up in the stats."""
    rng = np.random.default_rng(2)
    p = rng.integers(0, V, 120).tolist()
    engine = Engine(model3, EngineConfig(slots=600, mode="off"))
    first, _ = engine.generate(p, 4)
    seq, logits = engine.prefill(p)
    engine.check()
    assert seq.stats.prefix_tokens >= len(p) - 1
    assert (seq.stats.prefix_tokens + seq.stats.pic_tokens + seq.stats.prefilled_tokens
            == seq.stats.prompt_tokens)
    expected = model3.logits(torch.tensor(p))[-1]
    assert float((logits - expected).abs().max()) <= 1e-4
    engine.finish(seq)
    again, _ = engine.generate(p, 4)
    assert again == first == greedy_reference(model3, p, 4)
    engine.check()


# -- 2. observer vs off vs live --------------------------------------------------------------------

def _request_script(engine: Engine, seed: int) -> tuple[list[torch.Tensor], list]:
    """A fixed sequence of requests (source, shifted target with a teacher-forced continuation,
    a second shifted target generated greedily); every logits tensor and every sequence."""
    source, rs, target, rt, cont = shifted_docs(seed)
    logits, seqs = [], []
    seq, last = engine.prefill(source, rs)
    logits.append(last)
    for _ in range(3):
        last = engine.extend(seq, [int(last.argmax())])[-1]
        logits.append(last)
    engine.finish(seq)
    seqs.append(seq)
    engine.check()
    seq, last = engine.prefill(target, rt)
    logits += [last, engine.extend(seq, cont)]
    engine.finish(seq, remember=False)
    seqs.append(seq)
    engine.check()
    rng = np.random.default_rng(seed + 100)
    target2 = np.concatenate([rng.integers(0, V, 50), target[75:]])
    out, seq = engine.generate(target2, 5, resets=[50, 300, 600])
    logits.append(torch.tensor(out))
    seqs.append(seq)
    engine.check()
    return logits, seqs


def test_observer_is_bitwise_off_and_live_serves_pic(model3) -> None:
    """Observer mode runs exactly the forwards of off mode (every logit torch.equal, same outputs)
    while recording would-be PIC hits on the shifted prompts; live mode serves those hits."""
    off_logits, off_seqs = _request_script(Engine(model3, EngineConfig(slots=4000, mode="off")), 0)
    obs_logits, obs_seqs = _request_script(Engine(model3, EngineConfig(slots=4000, mode="observer")), 0)
    assert len(off_logits) == len(obs_logits)
    for a, b in zip(off_logits, obs_logits):
        assert torch.equal(a, b)
    for seq in off_seqs:
        assert seq.stats.would_be_pic_tokens == 0 and seq.stats.pic_tokens == 0
    for seq in obs_seqs:
        assert seq.stats.pic_tokens == 0
        assert seq.stats.prefilled_tokens + seq.stats.prefix_tokens == seq.stats.prompt_tokens
    assert obs_seqs[0].stats.would_be_pic_tokens == 0  # nothing registered yet
    assert obs_seqs[1].stats.would_be_pic_tokens >= 0.9 * 550
    assert obs_seqs[2].stats.would_be_pic_tokens > 0

    live_logits, live_seqs = _request_script(Engine(model3, EngineConfig(slots=4000, mode="live")), 0)
    assert torch.equal(live_logits[0], off_logits[0])  # first request: nothing to reuse
    for obs, live in zip(obs_seqs, live_seqs):
        assert live.stats.would_be_pic_tokens == 0
        # the same plan; live computes the prompt's last token even when it is a hit, and
        # observer does not count it either
        assert obs.stats.would_be_pic_tokens == live.stats.pic_tokens
        assert (live.stats.prefix_tokens + live.stats.pic_tokens + live.stats.prefilled_tokens
                == live.stats.prompt_tokens)
    assert live_seqs[1].stats.pic_tokens >= 0.9 * 550
    # reuse in a 3-layer model is approximate: the logits really came from reused rows
    assert not torch.equal(live_logits[4], off_logits[4])


def target_logits(model: MLAModel, rotate: bool, source: np.ndarray, rs: list[int],
                  target: np.ndarray, rt: list[int], cont: np.ndarray) -> torch.Tensor:
    """Serve the source, then the target live (its documents from the registry, k_r rotated or,
    for naive reuse, not) and the continuation teacher-forced; the logits after the target's
    last token and each continuation token, [1 + len(cont), V]."""
    engine = Engine(model, EngineConfig(slots=3000, mode="live"),
                    runner=ModelRunner if rotate else NaiveReuseRunner)
    seq, _ = engine.prefill(source, rs)
    engine.finish(seq)
    seq, last = engine.prefill(target, rt)
    assert seq.stats.pic_tokens >= 0.9 * 550  # the documents really were reused
    assert seq.stats.prefix_tokens == 0
    logits = torch.cat([last[None], engine.extend(seq, cont)])
    engine.finish(seq)
    engine.check()
    return logits


# -- 3. one layer: PIC is exact --------------------------------------------------------------------

@pytest.mark.parametrize("case", ["v2_lite_like", "v3_like"])
def test_one_layer_live_pic_equals_full_recomputation(models1, case: str) -> None:
    """In a one-layer model a token's latent row depends on the token and its position only, so
    documents reordered and shifted, served from the registry with k_r rotated by δ, give the
    logits of full recomputation (1e-5) and the same greedy output; naive reuse (no rotation)
    differs by more than 1e-3."""
    model = models1[case]
    source, rs, target, rt, cont = shifted_docs(3)
    full = model.logits(torch.from_numpy(np.concatenate([target, cont])))[len(target) - 1:]
    reference_out = greedy_reference(model, target, 6)
    errors = {rotate: float((target_logits(model, rotate, source, rs, target, rt, cont)
                             - full).abs().max()) for rotate in (True, False)}
    # greedy generation through the PIC path (a second engine: the first has the target cached)
    engine = Engine(model, EngineConfig(slots=3000, mode="live"))
    engine.generate(source, 2, resets=rs)
    out, seq = engine.generate(target, 6, resets=rt)
    engine.check()
    assert seq.stats.pic_tokens >= 0.9 * 550 and seq.stats.prefix_tokens == 0
    assert out == reference_out
    assert errors[True] <= 1e-5, errors
    assert errors[False] > 1e-3, errors


def test_one_layer_chunk_heads_serve_a_cut_document_exactly(models1) -> None:
    """A document served once, then sent again cut 20 tokens into one of its chunks (and
    shifted): with chunk heads the cut chunk is served from the registered one, every token but
    the last (always computed) reused; without, it is prefilled. One layer: both give full
    recomputation's logits (1e-5)."""
    model = models1["v2_lite_like"]
    rng = np.random.default_rng(5)
    doc, h1, h2 = rng.integers(0, V, 600), rng.integers(0, V, 40), rng.integers(0, V, 75)
    h2[0] = (h1[0] + 1) % V  # no exact prefix in common
    cuts = chunk_boundaries(doc)
    j = next(i for i in range(len(cuts) - 1) if cuts[i + 1] - cuts[i] > 40)
    cut = int(cuts[j]) + 20
    source, target = np.concatenate([h1, doc]), np.concatenate([h2, doc[:cut]])
    full = model.logits(torch.from_numpy(target))[-1]
    reused = {}
    for heads in (False, True):
        engine = Engine(model, EngineConfig(slots=3000, mode="live",
                                            cache=CacheConfig(head_probe=heads)))
        seq, _ = engine.prefill(source, [40])
        engine.finish(seq)
        seq, last = engine.prefill(target, [75])
        reused[heads] = seq.stats.pic_tokens
        assert (last - full).abs().max() <= 1e-5
        engine.finish(seq)
        engine.check()
    assert reused[True] == cut - 1
    assert reused[False] == int(cuts[j])  # the chunks before the cut one


def test_novel_spans_run_in_one_forward(models1) -> None:
    """A prefill's novel spans between reused documents come out of one advance (one forward),
    each at its own positions, and still give full recomputation's logits (one layer: exact); a
    budget cuts them into several forwards with the same result."""
    model = models1["v2_lite_like"]
    source, rs, target, rt, _ = shifted_docs(3)
    full = model.logits(torch.from_numpy(target))[-1]
    for budget in (len(target), 7):
        engine = Engine(model, EngineConfig(slots=3000, mode="live"))
        seq, _ = engine.prefill(source, rs)
        engine.finish(seq)
        prefill = engine.start_prefill(target, rt)
        spans, last = [], None
        while (span := engine.advance(prefill, budget)) is not None:
            spans.append(span[1])
            assert np.array_equal(span[0], target[span[1]])
            last = engine.run_batch([(prefill.seq, *span)])[0][-1]
        engine.complete_prefill(prefill)
        computed = np.concatenate(spans)
        assert computed[-1] == len(target) - 1 and np.all(np.diff(computed) > 0)
        if budget == len(target):
            assert len(spans) == 1 and (np.diff(spans[0]) > 1).any()  # gaps: one forward
        else:
            assert all(len(s) <= budget for s in spans) and len(spans) > 1
        assert (last - full).abs().max() <= 1e-5
        engine.finish(prefill.seq)
        engine.check()



def test_slots_to_come_are_the_slots_a_prefill_allocates(model3) -> None:
    """What admission reserves for a prefill (slots_to_come) is what serving it takes from the
    free lists, counted there: a follow-up whose radix match runs over an earlier turn's reused
    rows (a derived prefix, shared as the tree holds it) allocates for its new tokens alone."""
    source, rs, target, rt, cont = shifted_docs(4)
    engine = Engine(model3, EngineConfig(slots=4000, mode="live"))
    for prompt, resets in ((source, rs), (target, rt)):
        seq, _ = engine.prefill(prompt, resets)
        turn = seq.tokens.copy()
        engine.finish(seq)
    follow = np.concatenate([turn, cont])
    prefill = engine.start_prefill(follow, rt + [len(turn)])
    predicted = prefill.slots_to_come()
    pool = engine.pool
    free = (pool.ckv_slots.free, pool.kr_slots.free)
    while (span := engine.advance(prefill, 10_000)) is not None:
        engine.run_batch([(prefill.seq, *span)])
    taken = (free[0] - pool.ckv_slots.free, free[1] - pool.kr_slots.free)
    engine.complete_prefill(prefill)
    assert prefill.seq.stats.derived_prefix_tokens > 300
    assert predicted == taken == (len(cont), len(cont))
    engine.finish(prefill.seq)
    engine.check()


def test_follow_up_of_a_reusing_turn_is_not_an_exact_prefix_hit(model3) -> None:
    """A turn that reused documents is inserted in the radix tree whole; its follow-up matches
    all of it, but only the rows before the first reused token are a full prefill's. Those are
    counted as the exact prefix, the rest as a derived prefix — and the pool's rows agree: the
    exact part equals a fresh prefill of the follow-up, the derived part does not (3 layers)."""
    source, rs, target, rt, cont = shifted_docs(4)
    engine = Engine(model3, EngineConfig(slots=4000, mode="live"))
    seq, _ = engine.prefill(source, rs)
    engine.finish(seq)
    seq, _ = engine.prefill(target, rt)
    assert seq.stats.pic_tokens > 400
    first_reused = seq.exact
    assert 75 <= first_reused < 100  # reuse starts inside the first shifted document
    turn = seq.tokens.copy()
    engine.finish(seq)
    follow = np.concatenate([turn, cont])
    seq, _ = engine.prefill(follow, rt + [len(turn)])
    s = seq.stats
    assert (s.prefix_tokens, s.derived_prefix_tokens) == (first_reused, len(turn) - first_reused)
    assert seq.exact == first_reused
    fresh = Engine(model3, EngineConfig(slots=4000, mode="off"))
    ref, _ = fresh.prefill(follow, rt + [len(turn)])
    rows = engine.pool.ckv[:, unpack(seq.handles[:len(turn)])[0]]
    want = fresh.pool.ckv[:, unpack(ref.handles[:len(turn)])[0]]
    gap = (rows - want).abs().amax(dim=(0, 2))  # per position, over layers and latent dims
    assert gap[:first_reused].max() <= 1e-5
    assert gap[first_reused + 32:].min() > 1e-4  # layers >= 1 attended to reused rows
    engine.finish(seq)
    fresh.finish(ref)
    engine.check()


def _reusing_turn(engine: Engine) -> tuple[np.ndarray, list[int], int]:
    """shifted_docs(4)'s source served and finished, then its target (reusing both documents):
    the target's tokens, resets and first reused position."""
    source, rs, target, rt, _ = shifted_docs(4)
    seq, _ = engine.prefill(source, rs)
    engine.finish(seq)
    seq, _ = engine.prefill(target, rt)
    assert seq.stats.pic_tokens > 400
    first_reused = seq.exact
    engine.finish(seq)
    return target, rt, first_reused


def test_heal_makes_a_reusing_turn_a_full_prefill(model3) -> None:
    """Healing the turn that reused documents recomputes its rows from the first reused one on:
    its follow-up is then an exact prefix throughout, and every row the indexes hold for the
    turn — the radix path's, the registry entries registered from it, and the entries it reused
    whole, now moved to it — equals a fresh prefill's (3 layers;
    test_follow_up_of_a_reusing_turn_is_not_an_exact_prefix_hit shows them apart before). The
    slots the reused rows held go back to the pool."""
    engine = Engine(model3, EngineConfig(slots=4000, mode="live", cache=CacheConfig(heal=True)))
    target, rt, first_reused = _reusing_turn(engine)
    fresh = Engine(model3, EngineConfig(slots=4000, mode="off"))
    ref, _ = fresh.prefill(target, rt)
    want_ckv = fresh.pool.ckv[:, unpack(ref.handles)[0]]
    want_kr = fresh.pool.kr[:, unpack(ref.handles)[1]]

    def gap(handles: np.ndarray, start: int) -> torch.Tensor:
        """Per position, the largest difference from the fresh rows over layers and dims."""
        ckv, kr = unpack(handles)
        end = start + len(handles)
        return torch.maximum((engine.pool.ckv[:, ckv] - want_ckv[:, start:end]).abs().amax((0, 2)),
                             (engine.pool.kr[:, kr] - want_kr[:, start:end]).abs().amax((0, 2)))

    from_turn = [e for e in engine.cache.planner.registry.entries()
                 if e.p_source >= first_reused + 32 and e.p_source + e.size <= len(target)
                 and np.array_equal(e.tokens, target[e.p_source:e.p_source + e.size])]
    assert from_turn and all(gap(e.handles, e.p_source).max() > 1e-4 for e in from_turn)
    free = engine.pool.free
    assert engine.cache.heal_pending
    assert engine.heal(budget=100) == len(target) - first_reused
    assert not engine.cache.heal_pending and engine.pool.free == free
    engine.check()
    for entry in from_turn:
        assert gap(entry.handles, entry.p_source).max() <= 1e-5
    # The source's entries the turn reused whole now hold the turn's recomputed rows at their
    # positions in it: the next prompt reuses them from the latest context.
    moved = [e for e in engine.cache.planner.registry.entries() if e not in from_turn
             and e.p_source >= first_reused and e.p_source + e.size <= len(target)
             and np.array_equal(e.tokens, target[e.p_source:e.p_source + e.size])]
    assert sum(e.size for e in moved) >= 500  # both documents
    for entry in moved:
        assert gap(entry.handles, entry.p_source).max() <= 1e-5
    cont = np.arange(16) % V
    seq, _ = engine.prefill(np.concatenate([target, cont]), rt + [len(target)])
    s = seq.stats
    assert (s.prefix_tokens, s.derived_prefix_tokens, s.pic_tokens) == (len(target), 0, 0)
    assert seq.exact is None
    assert gap(seq.handles[:len(target)], 0).max() <= 1e-5
    engine.finish(seq)
    assert not engine.cache.heal_pending  # nothing reused: nothing to heal
    fresh.finish(ref)
    engine.check()


def test_no_heal_runs_while_a_prefill_is_in_flight(model3) -> None:
    """A heal frees the radix path's old handles, which a prefill planned over that path still
    names: with one in flight (planned, not served) a heal is refused, before it starts and
    part way (left as it was); once the prefill is given up, it heals and the slots add up."""
    engine = Engine(model3, EngineConfig(slots=4000, mode="live", cache=CacheConfig(heal=True)))
    target, rt, first_reused = _reusing_turn(engine)
    follow_up = (np.concatenate([target, np.arange(8) % V]), rt + [len(target)])
    pending = engine.cache.start_prefill(*follow_up)
    with pytest.raises(RuntimeError, match="1 prefill"):
        engine.heal()
    engine.cache.abort_prefill(pending)
    assert engine.heal_step(64) == 64  # a heal started, part done
    pending = engine.cache.start_prefill(*follow_up)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.heal_step(10_000)
    assert engine.cache.healing is not None  # kept, to go on between requests
    engine.cache.abort_prefill(pending)
    engine.check()
    assert engine.heal(budget=100) == len(target) - first_reused - 64
    engine.check()


def test_heal_of_a_fork_moves_what_the_prompt_reused(model3) -> None:
    """A turn forked before it finished (two continuations of one prompt): whichever heal runs
    first recomputes the shared prompt, and the entries the prompt reused whole move to it all
    the same (the second heal starts past them)."""
    source, rs, target, rt, _ = shifted_docs(4)
    engine = Engine(model3, EngineConfig(slots=4000, mode="live", cache=CacheConfig(heal=True)))
    seq, _ = engine.prefill(source, rs)
    engine.finish(seq)
    seq, _ = engine.prefill(target, rt)
    twin = engine.fork(seq)
    engine.extend(seq, [1, 2])
    engine.extend(twin, [3])
    engine.finish(seq)
    engine.finish(twin)  # healed first: the newest
    engine.heal()
    engine.check()
    moved = [e for e in engine.cache.planner.registry.entries()
             if e.p_source >= 75 and e.p_source + e.size <= len(target)
             and np.array_equal(e.tokens, target[e.p_source:e.p_source + e.size])]
    assert sum(e.size for e in moved if e.run is None) >= 550  # both documents' regions


def test_heal_off_and_heal_without_room(model3) -> None:
    """With heal off (the default) nothing is queued; with it on but too few free slots for
    the turn's recomputation, the heal is dropped without evicting anything or leaking a slot."""
    engine = Engine(model3, EngineConfig(slots=4000, mode="live"))
    _reusing_turn(engine)
    assert not engine.cache.heal_pending and engine.heal() == 0
    engine = Engine(model3, EngineConfig(slots=1400, mode="live", cache=CacheConfig(heal=True)))
    target, _, first_reused = _reusing_turn(engine)
    assert engine.pool.free < len(target) - first_reused
    stored = engine.cache.planner.radix.total_tokens
    assert engine.heal() == 0 and not engine.cache.heal_pending
    assert engine.cache.planner.radix.total_tokens == stored
    engine.check()


def test_cached_runs_are_counted_once_the_forward_is_issued(models1) -> None:
    """advance serves an exact prefix and PIC hits without counting their slots; until the
    forward counts them, check() sees them as owed, and the plan's locks keep eviction off them
    even when the pool is drained of everything else. Then the counts are exact and the logits
    equal full recomputation (one layer)."""
    model = models1["v2_lite_like"]
    source, rs, target, rt, _ = shifted_docs(4)
    engine = Engine(model, EngineConfig(slots=2000, mode="live"))
    for prompt, resets in ((source, rs), (target[:100], rt[:1])):
        seq, _ = engine.prefill(prompt, resets)
        engine.finish(seq)
    prefill = engine.start_prefill(target, rt)
    tokens, at = engine.advance(prefill, len(target))
    seq = prefill.seq
    # target[:100] reused some of source's rows itself: its tail is served as a derived prefix
    assert seq.stats.prefix_tokens + seq.stats.derived_prefix_tokens == 100
    assert seq.stats.pic_tokens > 400
    assert seq.owed and seq.owed_ckv
    engine.check()
    with pytest.raises(PoolExhausted):
        engine.cache.make_room(engine.pool.capacity)  # evicts every unheld index entry
    engine.check()
    logits = engine.run_batch([(seq, tokens, at)])[0][-1]
    assert not seq.owed and not seq.owed_ckv
    engine.check()
    engine.complete_prefill(prefill)
    engine.finish(seq)
    engine.check()
    assert (logits - model.logits(torch.from_numpy(target))[-1]).abs().max() <= 1e-5


def test_more_kr_slots_hold_more_sessions_sharing_a_document(models1) -> None:
    """Sessions reusing one document at shifted positions share its c_KV slots and each hold
    their own k_r: four of them fit a pool with room for the document's c_KV once and four k_r
    copies, but not a pool of the same c_KV slots and as many k_r slots. Each session's logits
    equal full recomputation (one layer: exact) and the accounting holds."""
    model = models1["v2_lite_like"]
    rng = np.random.default_rng(21)
    doc = rng.integers(0, V, 400)
    prompts = []
    for i in range(4):
        header = rng.integers(0, V, 40 + 7 * i)
        header[0] = i  # no exact prefix in common
        prompts.append(np.concatenate([header, doc]))
    need_kr = sum(len(p) for p in prompts)
    engine = Engine(model, EngineConfig(slots=700, kr_slots=need_kr + 50, mode="live"))
    for prompt in prompts:
        seq, logits = engine.prefill(prompt, [len(prompt) - len(doc)])  # held: sessions live
        assert (logits - model.logits(torch.from_numpy(prompt))[-1]).abs().max() <= 1e-5
        engine.check()
    assert seq.stats.pic_tokens > 300 and engine.pool.free < 100  # c_KV nearly full
    equal = Engine(model, EngineConfig(slots=700, mode="live"))
    with pytest.raises(PoolExhausted):
        for prompt in prompts:
            equal.prefill(prompt, [len(prompt) - len(doc)])
    equal.check()

# -- 4. three layers: δ-rotation vs naive reuse ----------------------------------------------------

KL_SEEDS = (0, 1, 2, 3, 4, 5)


@pytest.fixture(scope="module")
def kl_table(model3):
    """Per prompt: mean KL(p_full || p_engine) over the last prompt position and a 16-token
    teacher-forced continuation, for live PIC (rotated), naive reuse and off mode."""
    table = []
    for seed in KL_SEEDS:
        source, rs, target, rt, cont = shifted_docs(seed)
        full = model3.logits(torch.from_numpy(np.concatenate([target, cont])))[len(target) - 1:]
        row = {"seed": seed}
        for name, mode, rotate in (("pic", "live", True), ("naive", "live", False),
                                   ("off", "off", True)):
            engine = Engine(model3, EngineConfig(slots=3000, mode=mode),
                            runner=ModelRunner if rotate else NaiveReuseRunner)
            seq, _ = engine.prefill(source, rs)
            engine.finish(seq)
            seq, last = engine.prefill(target, rt)
            got = torch.cat([last[None], engine.extend(seq, cont)])
            engine.finish(seq)
            engine.check()
            row[name] = float(kl(full, got).mean())
            row[f"{name}_pic_tokens"] = seq.stats.pic_tokens
            row[f"{name}_logits"] = got
        table.append(row)
    print("\nKL(p_full || p) on shifted-document prompts, 3-layer v3_like:")
    for row in table:
        print(f"  seed {row['seed']}: pic {row['pic']:.6g}  naive {row['naive']:.6g}  "
              f"off {row['off']:.3g}")
    return table


def test_three_layer_kl_measured(kl_table, record_property) -> None:
    """Records KL(p_full||p_pic) and KL(p_full||p_naive) (printed; also as test properties) and
    checks the measurement itself: off mode is exact (KL < 1e-9), both reuse modes really reused
    the documents, rotation changed the logits, and both KLs are finite and positive."""
    for row in kl_table:
        record_property(f"kl_seed{row['seed']}", {k: row[k] for k in ("pic", "naive", "off")})
        assert row["off"] < 1e-9
        assert row["pic_pic_tokens"] >= 0.9 * 550 and row["naive_pic_tokens"] >= 0.9 * 550
        assert 0 < row["pic"] < 1 and 0 < row["naive"] < 1
        assert float((row["pic_logits"] - row["naive_logits"]).abs().max()) > 1e-5


def test_three_layer_pic_beats_naive_when_rope_attention_matters(model3) -> None:
    """The same measurement on the 3-layer model with its rope projections (the k_r rows of
    kv_a_proj_with_mqa and the q_rope rows of q_b_proj, every layer) scaled by 6, so positions
    carry real weight in attention: on every prompt KL(p_full||p_pic) < KL(p_full||p_naive)."""
    model = copy.deepcopy(model3)
    cfg = model.config
    nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.kv_a_proj_with_mqa.weight[cfg.kv_lora_rank:] *= 6
            q = attn.q_b_proj if cfg.q_lora_rank else attn.q_proj
            q.weight.view(cfg.num_attention_heads, nope + rope, -1)[:, nope:] *= 6
    print("\nKL(p_full || p), 3-layer v3_like with rope projections x6:")
    for seed in KL_SEEDS[:4]:
        source, rs, target, rt, cont = shifted_docs(seed)
        full = model.logits(torch.from_numpy(np.concatenate([target, cont])))[len(target) - 1:]
        got = {rotate: float(kl(full, target_logits(model, rotate, source, rs, target, rt,
                                                    cont)).mean()) for rotate in (True, False)}
        print(f"  seed {seed}: pic {got[True]:.6g}  naive {got[False]:.6g}")
        assert got[True] < got[False], (seed, got)


@pytest.mark.parametrize("rotate", [True, False])
def test_reused_rows_share_ckv_and_carry_rotated_kr_in_every_layer(model3, rotate: bool) -> None:
    """Every token served from the registry shares the source token's c_KV slot (same content in
    every layer) and has k_r of its own: rotated by δ = p_target - p_source in every layer (equal
    in layer 0 to the k_r of full recomputation at the target position), or copied unrotated for
    naive reuse."""
    source, rs, target, rt, _ = shifted_docs(5)
    engine = Engine(model3, EngineConfig(slots=3000, mode="live"),
                    runner=ModelRunner if rotate else NaiveReuseRunner)
    src_seq, _ = engine.prefill(source, rs)
    src_rows = engine.pool.rows(src_seq.handles)
    src_ckv, src_kr = unpack(src_seq.handles)
    position_of = {int(c): p for p, c in enumerate(src_ckv)}
    engine.finish(src_seq)
    seq, _ = engine.prefill(target, rt)
    rows = engine.pool.rows(seq.handles)
    ckv, kr = unpack(seq.handles)
    truth = model3.forward(torch.from_numpy(target), torch.arange(len(target))).latents[0]
    rank = model3.config.kv_lora_rank
    shared = [(t, position_of[int(c)]) for t, c in enumerate(ckv) if int(c) in position_of]
    assert len(shared) == seq.stats.pic_tokens >= 0.9 * 550
    assert not set(kr.tolist()) & set(src_kr.tolist())  # k_r slots are never shared
    t_idx = torch.tensor([t for t, _ in shared])
    s_idx = torch.tensor([s for _, s in shared])
    delta = t_idx - s_idx
    assert set(delta.tolist()) == {75 - 340, 325 - 40}
    for layer in range(model3.config.num_hidden_layers):
        assert torch.equal(rows[layer][t_idx, :rank], src_rows[layer][s_idx, :rank])
        base = src_rows[layer][s_idx, rank:]
        expected = model3.rotary.rotate(base, delta) if rotate else base
        torch.testing.assert_close(rows[layer][t_idx, rank:], expected, atol=1e-6, rtol=1e-5)
    if rotate:  # layer 0 against recomputation, independent of the rotary code path
        torch.testing.assert_close(rows[0][t_idx], truth[t_idx], atol=1e-5, rtol=1e-5)
    else:
        assert float((rows[0][t_idx, rank:] - truth[t_idx, rank:]).abs().max()) > 1e-3
    engine.finish(seq)
    engine.check()


# -- 5. slot accounting soak -----------------------------------------------------------------------

class _Open:
    """A sequence the soak keeps open: its request (prompt), its greedy outputs so far and the
    logits that pick the next one."""

    def __init__(self, seq, prompt: list[int], logits: torch.Tensor) -> None:
        self.seq, self.prompt, self.logits, self.out = seq, prompt, logits, []


@pytest.mark.parametrize("mode,layers,capacity", [
    ("off", 3, None), ("observer", 3, None), ("live", 3, None), ("live", 1, 700)])
def test_soak_slot_accounting_and_outputs(model3, models1, mode: str, layers: int,
                                          capacity) -> None:
    """Random traffic from a small pool of documents (random headers, namespaces, resets,
    max_tokens, stop tokens) with a pool far smaller than the traffic, so the indexes are evicted
    again and again; several sequences open at once, extended alternately, forked, finished in
    random order (some with remember=False). engine.check() passes after every operation, the
    stats add up, and every request's greedy output equals a fresh caching-off engine serving it
    alone — in live mode for every request that no reused row can have touched (with one layer,
    where reuse is exact, for every request)."""
    model = model3 if layers == 3 else models1["v3_like"]
    rng = np.random.default_rng(7 + layers)
    docs = [rng.integers(0, V, int(rng.integers(40, 110))).tolist() for _ in range(4)]
    headers = [rng.integers(0, V, n).tolist() for n in (20, 36, 50)]
    max_prompt = 58 + 3 * 110 + 12
    num_slots = 4 * max_prompt + 60  # ≤ 2 open + 1 generate + reuse, and nothing more
    engine = Engine(model, EngineConfig(slots=num_slots, mode=mode,
                                        cache=CacheConfig(capacity=capacity)))
    tainted: set[int] = set()  # handles whose rows a reused (PIC) row may have influenced
    open_: list[_Open] = []
    checks = []  # (prompt, max_tokens, stop, output, clean)
    resets_of: dict[tuple[int, ...], list[int]] = {}
    allocated = 0
    runs = 0  # hits over a run of regions (across a reset)
    plan_tail = engine.cache.planner.plan_tail

    def counting_plan_tail(tokens, prefix, resets=(), **kwargs):  # noqa: ANN001, ANN003, ANN202
        nonlocal runs
        plan = plan_tail(tokens, prefix, resets, **kwargs)
        runs += sum(1 for s in plan.hits if any(s.start < r < s.end for r in resets))
        return plan

    engine.cache.planner.plan_tail = counting_plan_tail

    def make_prompt() -> tuple[list[int], list[int]]:
        """A follow-up turn of an earlier request (prompt + output + new tokens), or a header
        from a small set (maybe extended), one to three documents and a question."""
        while True:
            if checks and rng.random() < 0.2:
                prompt, _, _, out, _ = checks[int(rng.integers(len(checks)))]
                tokens = prompt + out + rng.integers(0, V, int(rng.integers(1, 13))).tolist()
                # the conversation's earlier resets too: chunking restarts at the last reset
                # inside the exact prefix, so a chunk can straddle the prefix end
                resets = resets_of.get(tuple(prompt), []) + [len(prompt) + len(out)]
            else:
                tokens = list(headers[int(rng.integers(len(headers)))])
                tokens += rng.integers(0, V, int(rng.integers(0, 9)) * (rng.random() < 0.5)).tolist()
                resets = []
                for j in rng.choice(len(docs), size=int(rng.integers(1, 4))).tolist():
                    if rng.random() < 0.9:  # a document of two messages: a run of two regions
                        resets += [len(tokens), len(tokens) + len(docs[j]) // 2]
                    tokens += docs[j]
                if rng.random() < 0.5:
                    resets.append(len(tokens))
                tokens += rng.integers(0, V, int(rng.integers(0, 13))).tolist()
            if len(tokens) <= max_prompt and all(o.seq.tokens.tolist() != tokens for o in open_):
                resets_of[tuple(tokens)] = resets
                return tokens, resets

    def served(seq) -> bool:
        """Account a just-prefilled sequence: stats add up; whether its rows are all exact."""
        nonlocal allocated
        s = seq.stats
        cached = s.prefix_tokens + s.derived_prefix_tokens
        assert cached + s.pic_tokens + s.prefilled_tokens == s.prompt_tokens
        assert s.pic_tokens == s.derived_prefix_tokens == 0 or mode == "live"
        assert s.would_be_pic_tokens == 0 or mode == "observer"
        allocated += s.prompt_tokens - cached
        # Rows the radix tree serves as derived came from a sequence that reused content.
        assert tainted.issuperset(seq.handles[s.prefix_tokens:cached].tolist())
        # Clean: every row it was served is a full prefill's (an exact prefix, no reuse), so
        # its output must be a fresh engine's, even where the rows came from a sequence that
        # reused content after them.
        return s.pic_tokens == 0 and s.derived_prefix_tokens == 0

    def account(seq, clean: bool) -> None:
        if not clean:
            tainted.update(seq.handles.tolist())

    def close(o: _Open, remember: bool) -> None:
        o.out.append(int(o.logits.argmax()))
        account(o.seq, o.clean)
        engine.finish(o.seq, remember=remember)
        checks.append((o.prompt, len(o.out), (), o.out, o.clean))

    for _ in range(260):
        op = rng.choice(["generate", "open", "step", "fork", "finish"],
                        p=[0.3, 0.2, 0.25, 0.1, 0.15])
        if op == "generate":
            prompt, resets = make_prompt()
            max_tokens = int(rng.integers(1, 7))
            stop = tuple(rng.integers(0, V, int(rng.integers(0, 3))).tolist())
            out, seq = engine.generate(prompt, max_tokens, resets=resets,
                                       namespace=int(rng.integers(0, 3)), stop=stop)
            clean = served(seq)
            account(seq, clean)
            assert seq.finished and len(out) <= max_tokens
            checks.append((prompt, max_tokens, stop, out, clean))
        elif op == "open" and len(open_) < 2:
            prompt, resets = make_prompt()
            seq, logits = engine.prefill(prompt, resets, namespace=int(rng.integers(0, 3)))
            o = _Open(seq, prompt, logits)
            o.clean = served(seq)
            account(seq, o.clean)  # the prompt is in the radix tree already
            open_.append(o)
        elif op == "step" and open_:
            o = open_[int(rng.integers(len(open_)))]
            if len(o.out) < 6:
                token = int(o.logits.argmax())
                o.logits = engine.extend(o.seq, [token])[-1]
                o.out.append(token)
                allocated += 1
        elif op == "fork" and len(open_) == 1 and len(open_[0].out) < 4:
            o = open_[0]
            twin = engine.fork(o.seq)
            forced = (int(o.logits.argmax()) + 1 + int(rng.integers(V - 1))) % V
            assert forced != int(o.logits.argmax())  # the twin diverges at once
            t = _Open(twin, o.seq.tokens.tolist() + [forced], engine.extend(twin, [forced])[-1])
            t.clean = o.clean
            resets_of[tuple(t.prompt)] = resets_of.get(tuple(o.prompt), [])
            open_.append(t)
            allocated += 1
        elif op == "finish" and open_:
            o = open_.pop(int(rng.integers(len(open_))))
            close(o, remember=bool(rng.random() < 0.7))
        engine.check()
        tainted.intersection_update(h for ref in engine.cache.references() for h in ref.tolist())
    while open_:
        close(open_.pop(int(rng.integers(len(open_)))), remember=bool(rng.random() < 0.7))
        engine.check()

    assert allocated > 3 * num_slots  # far more traffic than slots: eviction had to happen
    compared = 0
    for prompt, max_tokens, stop, out, clean in checks:
        if mode == "live" and layers == 3 and not clean:
            continue
        assert out == fresh_generate(model, prompt, max_tokens, stop), (prompt, out)
        compared += 1
    assert len(checks) >= 40 and compared >= 20
    if mode == "live":
        assert sum(1 for *_, clean in checks if not clean) > 0  # PIC really happened
        assert runs > 0  # and runs of regions were reused whole


# -- 6. tenants ------------------------------------------------------------------------------------

def test_namespaces_are_isolated(model3) -> None:
    """Content served under namespace 0 is invisible under namespaces 1 and 2: the same prompt
    gets prefix_tokens == 0 and pic_tokens == 0 there, and a prompt reusing its documents gets
    pic_tokens == 0; outputs equal a fresh engine's. Controls: under namespace 0 the same prompts
    are served from the caches, and namespace 1 reuses what namespace 1 saw."""
    source, rs, target, rt, _ = shifted_docs(8)
    engine = Engine(model3, EngineConfig(slots=4000, mode="live"))
    engine.generate(source, 3, resets=rs, namespace=0)
    for prompt, resets, namespace in ((source, rs, 1), (target, rt, 2)):
        out, seq = engine.generate(prompt, 4, resets=resets, namespace=namespace)
        assert seq.stats.prefix_tokens == 0 and seq.stats.pic_tokens == 0
        assert out == fresh_generate(model3, prompt, 4)
        engine.check()
    _, seq = engine.generate(source, 3, resets=rs, namespace=0)
    assert seq.stats.prefix_tokens == len(source) - 1
    _, seq = engine.generate(target, 3, resets=rt, namespace=0)
    assert seq.stats.prefix_tokens == 0 and seq.stats.pic_tokens >= 0.9 * 550
    _, seq = engine.generate(target, 3, resets=rt, namespace=1)  # namespace 1 saw the source
    assert seq.stats.prefix_tokens == 0 and seq.stats.pic_tokens >= 0.9 * 550
    engine.check()


# -- 7. fingerprint collisions ---------------------------------------------------------------------

@pytest.fixture
def colliding(monkeypatch):
    """Every chunk and every S1 window gets the same fingerprint."""

    def fingerprints(tokens, boundaries, *, seed=0):
        return np.zeros(len(boundaries), dtype=np.uint64)

    def window_fingerprints(tokens, width, *, seed=0):
        return np.zeros(max(0, len(tokens) - width + 1), dtype=np.uint64)

    monkeypatch.setattr(planner_module, "fingerprints", fingerprints)
    monkeypatch.setattr(planner_module, "window_fingerprints", window_fingerprints)
    monkeypatch.setattr(registry_module, "tiled_window_fingerprints",
                        lambda tokens, width, *, seed=0: np.zeros(len(tokens) // width,
                                                                  dtype=np.uint64))


def test_fingerprint_collisions_never_serve_wrong_kv(model3, colliding) -> None:
    """With every fingerprint colliding, distinct content is never served from the registry
    (pic_tokens == 0, verify_failures > 0) and every output equals a fresh engine's."""
    rng = np.random.default_rng(9)
    engine = Engine(model3, EngineConfig(slots=4000, mode="live"))
    for i in range(5):
        # long chunks (no resets on odd requests) so that S1 sub-windows are registered and probed
        prompt = [i] + rng.integers(0, V, int(rng.integers(300, 600))).tolist()  # no prefix
        resets = ([] if i % 2 else
                  sorted(rng.choice(np.arange(40, len(prompt)), size=2, replace=False).tolist()))
        out, seq = engine.generate(prompt, 4, resets=resets)
        assert seq.stats.pic_tokens == 0 and seq.stats.prefix_tokens == 0
        assert out == fresh_generate(model3, prompt, 4)
        engine.check()
    assert engine.cache.planner.registry.verify_failures > 0


def test_fingerprint_collisions_keep_true_hits_exact(models1, colliding) -> None:
    """One layer, every fingerprint colliding: the genuinely repeated documents are still found
    (verified token by token) and served exactly, the colliding ones are rejected."""
    model = models1["v3_like"]
    source, rs, target, rt, cont = shifted_docs(10)
    engine = Engine(model, EngineConfig(slots=3000, mode="live"))
    engine.generate(source, 2, resets=rs)
    seq, last = engine.prefill(target, rt)
    assert seq.stats.pic_tokens >= 0.9 * 550
    assert engine.cache.planner.registry.verify_failures > 0
    expected = model.logits(torch.from_numpy(target))[-1]
    assert float((last - expected).abs().max()) <= 1e-5
    engine.finish(seq)
    out, _ = engine.generate(target, 5, resets=rt)
    assert out == greedy_reference(model, target, 5)
    engine.check()


# -- 8. limits -------------------------------------------------------------------------------------

def test_prompt_longer_than_pool_raises_pool_exhausted(model3) -> None:
    """A prompt needing more slots than the pool has raises PoolExhausted with a message naming
    the need, leaves the accounting exact and the engine usable — also when the failing prompt
    already held an exact-prefix match and PIC hits, and when live sequences hold the pool."""
    rng = np.random.default_rng(11)
    engine = Engine(model3, EngineConfig(slots=100, mode="live"))
    with pytest.raises(PoolExhausted, match=r"KV pool full: \d+ c_KV and \d+ k_r slots needed"):
        engine.prefill(rng.integers(0, V, 150).tolist())
    engine.check()
    prompt = rng.integers(0, V, 60).tolist()
    out, _ = engine.generate(prompt, 3)
    assert out == fresh_generate(model3, prompt, 3)
    engine.check()

    # live sequences are never evicted
    engine = Engine(model3, EngineConfig(slots=200, mode="live"))
    held, _ = engine.prefill(rng.integers(0, V, 120).tolist())
    other = rng.integers(0, V, 100).tolist()
    with pytest.raises(PoolExhausted):
        engine.prefill(other)
    engine.check()
    engine.finish(held)
    out, _ = engine.generate(other, 3)
    assert out == fresh_generate(model3, other, 3)
    engine.check()

    # the failing prompt held a radix prefix and registry hits when it failed
    source, rs, target, rt, _ = shifted_docs(12)
    engine = Engine(model3, EngineConfig(slots=700, mode="live"))
    engine.generate(source, 1, resets=rs)
    engine.check()
    too_long = np.concatenate([source, target[75:], rng.integers(0, V, 200)])
    free = engine.pool.free
    with pytest.raises(PoolExhausted):
        engine.prefill(too_long, [40, 340, 590, 840])
    engine.check()
    assert engine.pool.free >= free  # the failed request holds nothing
    short = np.concatenate([source[:300], rng.integers(0, V, 30)])
    out, seq = engine.generate(short, 3, resets=rs[:1])
    assert seq.stats.prefix_tokens == 300
    assert out == fresh_generate(model3, short, 3)
    engine.check()


def test_failed_prefill_gives_back_its_computed_and_reused_slots(model3) -> None:
    """A prompt that fails after prefilling its head and reusing two documents (PIC) gives back
    every slot it took: free slots are what they were before, accounting is exact, and a request
    needing them succeeds with the output of a fresh engine."""
    source, rs, target, rt, _ = shifted_docs(15)
    engine = Engine(model3, EngineConfig(slots=1400, mode="live"))
    engine.generate(source, 1, resets=rs)
    tail = np.random.default_rng(15).integers(0, V, 300)
    failing = np.concatenate([target[:625], tail])  # head 75 + B + A (reused) + 300 novel
    free = engine.pool.free
    assert 75 + 550 < free < 75 + 550 + 300
    with pytest.raises(PoolExhausted):
        engine.prefill(failing, rt)
    engine.check()
    assert engine.pool.free >= free
    fits = np.concatenate([target[:625], tail[:100]])
    out, seq = engine.generate(fits, 3, resets=rt)
    assert seq.stats.pic_tokens >= 0.9 * 550
    engine.check()



def test_failed_rotation_gives_back_the_reused_slots(models1, monkeypatch) -> None:
    """A reuse whose device work fails (here: the rotation raises) loses nothing: the prefill
    raises, every slot it took is free again and the accounting is exact."""
    source, rs, target, rt, _ = shifted_docs(16)
    engine = Engine(models1["v2_lite_like"], EngineConfig(slots=2000, mode="live"))
    seq, _ = engine.prefill(source, rs)
    engine.finish(seq)
    free = engine.pool.free

    def broken(*args: object) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "rotate", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.prefill(target, rt)
    engine.check()
    assert engine.pool.free == free

@pytest.mark.parametrize("cached_prefix", [False, True])
def test_out_of_range_reset_is_rejected_or_ignored(models1, cached_prefix: bool) -> None:
    """A negative reset offset is either rejected up front with a ValueError about resets or
    ignored (the prompt served correctly); either way nothing is left behind."""
    model = models1["v3_like"]
    rng = np.random.default_rng(16)
    prompt = rng.integers(0, V, 300).tolist()
    engine = Engine(model, EngineConfig(slots=2000, mode="live"))
    if cached_prefix:
        engine.generate(prompt[:200], 1)
    try:
        seq, logits = engine.prefill(prompt, [-1])
    except ValueError as error:
        assert "reset" in str(error)
    else:
        assert len(seq.handles) == len(prompt)
        assert float((logits - model.logits(torch.tensor(prompt))[-1]).abs().max()) <= 1e-4
        engine.finish(seq)
    engine.check()
    assert not engine.sequences


def test_prompt_longer_than_context_raises_value_error(model3) -> None:
    """A prompt beyond max_position_embeddings (or an empty one) is rejected with ValueError
    before touching the pool."""
    n = model3.config.max_position_embeddings + 1
    engine = Engine(model3, EngineConfig(slots=n + 10, mode="live"))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        engine.prefill(np.arange(n) % V)
    with pytest.raises(ValueError, match="empty"):
        engine.prefill([])
    engine.check()
    assert engine.pool.free == n + 10


# -- forks -----------------------------------------------------------------------------------------

def test_fork_shares_slots_and_both_branches_are_exact(model3) -> None:
    """A fork shares every slot so far; the original decoding greedily and the twin after a
    forced token each give full recomputation's outputs, and finishing both leaves exact
    accounting."""
    rng = np.random.default_rng(13)
    prompt = rng.integers(0, V, 200).tolist()
    engine = Engine(model3, EngineConfig(slots=1000, mode="live"))
    seq, logits = engine.prefill(prompt)
    twin = engine.fork(seq)
    assert np.array_equal(twin.handles, seq.handles)
    engine.check()
    greedy = int(logits.argmax())
    forced = (greedy + 1) % V
    a = engine.extend(seq, [greedy])[-1]
    b = engine.extend(twin, [forced])[-1]
    full_a = model3.logits(torch.tensor(prompt + [greedy]))[-1]
    full_b = model3.logits(torch.tensor(prompt + [forced]))[-1]
    assert float((a - full_a).abs().max()) <= 1e-4
    assert float((b - full_b).abs().max()) <= 1e-4
    engine.finish(twin)
    engine.check()
    engine.finish(seq)
    engine.check()
    with pytest.raises(ValueError):
        engine.fork(seq)


@pytest.mark.parametrize("how", ["fork", "same_prompt"])
def test_finish_with_an_identical_sequence_open(model3, how: str) -> None:
    """Finishing a sequence while an earlier open sequence has identical tokens (an undiverged
    fork, or two concurrent requests with the same prompt) removes that sequence, not its twin,
    and keeps accounting exact. (Regression: with a value-comparing Sequence, list.remove
    compared the handles arrays and raised after the slots were already released.)"""
    prompt = np.random.default_rng(14).integers(0, V, 50).tolist()
    engine = Engine(model3, EngineConfig(slots=500, mode="off"))
    first, _ = engine.prefill(prompt)
    second = engine.fork(first) if how == "fork" else engine.prefill(prompt)[0]
    engine.finish(second)
    engine.check()
    engine.finish(first)
    engine.check()


def test_spans_split_by_reuse_attend_in_one_masked_call(model3, monkeypatch) -> None:
    """A prompt whose reused documents split its computed tokens into spans attends in one masked
    call per layer; its logits and a teacher-forced continuation's equal those of the same engine
    history attending span by span (the per-span path, checked against transformers elsewhere).
    With its last token past MERGED_MAX_KEYS, the spans before it still attend in one masked
    call (and the last span on its own), with the same logits."""
    import irminsul.engine.model_runner as runner_module
    from irminsul.model.mla import MLAttention

    source, source_resets, shifted, _, cont = shifted_docs(seed=5)
    # The shifted prompt with 20 new tokens between its documents: three computed spans.
    middle = np.random.default_rng(6).integers(0, V, 20)
    target = np.concatenate([shifted[:325], middle, shifted[325:]])
    target_resets = [75, 325, 345, 645]
    calls = {"masked": 0}
    masked = MLAttention._attend_masked
    seen: list[int] = []  # the masked calls' query counts

    def counted(self, q_nope, *args):
        calls["masked"] += 1
        seen.append(q_nope.shape[0])
        return masked(self, q_nope, *args)

    monkeypatch.setattr(MLAttention, "_attend_masked", counted)
    results = []
    for limit in (runner_module.MERGED_MAX_KEYS, len(target) - 1, 0):
        monkeypatch.setattr(runner_module, "MERGED_MAX_KEYS", limit)
        calls["masked"] = 0
        seen.clear()
        engine = Engine(model3, EngineConfig(slots=4000, mode="live"))
        seq, _ = engine.prefill(source, source_resets)
        engine.finish(seq)
        seq, logits = engine.prefill(target, target_resets)
        assert seq.stats.pic_tokens > 0
        forced = engine.extend(seq, cont)
        engine.finish(seq)
        engine.check()
        results.append((logits, forced, calls["masked"], max(seen, default=0)))
    (merged_last, merged_forced, merged_calls, merged_rows), \
        (early_last, early_forced, early_calls, early_rows), \
        (split_last, split_forced, split_calls, _) = results
    layers = model3.config.num_hidden_layers
    assert merged_calls == early_calls == layers and split_calls == 0
    assert 1 < early_rows < merged_rows  # the last span left out of the masked call
    for last, forced in ((merged_last, merged_forced), (early_last, early_forced)):
        assert (last - split_last).abs().max() <= 1e-4 * split_last.abs().max()
        assert (forced - split_forced).abs().max() <= 1e-4 * split_forced.abs().max()


@pytest.mark.parametrize("k", [0, 4, 16])
def test_repair_recomputes_the_head_of_every_reused_run(model3, k: int) -> None:
    """recompute_head=k: each reused run of L tokens (hits continuing one another at one δ)
    reuses L - min(k, L) of them and computes the rest (counted against the runs of the
    unrepaired plan); the slots still add up."""
    source, source_resets, target, target_resets, _ = shifted_docs(seed=7)
    runs = []
    for repair in (0, k):
        engine = Engine(model3, EngineConfig(slots=4000, mode="live",
                                             cache=CacheConfig(recompute_head=repair)))
        seq, _ = engine.prefill(source, source_resets)
        engine.finish(seq)
        prefill = engine.start_prefill(target, target_resets)
        # Runs: consecutive hits with one δ (B and A, adjacent here, are two runs).
        runs.append([sum(h.size for h in hits if h.delta == d)
                     for kind, _, _, hits in prefill.stretches if kind == "reuse"
                     for d in dict.fromkeys(h.delta for h in hits)])
        for kind, start, end, hits in prefill.stretches:  # trimmed hits still name their tokens
            assert sum(h.size for h in hits) == (end - start if kind == "reuse" else 0)
            for h in hits:
                stored = np.frombuffer(h.entry.content, dtype=np.int64)
                assert (stored[h.offset:h.offset + h.size] == target[h.start:h.end]).all()
        while (span := engine.advance(prefill, prefill.prompt.size)) is not None:
            engine.run_batch([(prefill.seq, *span)])
        engine.complete_prefill(prefill)
        stats = prefill.seq.stats
        assert stats.pic_tokens + stats.prefilled_tokens + stats.prefix_tokens == len(target)
        if repair == 0:
            plain = stats.pic_tokens
        else:
            assert stats.pic_tokens == plain - sum(min(k, n) for n in runs[0]) > 0
        engine.finish(prefill.seq)
        engine.check()


def test_repair_of_every_reused_token_is_full_recomputation(model3) -> None:
    """With recompute_head past every run's length nothing is reused, and the logits are those
    of computing the prompt from scratch."""
    source, source_resets, target, target_resets, _ = shifted_docs(seed=8)
    engine = Engine(model3, EngineConfig(slots=4000, mode="live",
                                         cache=CacheConfig(recompute_head=10_000)))
    seq, _ = engine.prefill(source, source_resets)
    engine.finish(seq)
    seq, logits = engine.prefill(target, target_resets)
    assert seq.stats.pic_tokens == 0
    full = model3.logits(torch.as_tensor(target))[-1]
    assert (logits - full).abs().max() <= 1e-4 * full.abs().max()
    engine.finish(seq)
    engine.check()


def test_graph_replay_counts_the_spans_eager_would_merge(model3, monkeypatch) -> None:
    """Where there are graphs, a batch with long spans replays whole in the kernel only while the
    attention it moves there is at most GRAPH_PAIRS (query row, visible key) pairs. That is its
    long spans' pairs and, since the eager route attends an item's leading spans (below
    MERGED_MAX_KEYS, a long one among them) in one masked call, those spans' short ones too:
    a new header split by reused runs, its question past the limit (an H100 spent 101 of
    132 ms in the kernel on such a prompt). Short spans the eager route runs in the kernel as
    well (a question past the limit, decode tokens) do not count. Pairs hand-counted. Nor
    does a batch replay whole where its launch splits each request's keys evenly and one
    program would walk more than GRAPH_SPLIT_KEYS of them."""
    from types import SimpleNamespace

    import irminsul.engine.model_runner as runner_module
    from irminsul.engine.batch import ForwardBatch

    runner = Engine(model3, EngineConfig(slots=64, mode="live")).runner
    monkeypatch.setattr(runner, "kernels", True)
    monkeypatch.setattr(runner, "_naive_from", 100)
    launch = {"splits": 0}  # 0: the launch cuts keys into pieces
    monkeypatch.setattr(runner, "graphs", SimpleNamespace(buckets=(1024,),
                                                          splits=lambda _: launch["splits"]))
    heads = model3.config.num_attention_heads

    def batch(*items: np.ndarray) -> ForwardBatch:
        tokens = sum(len(at) for at in items)
        return ForwardBatch(np.zeros(tokens, dtype=np.int64), list(items),
                            [np.arange(int(at[-1]) + 1) for at in items],
                            np.arange(tokens))

    # A header: a long span [0, 200) and a short one [300, 350) between reused runs; the
    # question, one token at 20,000. Pairs: 200 * (0 + 100) + 50 * (300 + 25) = 36,250 with
    # the short span, 20,000 without; the question's 20,001 are not counted.
    header = batch(np.concatenate([np.arange(200), np.arange(300, 350), [20_000]]))
    for limit, whole in ((36_250, True), (36_249, False), (20_000, False)):
        monkeypatch.setattr(runner_module, "GRAPH_PAIRS", limit * heads)
        kernel, gathered, merged = runner._route(header)
        assert (not gathered and not merged and len(kernel) == 3) == whole, limit
        if not whole:  # the leading spans in one masked call, the question in the kernel
            assert [len(rows) for rows, _, _ in merged] == [250] and len(kernel) == 1
    # A prefill chunk [1000, 1200) beside two decode tokens at 9,000: only the chunk counts,
    # 200 * (1000 + 100) = 220,000 pairs.
    mixed = batch(np.arange(1000, 1200), np.array([9000]), np.array([9000]))
    for limit, whole in ((220_000, True), (219_999, False)):
        monkeypatch.setattr(runner_module, "GRAPH_PAIRS", limit * heads)
        kernel, gathered, merged = runner._route(mixed)
        assert (len(kernel) == 3 and not gathered) == whole, limit
    # A launch of 2 splits a request: the chunk beside a decode token whose 4,097 keys would
    # be one program's 2,049 replays eagerly; beside one of 4,096 keys, whole.
    monkeypatch.setattr(runner_module, "GRAPH_PAIRS", 220_000 * heads)
    launch["splits"] = 2
    for keys, whole in ((runner_module.GRAPH_SPLIT_KEYS * 2, True),
                        (runner_module.GRAPH_SPLIT_KEYS * 2 + 1, False)):
        kernel, gathered, merged = runner._route(
            batch(np.arange(1000, 1200), np.array([keys - 1])))
        assert (len(kernel) == 2 and not gathered) == whole, keys


def drain_with_errors(scheduler: Scheduler, limit: int = 200
                      ) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Step until idle (at most ``limit`` steps), checking the pool after each: each
    request's tokens and each failed request's error."""
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    for _ in range(limit):
        if not scheduler.has_work():
            break
        for out in scheduler.step():
            tokens.setdefault(out.request_id, []).extend(out.new_tokens)
            if out.error is not None:
                errors[out.request_id] = out.error
        scheduler.engine.check()
    return tokens, errors


def test_a_failing_repair_check_holds_nothing_and_blocks_no_one(model3) -> None:
    """The repair's check forward (run while planning) fails for one request: that request
    fails alone, and it leaves nothing behind — no plan locks, no sequence, no chunks counted
    as in flight (a later request computing the same novel content must not wait for a
    prefill that will never land)."""
    rng = np.random.default_rng(5)
    doc, novel = rng.integers(0, V, 300), rng.integers(0, V, 400)
    h1, h2, h3 = (rng.integers(0, V, n) for n in (40, 60, 50))
    h2[0], h3[0] = (h1[0] + 1) % V, (h1[0] + 2) % V
    engine = Engine(model3, EngineConfig(slots=4000, mode="live",
                                        cache=CacheConfig(recompute_share=0.25)))
    scheduler = Scheduler(engine)
    scheduler.add(np.concatenate([h1, doc]), SamplingParams(max_tokens=2), resets=[40])
    drain_with_errors(scheduler)
    real = engine.cache.latent_check

    def faulty(*args):
        raise RuntimeError("CUDA out of memory (injected)")

    engine.cache.latent_check = faulty
    poison = scheduler.add(np.concatenate([h2, doc, novel]), SamplingParams(max_tokens=2),
                           resets=[60, 360])
    _, errors = drain_with_errors(scheduler)
    assert set(errors) == {poison}
    engine.cache.latent_check = real
    assert engine.sequences == []
    # The same novel content behind another header: computed, not waited for forever.
    prompt = np.concatenate([h3, novel])
    request = scheduler.add(prompt, SamplingParams(max_tokens=3), resets=[50])
    tokens, errors = drain_with_errors(scheduler)
    assert not errors and not scheduler.has_work()
    assert tokens[request] == greedy_reference(model3, prompt, 3)
    # Nothing stays locked: the indexes can be emptied and every slot is free again.
    engine.cache.clear()
    engine.check()
    assert engine.pool.free == engine.pool.capacity


def test_generate_that_runs_out_of_slots_gives_them_back(model3) -> None:
    """Engine.generate whose decode runs out of slots raises PoolExhausted and, like a failed
    prefill, gives back every slot it took: no sequence is left holding them."""
    engine = Engine(model3, EngineConfig(slots=64, mode="off"))
    prompt = np.random.default_rng(7).integers(0, V, 62)
    with pytest.raises(PoolExhausted):
        engine.generate(prompt, 8)
    engine.check()
    assert engine.sequences == []
    engine.cache.clear()
    assert engine.pool.free == engine.pool.capacity
    # The engine serves the same prompt once it asks for what fits.
    out, _ = engine.generate(prompt, 2)
    assert out == greedy_reference(model3, prompt, 2)
