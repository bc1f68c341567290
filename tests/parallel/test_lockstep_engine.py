"""Engines under data-parallel attention: each rank its own scheduler, cache and requests (one rank
of four none), their model calls in lockstep over the MoE's all-to-all. Each rank serves its
requests — live PIC over re-ordered documents, CacheBlend-style repair's check forward — as one
process serves the same requests on the whole model: the same tokens, the same reuse and the
same pool rows (1e-5, fp32)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest
from parallel_ranks import run_ranks, values
from test_parallel_engine import shifted_docs
from tiny_parallel import tiny_model

from irminsul.config import CacheConfig, EngineConfig
from irminsul.engine import Engine, SamplingParams, Scheduler
from irminsul.engine.model_runner import ModelRunner
from irminsul.parallel import ParallelGroup, shard_model
from irminsul.parallel.lockstep import LockstepRunner, lockstep_engine, run_in_lockstep
from irminsul.server.async_engine import AsyncEngine

CONFIG = EngineConfig(mode="live", slots=2400, cache=CacheConfig(recompute_share=0.3))


def requests(rank: int, docs: tuple[int, int] = (200, 180)
             ) -> list[tuple[np.ndarray, list[int], int]]:
    """Rank 0: documents, then the same documents re-ordered behind another header (PIC);
    rank 1: another pair, and a third prompt of its own; rank 2 one prompt; rank 3 none."""
    if rank == 3:
        return []
    source, source_resets, target, target_resets = shifted_docs(3 + rank, docs)
    out = [(source, source_resets, 3), (target, target_resets, 4 + rank)]
    if rank == 1:
        out.append((np.random.default_rng(9).integers(0, 97, sum(docs) // 2), [], 5))
    return out[:1] if rank == 2 else out


def serve(scheduler: Scheduler, rank: int, lockstep: bool,
          docs: tuple[int, int] = (200, 180)) -> dict:
    for prompt, resets, max_tokens in requests(rank, docs):
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


def ranks_engines(group: ParallelGroup, case: str, config: EngineConfig = CONFIG,
                  heads: int | None = None, layers: int = 3,
                  docs: tuple[int, int] = (200, 180)) -> dict:
    overrides = {} if heads is None else {"num_attention_heads": heads,
                                          "num_key_value_heads": heads}
    model = tiny_model(case, layers=layers, seed=4, **overrides)
    reference = serve(Scheduler(Engine(model, config)), group.rank, False, docs)
    shard_model(model, group, attention="data")
    engine = lockstep_engine(model, config, group)
    got = serve(Scheduler(engine), group.rank, True, docs)
    runner = engine.runner
    assert isinstance(runner, LockstepRunner)
    pool = max(float(np.abs(a - b).max()) for a, b in zip(got.pop("pool"), reference.pop("pool")))
    return dict(got=got, reference=reference, pool=pool, steps=runner.steps, joined=runner.joined,
                replays=runner.graph_replays)


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


def host_only_steps(group: ParallelGroup, case: str) -> dict:
    """Rank 1 serves one request; rank 0 has steps with work and no model call while rank 1's
    forwards wait in their steps' all-reduce. ``held``: its first three admissions are held
    back (as for a request awaiting content), then one request fails at planning and the
    other is served. ``rejected``: its only request fails at planning."""
    model = tiny_model("v3_like", layers=2, seed=4)
    config = EngineConfig(mode="live", slots=600)
    rng = np.random.default_rng(group.rank)
    bad, good = rng.integers(0, 97, 33), rng.integers(0, 97, 60)
    work = {0: [bad] + ([good] if case == "held" else []), 1: [good]}[group.rank]
    served = [p for p in work if p is not bad]

    def tokens_of(outputs: list) -> list[list[int]]:
        tokens: dict[str, list[int]] = {}
        for out in outputs:
            if out.error is None:
                tokens.setdefault(out.request_id, []).extend(out.new_tokens)
        return list(tokens.values())

    reference = Scheduler(Engine(model, config))
    for prompt in served:
        reference.add(prompt, SamplingParams(max_tokens=4 + 2 * group.rank))
    expected = []
    while reference.has_work():
        expected += reference.step()
    shard_model(model, group, attention="data")
    engine = lockstep_engine(model, config, group)
    scheduler = Scheduler(engine)
    for prompt in work:
        scheduler.add(prompt, SamplingParams(max_tokens=4 + 2 * group.rank))
    runner = engine.runner
    assert isinstance(runner, LockstepRunner)
    start_prefill, admit, step = scheduler.cache.start_prefill, scheduler._admit, scheduler.step
    admissions, host_only = 0, 0

    def planned(prompt, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if len(prompt) == len(bad):
            raise ValueError("this prompt's plan fails (the test's)")
        return start_prefill(prompt, *args, **kwargs)

    def admitted(outputs: list) -> None:
        nonlocal admissions
        admissions += 1
        if case != "held" or admissions > 3:
            admit(outputs)

    def stepped() -> list:
        nonlocal host_only
        turns = runner.turns
        outputs = step()
        host_only += runner.turns == turns
        return outputs

    if group.rank == 0:
        scheduler.cache.start_prefill, scheduler._admit = planned, admitted
        scheduler.step = stepped
    outputs = run_in_lockstep(scheduler)
    errors = [out.error for out in outputs if out.error is not None]
    return dict(got=tokens_of(outputs), expected=tokens_of(expected), errors=len(errors),
                turns=runner.turns, host_only=host_only)


@pytest.mark.parametrize("case", ["held", "rejected"])
def test_a_step_without_a_model_call_meets_the_peers_steps(case: str) -> None:
    """A rank whose steps make no model call while it has work (admission held back, a request
    failing at planning) steps again until it makes one, or takes idle turns once it has no
    work: every rank takes the same turns (its all-reduces pair in order, whatever each rank's
    step), none waits out the collective timeout, and each serves its requests as one process
    does. The timeout is 30 s, not less: before their first turn the ranks run their
    single-process references, and a loaded two-core CI machine must not make that a hang."""
    ranks = values(run_ranks(host_only_steps, 2, case, timeout_s=180, collective_timeout_s=30))
    for rank, r in enumerate(ranks):
        served = 1 if case == "held" or rank == 1 else 0
        assert r["got"] == r["expected"] and len(r["got"]) == served, (rank, r)
    assert ranks[0]["errors"] == 1 and ranks[1]["errors"] == 0
    # held: three held admissions (the fourth plans both); rejected: the failed plan's step
    assert ranks[0]["host_only"] == (3 if case == "held" else 1), ranks[0]
    assert ranks[0]["turns"] == ranks[1]["turns"] > 6, ranks


GRAPHED = dataclasses.replace(CONFIG, kernels=True, graphs=True)


def test_graphed_steps_agree_on_a_bucket() -> None:
    """CUDA graphs under data-parallel attention (16 heads: the graphs' 16-row blocks): a step
    replays only where every rank's call would, each rank padded to the bucket of the largest
    batch, a rank with nothing to run replaying padding alone, the exchanges in fixed sizes.
    Off a GPU a replay is the bucket's padded forward (Triton's interpreter), the path a graph
    captures. Each rank still serves its requests as one process does, and the steps with the
    repair's check forward, or a long prefill, run eagerly on every rank."""
    # Short documents and two layers: Triton's interpreter runs every program of a padded
    # launch, empty ones included (minutes at the default sizes).
    ranks = values(run_ranks(ranks_engines, 2, "v3_like", GRAPHED, 16, 2, (56, 48),
                             timeout_s=900))
    for rank, r in enumerate(ranks):
        assert r["got"] == r["reference"], (rank, r)
        assert r["pool"] <= 1e-5, (rank, r["pool"])
    assert len({r["steps"] for r in ranks}) == 1
    # Rank 1 decodes its third request after rank 0 is done: rank 0 replays padding for it.
    assert ranks[1]["replays"] >= 5 and ranks[0]["replays"] == ranks[1]["replays"], ranks
    assert ranks[0]["joined"] > 0


class CountedTurns(ModelRunner):
    """A runner with peers that are not there: records the turns the server's engine loop takes
    (``idle``'s calls and their ``stop``), answers ``busy`` for whether a peer ran a step."""

    lockstep = True

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[float, bool]] = []
        self.busy, self.stopping, self.forwards = False, False, 0

    @property
    def stopped(self) -> bool:
        return self.stopping

    @property
    def turns(self) -> int:
        return len(self.calls) + self.forwards

    def idle(self, stop: bool = False) -> bool:
        self.calls.append((time.monotonic(), stop))
        self.stopping |= stop
        return self.busy

    def forward(self, batch, *, all_logits: bool = False):  # noqa: ANN001, ANN201
        self.forwards += 1
        return super().forward(batch, all_logits=all_logits)


def test_the_server_loop_takes_turns_backs_off_and_agrees_on_stops() -> None:
    """An idle engine with peers takes a turn every 2 ms at first, backing off to 20 ms while no
    peer runs anything, and at once while one does; a request is served between turns; its stop
    is announced in its last turn; a peer's stop ends the engine by itself."""
    model = tiny_model("v3_like", layers=2, seed=4)
    engine = Engine(model, EngineConfig(mode="live", slots=600), runner=CountedTurns)
    runner = engine.runner
    assert isinstance(runner, CountedTurns) and engine.peers is runner
    served = AsyncEngine(Scheduler(engine))
    served.start()
    time.sleep(0.6)
    idle = len(runner.calls)
    gaps = np.diff([t for t, _ in runner.calls])
    assert 10 <= idle <= 100, idle  # not 300 turns of 2 ms
    assert gaps[:2].max() < 0.012 and np.median(gaps[-10:]) > 0.015, gaps  # 4, 8, 16, 20 ms
    runner.busy = True
    time.sleep(0.2)
    assert len(runner.calls) - idle > 100  # turns back to back while a peer works
    runner.busy = False

    async def ask() -> list[int]:
        return [t async for out in served.generate(np.arange(40) % 97,
                                                   SamplingParams(max_tokens=3))
                for t in out.new_tokens]

    assert len(asyncio.run(ask())) == 3 and runner.forwards >= 3
    served.shutdown()
    assert runner.calls[-1][1] is True  # the last turn announced the stop
    assert sum(stop for _, stop in runner.calls) == 1

    other = Engine(model, EngineConfig(mode="live", slots=600), runner=CountedTurns)
    served = AsyncEngine(Scheduler(other))
    served.start()
    time.sleep(0.1)
    other.runner.stopping = True  # another rank stopped
    deadline = time.monotonic() + 2
    while served.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not served.alive
    assert not any(stop for _, stop in other.runner.calls)  # it announced nothing itself
