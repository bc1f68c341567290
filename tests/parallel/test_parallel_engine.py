"""The engine under tensor parallel: rank 0 plans, holds slots and samples; the other ranks follow
its steps. On a one-layer model (a token's latent row depends on the token and its position only)
live PIC — reordered documents served from the registry with k_r rotated by δ — gives the logits
of full recomputation (1e-5), on 2 ranks as on one, and every rank's pool holds the same rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from parallel_ranks import run_ranks, values
from tiny_parallel import tiny_model

from irminsul.config import CacheConfig, EngineConfig
from irminsul.engine import Engine, SamplingParams, Scheduler
from irminsul.parallel import ParallelGroup, follow, leader_engine, shard_model
from irminsul.parallel import leader as leader_module

CONFIG = EngineConfig(mode="live", slots=1200)


def shifted_docs(seed: int = 3) -> tuple[np.ndarray, list[int], np.ndarray, list[int]]:
    """A source (header, doc A, doc B) and a target (another header, B, A, a question)."""
    rng = np.random.default_rng(seed)
    doc_a, doc_b = rng.integers(0, 97, 200), rng.integers(0, 97, 180)
    source = np.concatenate([rng.integers(0, 97, 40), doc_a, doc_b])
    target = np.concatenate([rng.integers(0, 97, 50), doc_b, doc_a, rng.integers(0, 97, 20)])
    return source, [40, 240], target, [50, 230, 430]


def followed(model, group: ParallelGroup) -> dict:  # noqa: ANN001
    """A follower's run of the leader's one engine: the forwards it ran and its pool's rows."""
    opened = []  # the engines the leader opens here (this rank's process alone)

    class Recorded(Engine):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            opened.append(self)

    leader_module.Engine = Recorded
    forwards = follow(model, group)
    [engine] = opened
    return dict(forwards=forwards,
                pool=(engine.pool.ckv.cpu().numpy(), engine.pool.kr.cpu().numpy()))


def serve(group: ParallelGroup, case: str, device: str = "cpu") -> dict:
    model = tiny_model(case, layers=1, seed=4).to(device)
    source, source_resets, target, target_resets = shifted_docs()
    # The reference: the unsharded model recomputing the whole target, and greedy decoding by
    # recomputation (the same on every rank: built from the same seed).
    full = model.logits(torch.from_numpy(target).to(device))[-1]
    ids, greedy = [int(t) for t in target], []
    for _ in range(4):
        greedy.append(int(model.logits(torch.tensor(ids, device=device))[-1].argmax()))
        ids.append(greedy[-1])
    shard_model(model, group)
    if not group.leader:
        return followed(model, group)
    engine = leader_engine(model, CONFIG, group)
    try:
        engine.generate(source, 2, resets=source_resets)
        seq, last = engine.prefill(target, target_resets)
        out, logits = [], last
        for _ in range(4):  # greedy decoding over the reused rows
            out.append(int(logits.argmax()))
            logits = engine.extend(seq, out[-1:])[-1]
        engine.finish(seq)
        engine.check()
    except BaseException as err:
        engine.runner.stop(f"{type(err).__name__}: {err}")
        raise
    engine.runner.stop()
    return dict(error=float((last - full).abs().max()), spread=float(full.std()),
                pic_tokens=seq.stats.pic_tokens, out=out, greedy=greedy,
                pool=(engine.pool.ckv.cpu().numpy().copy(), engine.pool.kr.cpu().numpy().copy()))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL)")])])
@pytest.mark.parametrize("case", ["v2_lite_like", "v3_like"])
def test_one_layer_live_pic_under_tensor_parallel_equals_recomputation(case: str,
                                                                       device: str) -> None:
    """On CUDA the engine runs the Triton kernels (fp32 inputs, but their tile products in TF32,
    10-bit mantissas: ~1e-3 relative), against the reference's torch path."""
    leader, *followers = values(run_ranks(serve, 2, case, device, timeout_s=300, device=device))
    assert leader["pic_tokens"] >= 300, leader["pic_tokens"]  # the documents were reused
    assert leader["error"] <= (1e-5 if device == "cpu" else 1e-2 * leader["spread"]), leader
    assert leader["out"] == leader["greedy"]
    for follower in followers:
        assert follower["forwards"] > 0
        # The same rows in the same slots on every rank: the replicated latent pool.
        assert np.array_equal(follower["pool"][0], leader["pool"][0])
        assert np.array_equal(follower["pool"][1], leader["pool"][1])


REPAIRED = EngineConfig(mode="live", slots=1200, pic_audit_rate=1.0,
                        cache=CacheConfig(recompute_share=0.3))


def scheduled(engine: Engine) -> dict:
    """The shifted documents through a scheduler with CacheBlend-style repair and the audit at
    rate 1: the target's greedy tokens and prompt stats, then the idle audit's KL."""
    scheduler = Scheduler(engine)
    source, source_resets, target, target_resets = shifted_docs()
    tokens, stats = [], None
    for prompt, resets in ((source, source_resets), (target, target_resets)):
        scheduler.add(prompt, SamplingParams(max_tokens=3), resets=resets)
        while scheduler.has_work():
            for out in scheduler.step():
                assert out.error is None, out.error
                if prompt is target:
                    tokens += out.new_tokens
                    stats = out.stats or stats
    ran = scheduler.run_audit()
    audit = scheduler.audit.stats
    return dict(tokens=tokens, pic_tokens=stats.pic_tokens, computed=stats.prefilled_tokens,
                ran=ran, audited=audit.audited, kl=audit.kl_sum)


def repaired(group: ParallelGroup, case: str) -> dict:
    model = tiny_model(case, layers=2, seed=4)
    # The reference: the same engine on the unsharded model, on this process alone.
    reference = scheduled(Engine(model, REPAIRED)) if group.leader else None
    shard_model(model, group)
    if not group.leader:
        return dict(forwards=follow(model, group))
    engine = leader_engine(model, REPAIRED, group)
    try:
        got = scheduled(engine)
    except BaseException as err:
        engine.runner.stop(f"{type(err).__name__}: {err}")
        raise
    engine.runner.stop()
    return dict(got=got, reference=reference)


@pytest.mark.parametrize("case", ["v2_lite_like", "v3_like"])
def test_repair_and_audit_run_on_every_rank(case: str) -> None:
    """The repair's check forward and the audit's recomputation run the sharded model, whose
    all-reduces need every rank: on 2 ranks they pick the same tokens to recompute and record
    the same KL as one process on the whole model (a follower left out would hang the leader's
    all-reduce until the test's timeout)."""
    leader, follower = values(run_ranks(repaired, 2, case, timeout_s=300))
    got, reference = leader["got"], leader["reference"]
    assert reference["pic_tokens"] > 200 and reference["ran"] and reference["audited"] == 1
    assert reference["kl"] > 0  # two layers: reuse is not exact, so the audit has a KL to see
    assert reference["computed"] > 100  # 70 new tokens, the rest recomputed by the repair
    assert {k: got[k] for k in ("tokens", "pic_tokens", "computed", "ran", "audited")} == {
        k: reference[k] for k in ("tokens", "pic_tokens", "computed", "ran", "audited")}
    assert got["kl"] == pytest.approx(reference["kl"], rel=1e-4, abs=1e-9)
    assert follower["forwards"] > 0
