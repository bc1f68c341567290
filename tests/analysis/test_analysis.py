"""The analyzer's three passes against naive re-computations on small synthetic logs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from irminsul.analysis.characterize import ROLES, WINDOW, Characterisation
from irminsul.analysis.recoverability import Recoverability
from irminsul.analysis.replay import STRATEGIES, Replay
from irminsul.cache.planner import Planner
from irminsul.config import ALGORITHM1, CacheConfig
from irminsul.traffic.prompt import Prompt

EMPTY = np.zeros(0, dtype=np.int64)


def _prompts(seed: int, count: int = 24) -> list[Prompt]:
    """Sessions that grow by appending, share documents across sessions at shifted positions."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 5000, int(rng.integers(80, 400))) for _ in range(6)]
    prompts, histories = [], {}
    for i in range(count):
        session = f"s{i % 3}"
        history = histories.setdefault(session, [rng.integers(0, 5000, int(rng.integers(1, 60)))])
        history.append(docs[int(rng.integers(0, len(docs)))])
        history.append(rng.integers(0, 5000, int(rng.integers(5, 100))))
        tokens = np.concatenate(history).astype(np.int32)
        starts = np.cumsum([0] + [h.size for h in history[:-1]]).astype(np.int64)
        prompts.append(Prompt(session, tokens, starts, EMPTY))
    return prompts


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_characterisation_matches_naive_window_sets(seed: int) -> None:
    """exact-prefix = longest common prefix with any earlier prompt; shifted = the tail tokens
    covered by a 64-token window that occurred in an earlier prompt (within if its first prompt
    was in this session); the four classes sum to the prompt tokens."""
    prompts = _prompts(seed)
    char = Characterisation()
    first_session: dict[tuple, str] = {}
    expect = np.zeros(4, dtype=np.int64)  # exact, within, cross, total
    by_role: dict[str, int] = {}
    for k, p in enumerate(prompts):
        roles = np.arange(p.message_starts.size, dtype=np.int8) % len(ROLES)  # message i: i % 5
        lcp = max((_lcp(p.tokens, q.tokens) for q in prompts[:k]), default=0)
        windows = [tuple(p.tokens[t:t + WINDOW].tolist()) for t in range(p.size - WINDOW + 1)]
        within = np.zeros(p.size, bool)
        cross = np.zeros(p.size, bool)
        for t, w in enumerate(windows):
            owner = first_session.get(w)
            if owner is not None:
                (within if owner == p.session else cross)[t:t + WINDOW] = True
        cross &= ~within
        expect += (lcp, within[lcp:].sum(), cross[lcp:].sum(), p.size)
        for t in range(lcp, p.size):
            if within[t] or cross[t]:
                message = max(i for i, start in enumerate(p.message_starts) if start <= t)
                by_role[ROLES[message % len(ROLES)]] = by_role.get(ROLES[message % len(ROLES)],
                                                                   0) + 1
        for w in windows:
            first_session.setdefault(w, p.session)
        assert char.add(p, roles).length == lcp
    result = char.result()
    got = result["shifted_by_role"]
    assert {role: v["within"] + v["cross"] for role, v in got.items()} == by_role
    sessions = result["session_tokens"]
    assert sessions["session"] == ["s0", "s1", "s2"]
    assert sum(row[0] for row in sessions["counts"]) == expect[3]
    total = expect[3]
    assert result["exact_prefix"] == pytest.approx(expect[0] / total)
    assert result["shifted_within"] == pytest.approx(expect[1] / total)
    assert result["shifted_cross"] == pytest.approx(expect[2] / total)
    parts = result["exact_prefix"] + result["shifted"] + result["novel"]
    assert parts == pytest.approx(1.0)
    assert result["shifted_within"] > 0 and result["shifted_cross"] > 0  # the log exercises both


def test_fixed_block_recovery_matches_naive_block_sets() -> None:
    """fixed-block: a non-prefix token is recovered when its absolute 128-aligned block (whole)
    appeared as a block of an earlier prompt's non-prefix region."""
    prompts = _prompts(5)
    rec, char = Recoverability(), Characterisation()
    seen: set[tuple] = set()
    recovered = non_prefix = 0
    for p in prompts:
        match = char.add(p)
        start = match.length
        non_prefix += p.size - start
        blocks = [(b, tuple(p.tokens[b:b + 128].tolist()))
                  for b in range(start // 128 * 128, p.size - 127, 128)]
        recovered += sum(min(128, b + 128 - start) for b, blk in blocks if blk in seen)
        seen.update(blk for _, blk in blocks)
        rec.add(p, match)
    result = rec.result()
    assert result["non_prefix_tokens"] == non_prefix
    assert result["fixed_block"] == pytest.approx(recovered / non_prefix)
    for key in ("fixed_block", "cdc", "cdc_fallback"):
        assert 0.0 <= result[key] <= 1.0
    assert result["cdc_fallback"] >= result["cdc"]  # S1 only adds hits on chunk misses


def test_replay_fractions_and_exact_prefix() -> None:
    """Unbounded replay: exact-prefix equals the naive LCP sum; total = prefix + PIC <= 1, and
    resetting at message starts finds the shifted documents."""
    prompts = _prompts(7)
    replay = Replay(capacity=None)
    lcp_sum = 0
    for k, p in enumerate(prompts):
        lcp_sum += max((_lcp(p.tokens, q.tokens) for q in prompts[:k]), default=0)
        replay.add(p)
    result = replay.result()
    total = sum(p.size for p in prompts)
    for strategy in STRATEGIES:
        r = result[strategy]
        assert r["exact_prefix"] == pytest.approx(lcp_sum / total)
        assert r["total"] == pytest.approx(r["exact_prefix"] + r["pic_unique"])
        assert r["total"] <= 1.0
    assert result["msg"]["pic_unique"] > 0.05
    assert result["default"]["strategy"] == "engine"
    assert result["default"]["total"] == result["engine"]["total"]
    assert result["algorithm1"]["total"] == result["msg+s1"]["total"]


def test_replay_capacity_bounds_what_is_served() -> None:
    """A tiny budget serves less than an unbounded one (LRU eviction actually happens)."""
    prompts = _prompts(3)
    small, big = Replay(capacity=300), Replay(capacity=None)
    for p in prompts:
        small.add(p)
        big.add(p)
    assert small.result()["msg+s1"]["total"] < big.result()["msg+s1"]["total"]


def _naive_replay(prompts: list[Prompt], config: CacheConfig, resets) -> tuple[int, int, list]:
    """One planner with its own radix tree, plan and commit per prompt, as the engine runs it:
    prefix and PIC tokens over the log, and each prompt's (prompt, prefix, PIC) tokens."""
    planner, handle, per_prompt = Planner(config), 0, []
    for p in prompts:
        plan = planner.plan(p.tokens, resets(p))
        per_prompt.append((p.size, plan.prefix.length, plan.tokens_of("hit")))
        planner.commit(plan, np.arange(handle, handle + p.size))
        handle += p.size
    return sum(r[1] for r in per_prompt), sum(r[2] for r in per_prompt), per_prompt


@pytest.mark.parametrize("capacity", [None, 700])
def test_replay_equals_a_planner_per_strategy(capacity: int | None) -> None:
    """Each strategy's figures equal those of its own planner (own radix tree) run over the log:
    the engine strategy with the engine's default configuration, the others with Algorithm 1's;
    also for s2, whose markers appear only from the 10th prompt on, and under eviction."""
    prompts = _prompts(4)
    for k, p in enumerate(prompts[10:], start=10):  # markers from here on: resets at 2 offsets
        prompts[k] = Prompt(p.session, p.tokens, p.message_starts,
                            np.array([5, min(70, p.size)], dtype=np.int64))
    replay = Replay(capacity=capacity)
    for p in prompts:
        replay.add(p)
    result, total = replay.result(), sum(p.size for p in prompts)
    resets = {"cdc": lambda p: [], "s2": lambda p: p.markers, "msg": lambda p: p.resets}
    for strategy in STRATEGIES:
        base = strategy.split("+")[0]
        if strategy == "engine":
            config, chunking = CacheConfig(capacity=capacity), resets["msg"]
        else:
            config = replace(ALGORITHM1, capacity=capacity, s1=strategy.endswith("+s1"))
            chunking = resets[base]
        prefix, pic, per_prompt = _naive_replay(prompts, config, chunking)
        assert result[strategy]["exact_prefix"] == pytest.approx(prefix / total), strategy
        assert result[strategy]["pic_unique"] == pytest.approx(pic / total), strategy
        if strategy == "engine":  # fewer requests than timeline points: one point per request
            timeline = result["timeline"]
            assert timeline["request_end"] == list(range(1, len(prompts) + 1))
            assert timeline["exact_prefix"] == pytest.approx([r[1] / r[0] for r in per_prompt])
            assert timeline["pic_unique"] == pytest.approx([r[2] / r[0] for r in per_prompt])


def test_mask_sweep_matches_the_planner() -> None:
    """Each k of the sweep recovers what Algorithm 1's planner (chunks verified token by token,
    no carve-out, no S1) finds past the exact prefix with that many mask bits."""
    prompts = _prompts(6)
    rec, char = Recoverability(), Characterisation()
    planners = {k: Planner(replace(ALGORITHM1, mask_bits=k, carve_out=0, s1=False))
                for k in (5, 7, 9)}
    found = dict.fromkeys(planners, 0)
    for p in prompts:
        match = char.add(p)
        rec.add(p, match)
        for k, planner in planners.items():
            plan = planner.plan_tail(p.tokens, match)
            found[k] += plan.tokens_of("hit")
            planner.register_misses(plan, np.zeros(p.size, dtype=np.int64))
    result = rec.result()
    for k, hits in found.items():
        assert result["mask_sweep"][str(k)] == pytest.approx(hits / result["non_prefix_tokens"])
    assert result["cdc"] == result["mask_sweep"]["7"] and found[5] > 0
