"""The live-PIC audit: sampled PIC-served requests recomputed from scratch in idle capacity, their
first-token KL recorded and exported."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures.tiny_models import build
from prometheus_client import generate_latest

from irminsul.config import EngineConfig
from irminsul.engine import Engine, SamplingParams, Scheduler
from irminsul.engine.audit import KL_BUCKETS, AuditStats, PicAudit
from irminsul.model import load_model
from irminsul.server.async_engine import EngineSnapshot
from irminsul.server.metrics import ServerMetrics

V = 97


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("audit-model")
    build("v2_lite_like", path, layers=2)
    return load_model(path)


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p ‖ q) from logits, in float64 (the reference, written out here)."""
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


def shifted(seed: int) -> tuple[np.ndarray, list[int], np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    doc = rng.integers(0, V, 300)
    h1, h2 = rng.integers(0, V, 40), rng.integers(0, V, 70)
    h2[0] = (h1[0] + 1) % V
    return np.concatenate([h1, doc]), [40], np.concatenate([h2, doc, [3, 4]]), [70, 370]


def test_sampling_queue_and_histogram_by_hand(model) -> None:
    served = torch.zeros(V)
    never = PicAudit(0.0)
    never.consider(np.arange(10), served, reused_tokens=100)
    assert never.pending == 0
    audit = PicAudit(1.0, queue=2)
    audit.consider(np.arange(10), served, reused_tokens=0)  # nothing reused: nothing to audit
    assert audit.pending == 0
    for _ in range(3):
        audit.consider(np.arange(10), served, reused_tokens=5)
    assert audit.pending == 2 and audit.stats.skipped == 1
    stats = AuditStats()
    for value in (5e-7, 2e-4, 0.015, 0.5, 7.0):
        stats.record(value)
    # Buckets ≤ 1e-6, ≤ 3e-4, ≤ 0.02, ≤ 1.0 and past the last bound.
    want = [0] * (len(KL_BUCKETS) + 1)
    for bound in (1e-6, 3e-4, 0.02, 1.0):
        want[KL_BUCKETS.index(bound)] += 1
    want[-1] += 1
    assert stats.counts == want and stats.audited == 5
    assert stats.kl_sum == pytest.approx(5e-7 + 2e-4 + 0.015 + 0.5 + 7.0)


def test_idle_scheduler_recomputes_what_pic_served(model) -> None:
    """rate 1: the request PIC served is kept; once the scheduler is idle, run_audit recomputes
    it and records KL(full ‖ served) of its first token, which equals the KL between the logits
    a same-history engine serves and the model's own full forward."""
    source, rs, target, rt = shifted(3)
    engine = Engine(model, EngineConfig(slots=3000, mode="live", pic_audit_rate=1.0))
    scheduler = Scheduler(engine)
    for prompt, resets in ((source, rs), (target, rt)):
        scheduler.add(prompt, SamplingParams(max_tokens=2), resets=resets)
        while scheduler.has_work():
            scheduler.step()
        assert not scheduler.run_audit() or prompt is target
    assert scheduler.audit.stats.audited == 1 and not scheduler.run_audit()

    twin = Engine(model, EngineConfig(slots=3000, mode="live"))
    seq, _ = twin.prefill(source, rs)
    twin.finish(seq)
    seq, served = twin.prefill(target, rt)
    assert seq.stats.pic_tokens > 200
    full = model.logits(torch.as_tensor(target))[-1]
    assert scheduler.audit.stats.kl_sum == pytest.approx(kl(full, served), rel=1e-4, abs=1e-9)
    assert scheduler.audit.stats.kl_sum > 0


def test_a_follow_up_over_reused_rows_is_audited(model) -> None:
    """The next turn of a request PIC served reuses nothing itself, but its exact-prefix match
    runs over that turn's reused rows (a derived prefix): it is audited too, and its KL is the
    one a same-history engine serves it with."""
    source, rs, target, rt = shifted(5)
    follow = np.concatenate([target, [5, 6, 7]])
    engine = Engine(model, EngineConfig(slots=3000, mode="live", pic_audit_rate=1.0))
    scheduler = Scheduler(engine)
    for prompt, resets in ((source, rs), (target, rt), (follow, rt + [len(target)])):
        scheduler.add(prompt, SamplingParams(max_tokens=1), resets=resets)
        while scheduler.has_work():
            scheduler.step()
        before = scheduler.audit.stats.kl_sum
        scheduler.run_audit()
    assert scheduler.audit.stats.audited == 2

    twin = Engine(model, EngineConfig(slots=3000, mode="live"))
    for prompt, resets in ((source, rs), (target, rt)):
        seq, _ = twin.prefill(prompt, resets)
        twin.finish(seq)
    seq, served = twin.prefill(follow, rt + [len(target)])
    assert seq.stats.pic_tokens == 0 and seq.stats.derived_prefix_tokens > 200
    full = model.logits(torch.as_tensor(follow))[-1]
    got = scheduler.audit.stats.kl_sum - before
    assert got == pytest.approx(kl(full, served), rel=1e-4, abs=1e-9) and got > 0


def test_off_mode_audits_nothing(model) -> None:
    source, rs, target, rt = shifted(4)
    scheduler = Scheduler(Engine(model, EngineConfig(slots=3000, mode="off",
                                                     pic_audit_rate=1.0)))
    for prompt, resets in ((source, rs), (target, rt)):
        scheduler.add(prompt, SamplingParams(max_tokens=2), resets=resets)
        while scheduler.has_work():
            scheduler.step()
    assert scheduler.audit.pending == 0 and not scheduler.run_audit()


def test_metrics_export_the_kl_histogram() -> None:
    stats = AuditStats()
    for value in (2e-4, 2e-4, 0.05):
        stats.record(value)
    stats.skipped = 4
    text = generate_latest(ServerMetrics(lambda: EngineSnapshot(), audit=stats).registry).decode()
    assert 'irminsul:pic_audit_kl_bucket{le="0.0003"} 2.0' in text
    assert 'irminsul:pic_audit_kl_bucket{le="+Inf"} 3.0' in text
    assert "irminsul:pic_audit_kl_count 3.0" in text
    assert "irminsul:pic_audit_skipped_total 4.0" in text


def test_the_reference_is_a_prefill_that_reuses_nothing_and_leaves_nothing(model) -> None:
    """The audit's recomputation runs as a request's prefill, in chunks of the budget, over a
    pool whose caches hold the very content it recomputes: it reuses none of it (its logits
    are the model's full forward's, where a reuse would move them), and afterwards the pool's
    free room, the radix tree and the registry are as before."""
    source, rs, target, rt = shifted(7)
    engine = Engine(model, EngineConfig(slots=3000, mode="live"))
    for prompt, resets in ((source, rs), (target, rt)):
        seq, _ = engine.prefill(prompt, resets)
        engine.finish(seq)
    free, entries = engine.pool.free, engine.cache.planner.registry.num_entries
    prefix = engine.cache.planner.plan(target, rt).prefix.length
    got = engine.recompute_in_pool(target, budget=128)
    full = model.logits(torch.as_tensor(target))[-1]
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    assert engine.pool.free == free and engine.cache.planner.registry.num_entries == entries
    assert engine.cache.planner.plan(target, rt).prefix.length == prefix == len(target)
    engine.check()


def test_a_full_pool_makes_room_for_the_reference_as_for_a_prefill(model) -> None:
    """With the pool full of cached rows, the recomputation evicts the least recently used
    as a request's prefill would (the newest entry stays), and still reuses nothing."""
    engine = Engine(model, EngineConfig(slots=400, mode="live"))
    for start in (0, 1):  # two cached prompts, 180 rows each: 360 of the 400 slots in use
        seq, _ = engine.prefill((np.arange(180) * 7 + start) % V)
        engine.finish(seq)
    newest = (np.arange(180) * 7 + 1) % V
    prompt = (np.arange(150) * 5 + 2) % V
    got = engine.recompute_in_pool(prompt, budget=64)
    torch.testing.assert_close(got, model.logits(torch.as_tensor(prompt))[-1], rtol=1e-5,
                               atol=1e-5)
    assert engine.cache.planner.plan(newest).prefix.length == 180
    assert engine.cache.planner.plan((np.arange(180) * 7) % V).prefix.length < 180
    engine.check()
