"""bench serve's arithmetic against hand-computed values: percentiles, throughput, cache shares,
live against off, Poisson arrivals, and the table's units."""

from __future__ import annotations

import numpy as np
import pytest

from irminsul.loadgen.client import CallRecord
from irminsul.loadgen.report import compare, percentiles, render, summarize
from irminsul.loadgen.runner import Run, SessionRecord, arrivals


def test_percentiles_interpolate_between_closest_ranks() -> None:
    # [1, 2, 3, 4]: rank q/100 * 3 -> p50 at 1.5 (2.5), p90 at 2.7 (3.7), p99 at 2.97 (3.97)
    assert percentiles([4.0, 1.0, None, 3.0, 2.0]) == pytest.approx(
        {"p50": 2.5, "p90": 3.7, "p99": 3.97, "mean": 2.5})
    assert percentiles([5.0]) == {"p50": 5.0, "p90": 5.0, "p99": 5.0, "mean": 5.0}
    assert percentiles([None]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def record(session: int, index: int, *, ttft: float, tpot: float | None, e2e: float,
           prompt: int, completion: int, prefix: int, pic: int,
           error: str | None = None) -> CallRecord:
    return CallRecord(f"s{session}", session, index, index, max_tokens=8, logged_reply=True,
                      ttft_ms=ttft, tpot_ms=tpot, e2e_ms=e2e, prompt_tokens=prompt,
                      completion_tokens=completion, cached_tokens=prefix + pic,
                      prefix_cached_tokens=prefix, pic_cached_tokens=pic, error=error)


def run(pic: int, *, wall: float, session_walls: tuple[float, float]) -> Run:
    calls = [record(0, 0, ttft=100, tpot=10, e2e=170, prompt=1000, completion=8, prefix=0, pic=0),
             record(0, 1, ttft=20, tpot=None, e2e=20, prompt=1000, completion=1, prefix=100,
                    pic=pic),
             record(1, 0, ttft=300, tpot=30, e2e=510, prompt=2000, completion=8, prefix=200,
                    pic=pic),
             record(1, 1, ttft=0, tpot=None, e2e=0, prompt=0, completion=0, prefix=0, pic=0,
                    error="HTTP 500: boom")]
    sessions = [SessionRecord("s0", 0, 2, 0.0, 0.0, session_walls[0]),
                SessionRecord("s1", 1, 2, 0.0, 1.0, 1.0 + session_walls[1])]
    return Run(calls, sessions, wall)


def test_summary_of_a_replay() -> None:
    s = summarize(run(600, wall=4.0, session_walls=(2.0, 3.0)))
    assert (s["sessions"], s["calls"], s["failed_calls"]) == (2, 4, 1)
    assert s["ttft_ms"]["p50"] == 100 and s["ttft_ms"]["mean"] == 140  # the failed call is out
    assert s["tpot_ms"]["p50"] == 20  # calls of one token have no TPOT
    assert s["e2e_ms"]["p90"] == pytest.approx(170 + 0.8 * 340)
    assert s["session_s"]["p50"] == 2.0  # s1 had a failed call: s0's 2 s alone
    assert s["failed_sessions"] == 1
    assert s["request_throughput_rps"] == 3 / 4.0
    assert s["output_throughput_tps"] == 17 / 4.0
    assert (s["prompt_tokens"], s["completion_tokens"], s["max_tokens"]) == (4000, 17, 24)
    assert (s["prefix_cached_tokens"], s["pic_cached_tokens"]) == (300, 1200)
    assert s["computed_tokens"] == 4000 - 1500
    assert (s["prefix_share"], s["pic_share"], s["computed_share"]) == (0.075, 0.3, 0.625)


def test_a_derived_prefix_is_its_own_share() -> None:
    replay = run(600, wall=4.0, session_walls=(2.0, 3.0))
    call = replay.calls[2]  # 2,000 prompt tokens: 200 prefix, of which now 150 derived
    call.prefix_cached_tokens, call.derived_prefix_cached_tokens = 50, 150
    s = summarize(replay)
    assert s["derived_prefix_cached_tokens"] == 150
    assert (s["prefix_share"], s["derived_prefix_share"], s["pic_share"]) == (
        150 / 4000, 150 / 4000, 0.3)
    assert s["computed_share"] == 0.625  # the same tokens were cached
    text = render([{"workload": "w", "sessions": 2, "calls": 4, "load": "2 sessions at a time",
                    "modes": {"live": {"summary": s}}}])
    assert any(line.startswith("derived prefix (not exact)") and line.endswith("3.8%")
               for line in text.splitlines())


def test_a_server_without_the_split_counts_cached_tokens_as_prefix() -> None:
    replay = run(600, wall=4.0, session_walls=(2.0, 3.0))
    for call in replay.calls:
        call.prefix_cached_tokens = call.pic_cached_tokens = None
    s = summarize(replay)
    assert s["pic_share"] is None and s["prefix_share"] == 1500 / 4000


def test_live_against_off() -> None:
    off = summarize(run(0, wall=8.0, session_walls=(4.0, 6.0)))
    live = summarize(run(600, wall=4.0, session_walls=(2.0, 3.0)))
    ratios = compare(off, live)
    assert ratios["session_p50_speedup"] == 5.0 / 2.5
    assert ratios["request_throughput_ratio"] == 2.0
    assert ratios["output_throughput_ratio"] == 2.0
    assert ratios["ttft_p50_speedup"] == 1.0
    assert ratios["live_ttft_p99_over_off_ttft_p50"] == pytest.approx(
        (100 + 0.98 * 200) / 100)


def test_table_has_a_unit_on_every_figure() -> None:
    off = summarize(run(0, wall=8.0, session_walls=(4.0, 6.0)))
    live = summarize(run(600, wall=4.0, session_walls=(2.0, 3.0)))
    text = render([{"workload": "w", "sessions": 2, "calls": 4, "load": "2 sessions at a time",
                    "modes": {"off": {"summary": off}, "live": {"summary": live}},
                    "live_vs_off": compare(off, live)}])
    units = ("ms", "s", "req/s", "tok/s", "tok", "calls", "%", "×")
    rows = [line for line in text.splitlines()
            if line and not line.startswith(("-", "figure", "workload", "bench serve", "live /"))]
    assert len(rows) == 23  # 22 figures and the ratio row
    for row in rows:
        cells = [c for c in row.split("  ") if c.strip()][1:]
        assert cells and all(c.strip().endswith(units) or c.strip() == "-" for c in cells), row
    assert "2.00×" in text.splitlines()[-2]


def test_poisson_arrivals_are_seeded() -> None:
    assert arrivals(3, None, 0).tolist() == [0.0, 0.0, 0.0]
    a, b = arrivals(2000, 4.0, 7), arrivals(2000, 4.0, 7)
    assert a.tolist() == b.tolist() and a[0] == 0.0 and np.all(np.diff(a) > 0)
    assert np.diff(a).mean() == pytest.approx(0.25, rel=0.1)
    assert arrivals(2000, 4.0, 8).tolist() != a.tolist()
    with pytest.raises(ValueError, match="rate"):
        arrivals(2, 0.0, 0)


def test_a_session_with_a_failed_call_is_in_no_session_figure() -> None:
    """Failed calls count in no figure but failed_calls: a session one of whose calls failed
    (an HTTP 500 answered in a millisecond shortens it) is left out of the session wall time.
    Sessions of 2, 3 and 10 s, the 10 s one with a failed call: p50 over [2, 3] is 2.5."""
    calls = [record(i, 0, ttft=10, tpot=1, e2e=20, prompt=10, completion=2, prefix=0, pic=0)
             for i in range(3)]
    calls.append(record(2, 1, ttft=0, tpot=None, e2e=0, prompt=0, completion=0, prefix=0,
                        pic=0, error="HTTP 500: boom"))
    sessions = [SessionRecord(f"s{i}", i, len([c for c in calls if c.session_index == i]),
                              0.0, 0.0, wall) for i, wall in enumerate((2.0, 3.0, 10.0))]
    s = summarize(Run(calls, sessions, 10.0))
    assert s["session_s"] == pytest.approx({"p50": 2.5, "p90": 2.9, "p99": 2.99, "mean": 2.5})
    assert s["failed_calls"] == 1
