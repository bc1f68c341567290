"""Engines under data-parallel attention: each rank its own scheduler, cache and requests (one rank
of four none), their model calls in lockstep over the MoE's all-to-all. Each rank serves its
requests — live PIC over re-ordered documents, CacheBlend-style repair's check forward — as one
process serves the same requests on the whole model: the same tokens, the same reuse and the
same pool rows (1e-5, fp32)."""

from __future__ import annotations

import numpy as np
import pytest
from parallel_ranks import run_ranks, values
from test_parallel_engine import shifted_docs
from tiny_parallel import tiny_model

from irminsul.config import CacheConfig, EngineConfig
from irminsul.engine import Engine, SamplingParams, Scheduler
from irminsul.parallel import ParallelGroup, shard_model
from irminsul.parallel.lockstep import LockstepRunner, lockstep_engine, run_in_lockstep

CONFIG = EngineConfig(mode="live", slots=2400, cache=CacheConfig(recompute_share=0.3))


def requests(rank: int) -> list[tuple[np.ndarray, list[int], int]]:
    """Rank 0: documents, then the same documents re-ordered behind another header (PIC);
    rank 1: another pair, and a third prompt of its own; rank 2 one prompt; rank 3 none."""
    if rank == 3:
        return []
    source, source_resets, target, target_resets = shifted_docs(seed=3 + rank)
    out = [(source, source_resets, 3), (target, target_resets, 4 + rank)]
    if rank == 1:
        out.append((np.random.default_rng(9).integers(0, 97, 150), [], 5))
    return out[:1] if rank == 2 else out


def serve(scheduler: Scheduler, rank: int, lockstep: bool) -> dict:
    for prompt, resets, max_tokens in requests(rank):
        scheduler.add(prompt, SamplingParams(max_tokens=max_tokens), resets=resets)
    if lockstep:
        outputs = run_in_lockstep(scheduler)
    else:
        outputs = []
        while scheduler.has_work():
            outputs += scheduler.step()
    tokens: dict[str, list[int]] = {}
    stats = {}
    for out in outputs:
        assert out.error is None, out.error
        tokens.setdefault(out.request_id, []).extend(out.new_tokens)
        if out.stats is not None:
            stats[out.request_id] = (out.stats.pic_tokens, out.stats.prefilled_tokens)
    pool = scheduler.engine.pool
    return dict(tokens=list(tokens.values()), stats=list(stats.values()),
                pool=(pool.ckv.numpy().copy(), pool.kr.numpy().copy()))


def ranks_engines(group: ParallelGroup, case: str) -> dict:
    model = tiny_model(case, layers=3, seed=4)
    reference = serve(Scheduler(Engine(model, CONFIG)), group.rank, lockstep=False)
    shard_model(model, group, attention="data")
    engine = lockstep_engine(model, CONFIG, group)
    got = serve(Scheduler(engine), group.rank, lockstep=True)
    runner = engine.runner
    assert isinstance(runner, LockstepRunner)
    pool = max(float(np.abs(a - b).max()) for a, b in zip(got.pop("pool"), reference.pop("pool")))
    return dict(got=got, reference=reference, pool=pool, steps=runner.steps, joined=runner.joined)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["v2_lite_like", "v3_like"])
def test_each_rank_serves_its_requests_as_one_process(world: int, case: str) -> None:
    ranks = values(run_ranks(ranks_engines, world, case, timeout_s=300))
    for rank, r in enumerate(ranks):
        assert r["got"] == r["reference"], (rank, r)
        assert r["pool"] <= 1e-5, (rank, r["pool"])
        assert len(r["got"]["tokens"]) == len(requests(rank))
    assert ranks[0]["reference"]["stats"][1][0] >= 200  # reused (30% repaired)
    # Every rank took part in every step of the busiest rank, joining those it had less to run.
    assert len({r["steps"] for r in ranks}) == 1
    assert ranks[0]["joined"] > 0  # rank 1 has more to run
    if world == 4:
        assert ranks[3]["joined"] == ranks[3]["steps"] > 0  # rank 3 only ever joins
