"""The analyzer's three passes against naive re-computations on small synthetic logs."""

from __future__ import annotations

import numpy as np
import pytest

from irminsul.analysis.characterize import WINDOW, Characterisation
from irminsul.analysis.recoverability import Recoverability
from irminsul.analysis.replay import STRATEGIES, Replay
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
    for k, p in enumerate(prompts):
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
        for w in windows:
            first_session.setdefault(w, p.session)
        assert char.add(p).length == lcp
    result = char.result()
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
    assert result["default"]["strategy"] == "msg+s1"
    assert result["default"]["total"] == result["msg+s1"]["total"]


def test_replay_capacity_bounds_what_is_served() -> None:
    """A tiny budget serves less than an unbounded one (LRU eviction actually happens)."""
    prompts = _prompts(3)
    small, big = Replay(capacity=300), Replay(capacity=None)
    for p in prompts:
        small.add(p)
        big.add(p)
    assert small.result()["msg+s1"]["total"] < big.result()["msg+s1"]["total"]
