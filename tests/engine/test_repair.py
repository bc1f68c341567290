"""CacheBlend-style repair (``CacheConfig.recompute_share``) against references without the
engine: which reused tokens it picks, checked against deviations computed from the model's own
full forwards of both prompts; what it serves, checked against a hand-assembled cache (computed
runs by ``model.forward`` over the rows so far, reused runs the source's rows with k_r rotated by
δ); and that the scheduler's admission path repairs the same tokens.

Tiny random DeepSeek-V3-like checkpoint (vocab 97, hidden 64, three layers, MoE in layers 1-2).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures.tiny_models import build

from irminsul.config import CacheConfig, EngineConfig
from irminsul.engine import Engine
from irminsul.engine.kv_pool import unpack
from irminsul.engine.repair import LatentCheck
from irminsul.engine.sampler import SamplingParams
from irminsul.engine.scheduler import Scheduler
from irminsul.model import load_model

V = 97
H1, H2, DOC_A, DOC_B, QUESTION = 40, 75, 300, 250, 24


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model3(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v3_3layer_repair")
    build("v3_like", directory, layers=3)
    return load_model(directory)


@pytest.fixture(scope="module")
def docs():
    """Source: header 40, doc A, doc B; target: header 75, doc B, doc A, a question (resets at
    document starts). ``source_of(p)``: where target position p's token sits in the source."""
    rng = np.random.default_rng(11)
    a, b = rng.integers(0, V, DOC_A), rng.integers(0, V, DOC_B)
    h1, h2 = rng.integers(0, V, H1), rng.integers(0, V, H2)
    h2[0] = (h1[0] + 1) % V
    source = np.concatenate([h1, a, b])
    target = np.concatenate([h2, b, a, rng.integers(0, V, QUESTION)])

    def source_of(p: int) -> int:
        if H2 <= p < H2 + DOC_B:
            return p - H2 + H1 + DOC_A
        assert H2 + DOC_B <= p < H2 + DOC_B + DOC_A, p
        return p - H2 - DOC_B + H1

    return source, [H1, H1 + DOC_A], target, [H2, H2 + DOC_B, H2 + DOC_B + DOC_A], source_of


def planned(model, docs, share: float, **repair):
    """An engine that served the source, and the target's prefill planned (not yet served);
    ``repair``: more CacheConfig knobs."""
    source, source_resets, target, target_resets, _ = docs
    engine = Engine(model, EngineConfig(slots=4000, mode="live",
                                        cache=CacheConfig(recompute_share=share, **repair)))
    seq, _ = engine.prefill(source, source_resets)
    engine.finish(seq)
    return engine, engine.start_prefill(target, target_resets)


def positions_of(prefill, kind: str) -> set[int]:
    return {p for k, start, end, _ in prefill.stretches if k == kind for p in range(start, end)}


def reference_deviation(model, docs, positions) -> np.ndarray:
    """‖c_KV at layer 1 of the target's full forward − that of the source's‖ per position."""
    source, _, target, _, source_of = docs
    rank = model.config.kv_lora_rank
    src = model.forward(torch.as_tensor(source), torch.arange(len(source))).latents[1][:, :rank]
    tgt = model.forward(torch.as_tensor(target), torch.arange(len(target))).latents[1][:, :rank]
    at = torch.as_tensor(positions)
    back = torch.as_tensor([source_of(int(p)) for p in positions])
    return torch.linalg.vector_norm(tgt[at] - src[back], dim=-1).double().numpy()


def test_check_forward_equals_the_full_forwards_deviation(model3, docs) -> None:
    """LatentCheck's deviation of every reused row equals the one from both prompts' full
    forwards."""
    engine, prefill = planned(model3, docs, 0.0)
    hits = [h for k, _, _, hs in prefill.stretches if k == "reuse" for h in hs]
    positions = np.concatenate([np.arange(h.start, h.end) for h in hits])
    slots = np.concatenate([unpack(h.entry.handles[h.offset:h.offset + h.size])[0] for h in hits])
    got = LatentCheck(model3, engine.pool.ckv)(docs[2], positions, slots)
    want = reference_deviation(model3, docs, positions)
    assert positions.size > 400 and want.min() > 0  # context changed every row at layer 1
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    engine.abort_prefill(prefill)
    engine.check()


@pytest.mark.parametrize("share", [0.05, 0.15])
def test_repair_computes_the_most_deviating_reused_tokens(model3, docs, share: float) -> None:
    """recompute_share=r computes floor(r · reused) of the unrepaired plan's reused tokens, the
    ones the reference ranks highest (up to float noise at the cut), and reuses the rest."""
    engine, prefill = planned(model3, docs, 0.0)
    reused = np.array(sorted(positions_of(prefill, "reuse")))
    engine.abort_prefill(prefill)
    engine, prefill = planned(model3, docs, share)
    computed = positions_of(prefill, "compute") & set(reused.tolist())
    assert len(computed) == int(share * reused.size) > 0
    assert positions_of(prefill, "reuse") == set(reused.tolist()) - computed
    deviation = dict(zip(reused.tolist(), reference_deviation(model3, docs, reused)))
    lowest_picked = min(deviation[p] for p in computed)
    highest_left = max(deviation[p] for p in set(reused.tolist()) - computed)
    assert lowest_picked >= highest_left - 1e-4 * highest_left
    while (span := engine.advance(prefill, prefill.prompt.size)) is not None:
        engine.run_batch([(prefill.seq, *span)])
    engine.complete_prefill(prefill)
    stats = prefill.seq.stats
    assert stats.pic_tokens == reused.size - len(computed)
    assert stats.pic_tokens + stats.prefilled_tokens + stats.prefix_tokens == len(docs[2])
    engine.finish(prefill.seq)
    engine.check()


def assembled_logits(model, docs, computed: set[int], reused: set[int]) -> torch.Tensor:
    """The target's last logits with ``reused`` positions served the source's full-forward rows
    (k_r rotated by δ) and every other position computed by model.forward over the rows so far:
    the cache repair should serve, built without the engine."""
    source, _, target, _, source_of = docs
    rank = model.config.kv_lora_rank
    src_rows = model.forward(torch.as_tensor(source), torch.arange(len(source))).latents
    rows: list[torch.Tensor] | None = None
    labels = ["reuse" if p in reused else "compute" for p in range(len(target))]
    start, logits = 0, None
    while start < len(target):
        end = start
        while end < len(target) and labels[end] == labels[start]:
            end += 1
        if labels[start] == "compute":
            out = model.forward(torch.as_tensor(target[start:end]), torch.arange(start, end), rows)
            new, logits = out.latents, out.logits
        else:
            back = [source_of(p) for p in range(start, end)]
            deltas = torch.as_tensor([p - q for p, q in zip(range(start, end), back)])
            new = [torch.cat([layer[back, :rank],
                              model.rotary.rotate(layer[back, rank:], deltas)], dim=-1)
                   for layer in src_rows]
        rows = new if rows is None else [torch.cat([r, n]) for r, n in zip(rows, new)]
        start = end
    return logits[-1]


@pytest.mark.parametrize("share", [0.1, 1.0])
def test_repaired_prefill_serves_the_assembled_cache(model3, docs, share: float) -> None:
    """The served logits equal those of the hand-assembled cache with the engine's picks
    computed; at share 1 nothing is reused and they are full recomputation's."""
    engine, prefill = planned(model3, docs, share)
    computed, reused = positions_of(prefill, "compute"), positions_of(prefill, "reuse")
    assert not positions_of(prefill, "prefix")
    logits = None
    while (span := engine.advance(prefill, prefill.prompt.size)) is not None:
        logits = engine.run_batch([(prefill.seq, *span)])[0][-1]
    engine.complete_prefill(prefill)
    want = (model3.logits(torch.as_tensor(docs[2]))[-1] if share == 1.0
            else assembled_logits(model3, docs, computed, reused))
    assert (bool(reused) and share < 1) or (not reused and share == 1.0)
    assert (logits - want).abs().max() <= 1e-4 * want.abs().max()
    engine.finish(prefill.seq)
    engine.check()


@pytest.mark.parametrize("share", [0.1, 1.0])
def test_repair_reaches_a_derived_prefix(model3, docs, share: float) -> None:
    """The target's next turn matches it whole in the radix tree, its rows from the first reused
    token on derived. Those rows are repair's candidates too: at share 1 every one is computed
    and the follow-up's logits are full recomputation's; at 0.1 a tenth of them, picked by
    their deviation, are computed and the rest served as a derived prefix."""
    source, rs, target, rt, _ = docs
    follow = np.concatenate([target, [5, 6, 7]])
    engine = Engine(model3, EngineConfig(slots=6000, mode="live",
                                         cache=CacheConfig(recompute_share=share)))
    engine.cache.recompute_share = 0.0  # the earlier turns served without repair
    for prompt, resets in ((source, rs), (target, rt)):
        seq, _ = engine.prefill(prompt, resets)
        engine.finish(seq)
    engine.cache.recompute_share = share
    plain = Engine(model3, EngineConfig(slots=6000, mode="live"))
    for prompt, resets in ((source, rs), (target, rt)):
        seq, _ = plain.prefill(prompt, resets)
        plain.finish(seq)
    derived = plain.start_prefill(follow, rt + [len(target)])
    candidates = positions_of(derived, "derived")
    assert len(candidates) > 300 and not positions_of(derived, "reuse")
    plain.abort_prefill(derived)
    prefill = engine.start_prefill(follow, rt + [len(target)])
    computed = positions_of(prefill, "compute") & candidates
    assert len(computed) == int(share * len(candidates))
    assert positions_of(prefill, "derived") == candidates - computed
    while (span := engine.advance(prefill, prefill.prompt.size)) is not None:
        logits = engine.run_batch([(prefill.seq, *span)])[0][-1]
    engine.complete_prefill(prefill)
    full = model3.logits(torch.as_tensor(follow))[-1]
    gap = float((logits - full).abs().max() / full.abs().max())
    if share == 1.0:
        assert gap <= 1e-4 and prefill.seq.stats.derived_prefix_tokens == 0
    else:
        assert gap > 1e-4 and prefill.seq.stats.derived_prefix_tokens == len(candidates - computed)
    engine.finish(prefill.seq)
    engine.check()


def test_scheduler_admits_the_repaired_plan(model3, docs) -> None:
    """Served through the scheduler (which plans through the cache manager directly), the same
    tokens are repaired: the reused count is the unrepaired one less floor(r · reused)."""
    source, source_resets, target, target_resets, _ = docs
    counts = []
    for share in (0.0, 0.1):
        engine = Engine(model3, EngineConfig(slots=4000, mode="live",
                                             cache=CacheConfig(recompute_share=share)))
        scheduler = Scheduler(engine)
        for prompt, resets in ((source, source_resets), (target, target_resets)):
            scheduler.add(prompt.tolist(), SamplingParams(max_tokens=2), resets=resets)
            stats = None
            while scheduler.has_work():
                for out in scheduler.step():
                    stats = out.stats or stats
        counts.append(stats.pic_tokens)
        engine.check()
    assert counts[1] == counts[0] - int(0.1 * counts[0]) and counts[0] > 400


def test_check_layer_must_have_a_layer_below_it(model3) -> None:
    with pytest.raises(ValueError, match="recompute_check_layer"):
        Engine(model3, EngineConfig(slots=100, mode="live",
                                    cache=CacheConfig(recompute_share=0.1,
                                                      recompute_check_layer=3)))
    with pytest.raises(ValueError, match="recompute_share"):
        CacheConfig(recompute_share=1.5)


def tail_error_drops(model, docs, positions, layers: int, tail: int = 16) -> np.ndarray:
    """Per reused position, exactly (no linearisation, no autograd): how much
    Σ_l ‖attn_l(tail; served rows) − attn_l(tail; fresh rows)‖² / ‖attn_l(tail; fresh rows)‖²
    over layers 1 .. ``layers`` drops when that position's c_KV is the target's own instead of
    the source's. Rows from both prompts' full forwards; the tail is the target's last ``tail``
    tokens, its queries from the target's full forward."""
    source, _, target, _, source_of = docs
    rank, n = model.config.kv_lora_rank, len(target)
    start = n - tail
    src = model.forward(torch.as_tensor(source), torch.arange(len(source))).latents
    fresh_rows = model.forward(torch.as_tensor(target), torch.arange(n)).latents
    at = torch.arange(n)
    back = torch.as_tensor([source_of(int(p)) for p in positions])
    where = torch.as_tensor(positions)
    drops = np.zeros(len(positions))
    with torch.inference_mode():
        x = model.model.embed_tokens(torch.as_tensor(target))
        for index, layer in enumerate(model.model.layers[:layers + 1]):
            if index:
                attn = layer.self_attn
                h = layer.input_layernorm(x)[start:]
                fresh = fresh_rows[index][:start]
                served = fresh.clone()
                served[where, :rank] = src[index][back, :rank]

                def error(rows, attn=attn, h=h, fresh=fresh):
                    reference = attn(h, at[start:], [fresh], [tail])[0]
                    out = attn(h, at[start:], [rows], [tail])[0]
                    return float((out - reference).pow(2).sum() / reference.pow(2).sum())

                base = error(served)
                for i, p in enumerate(positions):
                    fixed = served.clone()
                    fixed[int(p), :rank] = fresh[int(p), :rank]
                    drops[i] += base - error(fixed)
            x, _ = layer(x, at, [None], [n], None)
    return drops


def test_signed_check_ranks_by_the_tail_errors_exact_drops(model3, docs) -> None:
    """SignedCheck's first-order scores agree with the exact drops of the tail's attention
    error (computed by replacing one row at a time): strongly correlated, the same top tenth
    up to a few at the cut."""
    from irminsul.engine.repair import SignedCheck

    engine, prefill = planned(model3, docs, 0.0)
    hits = [h for k, _, _, hs in prefill.stretches if k == "reuse" for h in hs]
    positions = np.concatenate([np.arange(h.start, h.end) for h in hits])
    slots = np.concatenate([unpack(h.entry.handles[h.offset:h.offset + h.size])[0] for h in hits])
    got = SignedCheck(model3, engine.pool.ckv, layers=2)(docs[2], positions, slots)
    want = tail_error_drops(model3, docs, positions, layers=2)
    assert np.isfinite(got).all() and positions.size > 400
    assert np.corrcoef(got, want)[0, 1] > 0.95
    top = max(1, positions.size // 10)
    overlap = set(np.argsort(-got)[:top]) & set(np.argsort(-want)[:top])
    assert len(overlap) >= 0.8 * top
    engine.abort_prefill(prefill)
    engine.check()


def test_signed_rule_computes_the_tokens_with_the_largest_drops(model3, docs) -> None:
    """recompute_rule="signed" computes floor(r · reused) tokens, those the exact drops rank
    highest (but for a few at the cut), serves the rest reused, and serves the whole prompt."""
    engine, prefill = planned(model3, docs, 0.0)
    reused = np.array(sorted(positions_of(prefill, "reuse")))
    engine.abort_prefill(prefill)
    engine, prefill = planned(model3, docs, 0.1, recompute_rule="signed",
                              recompute_check_layer=2)
    computed = positions_of(prefill, "compute") & set(reused.tolist())
    top = int(0.1 * reused.size)
    assert len(computed) == top > 0
    drops = tail_error_drops(model3, docs, reused, layers=2)
    want = set(reused[np.argsort(-drops)[:top]].tolist())
    assert len(computed & want) >= 0.8 * top
    while (span := engine.advance(prefill, prefill.prompt.size)) is not None:
        engine.run_batch([(prefill.seq, *span)])
    engine.complete_prefill(prefill)
    stats = prefill.seq.stats
    assert stats.pic_tokens == reused.size - top
    assert stats.pic_tokens + stats.prefilled_tokens + stats.prefix_tokens == len(docs[2])
    engine.finish(prefill.seq)
    engine.check()


def test_heads_recompute_the_head_of_each_document_reused_back_to_back(model3, docs) -> None:
    """recompute_head=k computes the first k tokens of every reused run: doc B and doc A,
    adjacent in the target but each computed after another context in the source (two δs),
    are two runs, so both heads are computed (EPIC recomputes the head of each reused chunk),
    not just B's."""
    source, rs, target, rt, _ = docs
    k = 16
    engine = Engine(model3, EngineConfig(slots=4000, mode="live",
                                         cache=CacheConfig(recompute_head=k)))
    seq, _ = engine.prefill(source, rs)
    engine.finish(seq)
    prefill = engine.start_prefill(target, rt)
    # By hand: header and question computed; B's head at H2, A's head at H2 + DOC_B.
    question = H2 + DOC_B + DOC_A
    want = (set(range(0, H2 + k)) | set(range(H2 + DOC_B, H2 + DOC_B + k))
            | set(range(question, len(target))))
    assert positions_of(prefill, "compute") == want
    while (span := engine.advance(prefill, prefill.prompt.size)) is not None:
        engine.run_batch([(prefill.seq, *span)])
    engine.complete_prefill(prefill)
    stats = prefill.seq.stats
    assert stats.pic_tokens == DOC_A + DOC_B - 2 * k
    assert stats.prefilled_tokens == len(target) - stats.pic_tokens
    engine.finish(prefill.seq)
    engine.check()


def test_share_counts_only_tokens_the_plan_reuses_when_the_prompt_ends_reused(model3,
                                                                              docs) -> None:
    """A prompt that ends inside a reused document: its last token is computed whatever
    serves it (its logits start the generation), so the unrepaired plan reuses one token
    less than its hits cover. recompute_share=r computes floor(r · reused) of the tokens it
    reuses, so that pic_tokens drops by exactly that much (as when the prompt ends computed),
    and no pick goes to the last token."""
    source, rs, target, rt, _ = docs
    target, rt = target[:H2 + DOC_B + DOC_A], rt[:2]  # header, B, A: ends inside A
    counts = []
    for share in (0.0, 0.1):
        engine = Engine(model3, EngineConfig(slots=4000, mode="live",
                                             cache=CacheConfig(recompute_share=share)))
        seq, _ = engine.prefill(source, rs)
        engine.finish(seq)
        seq, _ = engine.prefill(target, rt)
        counts.append(seq.stats.pic_tokens)
        engine.finish(seq)
        engine.check()
    assert counts[0] == DOC_A + DOC_B - 1
    assert counts[1] == counts[0] - int(0.1 * counts[0])


@pytest.mark.parametrize("head", [0, 8])
def test_recent_rule_computes_the_last_reused_tokens_and_serves_them(model3, docs,
                                                                     head: int) -> None:
    """recompute_rule="recent" computes the floor(r · reused) reused tokens nearest the prompt's
    end — of those the heads (recompute_head) leave reused — runs no check forward, and serves
    the hand-assembled cache with exactly those computed."""
    engine, prefill = planned(model3, docs, 0.0, recompute_head=head)
    reused = sorted(positions_of(prefill, "reuse"))
    engine.abort_prefill(prefill)
    engine, prefill = planned(model3, docs, 0.2, recompute_head=head, recompute_rule="recent")
    assert engine.runner.check_depth == 0  # no check forward was built
    last = set(reused[len(reused) - int(0.2 * len(reused)):])
    assert len(last) > 0 and positions_of(prefill, "reuse") == set(reused) - last
    computed, kept = positions_of(prefill, "compute"), positions_of(prefill, "reuse")
    logits = None
    while (span := engine.advance(prefill, prefill.prompt.size)) is not None:
        logits = engine.run_batch([(prefill.seq, *span)])[0][-1]
    engine.complete_prefill(prefill)
    want = assembled_logits(model3, docs, computed, kept)
    assert (logits - want).abs().max() <= 1e-4 * want.abs().max()
    engine.finish(prefill.seq)
    engine.check()


def test_budget_shrinks_the_heads_to_what_the_share_leaves(model3, docs) -> None:
    """recompute_budget=b caps heads and share together at floor(b · reused): the share's tokens
    are kept and k shrinks. By hand: 550 reused tokens in two runs (B 250, A 300); b = 0.15
    gives 82 tokens, the 10% share 55, so the heads get 27: k' = 13 (two runs, 26 tokens); the
    share then computes floor(0.1 · (550 - 26)) = 52 tokens, the last of doc A."""
    engine, prefill = planned(model3, docs, 0.1, recompute_head=32, recompute_rule="recent",
                              recompute_budget=0.15)
    start_b, start_a, end_a = H2, H2 + DOC_B, H2 + DOC_B + DOC_A
    heads = set(range(start_b, start_b + 13)) | set(range(start_a, start_a + 13))
    recent = set(range(end_a - 52, end_a))
    reused = set(range(start_b, end_a))
    assert positions_of(prefill, "reuse") == reused - heads - recent
    assert positions_of(prefill, "compute") == set(range(len(docs[2]))) - (reused - heads - recent)
    engine.abort_prefill(prefill)
    engine.check()
    # Without the cap the heads keep k = 32 (64 tokens) and the share takes 10% of the rest.
    engine, prefill = planned(model3, docs, 0.1, recompute_head=32, recompute_rule="recent")
    heads = set(range(start_b, start_b + 32)) | set(range(start_a, start_a + 32))
    recent = set(range(end_a - int(0.1 * (550 - 64)), end_a))
    assert positions_of(prefill, "reuse") == reused - heads - recent
    engine.abort_prefill(prefill)
    engine.check()


def test_budget_below_the_share_is_refused() -> None:
    with pytest.raises(ValueError, match="recompute_budget .* below recompute_share"):
        CacheConfig(recompute_share=0.1, recompute_budget=0.05)
    with pytest.raises(ValueError, match="recompute_budget must be in"):
        CacheConfig(recompute_budget=1.5)
