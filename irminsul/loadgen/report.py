"""A replay's figures (the JSON is the source of truth) and the tables that show them.

Per mode: TTFT, TPOT and end-to-end latency per call and wall time per session at p50/p90/p99
(linear interpolation between closest ranks, numpy's default), request and output-token
throughput over the run's wall time, and where the prompt tokens came from (the server's usage:
exact prefix, PIC, computed). Failed calls count in ``failed_calls`` and in no other figure,
and the sessions they are in (``failed_sessions``) in no session time.
Then live against off: how much faster sessions end, how much more they serve.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ..analysis.report import table
from .runner import Run

PERCENTILES = (50, 90, 99)


def percentiles(values: Iterable[float | None]) -> dict[str, float | None]:
    """p50, p90, p99 and the mean of the values that are not None (all None when none are)."""
    data = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if not data.size:
        return {**{f"p{q}": None for q in PERCENTILES}, "mean": None}
    return {**{f"p{q}": float(np.percentile(data, q)) for q in PERCENTILES},
            "mean": float(data.mean())}


def _share(part: int | None, whole: int) -> float | None:
    return None if part is None or not whole else part / whole


def summarize(run: Run) -> dict:
    """The figures of one replay."""
    ok = [c for c in run.calls if c.error is None]
    prompt = sum(c.prompt_tokens or 0 for c in ok)
    completion = sum(c.completion_tokens or 0 for c in ok)
    cached = sum(c.cached_tokens or 0 for c in ok)
    split = all(c.prefix_cached_tokens is not None for c in ok)  # usage.irminsul everywhere
    prefix = sum(c.prefix_cached_tokens for c in ok) if split else None
    pic = sum(c.pic_cached_tokens or 0 for c in ok) if split else None
    derived = sum(c.derived_prefix_cached_tokens or 0 for c in ok) if split else None
    # A session with a failed call is no session time: a quick error shortens it.
    failed = {c.session for c in run.calls if c.error is not None}
    return {
        "sessions": len(run.sessions), "calls": len(run.calls),
        "failed_calls": len(run.calls) - len(ok), "failed_sessions": len(failed),
        "ttft_ms": percentiles(c.ttft_ms for c in ok),
        "tpot_ms": percentiles(c.tpot_ms for c in ok),
        "e2e_ms": percentiles(c.e2e_ms for c in ok),
        "session_s": percentiles(s.wall_s for s in run.sessions if s.session not in failed),
        "wall_s": run.wall_s,
        "request_throughput_rps": len(ok) / run.wall_s if run.wall_s else None,
        "output_throughput_tps": completion / run.wall_s if run.wall_s else None,
        "prompt_tokens": prompt, "completion_tokens": completion,
        "max_tokens": sum(c.max_tokens for c in ok),
        "cached_tokens": cached, "prefix_cached_tokens": prefix, "pic_cached_tokens": pic,
        "derived_prefix_cached_tokens": derived,
        "computed_tokens": prompt - cached,
        "prefix_share": _share(prefix if split else cached, prompt),
        "pic_share": _share(pic, prompt),
        "derived_prefix_share": _share(derived, prompt),
        "computed_share": _share(prompt - cached, prompt),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def compare(off: dict, live: dict) -> dict:
    """Live against off, each a ratio (> 1: live is better, but for the last, where < 1 means
    live's slowest first tokens come sooner than off's typical ones)."""
    return {
        "session_p50_speedup": _ratio(off["session_s"]["p50"], live["session_s"]["p50"]),
        "request_throughput_ratio": _ratio(live["request_throughput_rps"],
                                           off["request_throughput_rps"]),
        "output_throughput_ratio": _ratio(live["output_throughput_tps"],
                                          off["output_throughput_tps"]),
        "ttft_p50_speedup": _ratio(off["ttft_ms"]["p50"], live["ttft_ms"]["p50"]),
        "live_ttft_p99_over_off_ttft_p50": _ratio(live["ttft_ms"]["p99"], off["ttft_ms"]["p50"]),
    }


def _fmt(value: float | None, unit: str, spec: str = ",.1f") -> str:
    if value is None:
        return "-"
    if unit == "%":
        return f"{100 * value:.1f}%"
    return f"{value:{spec}}{unit}" if unit == "×" else f"{value:{spec}} {unit}"


def _rows(summaries: Sequence[dict]) -> list[list[str]]:
    rows = [["calls (failed)", *(f"{s['calls'] - s['failed_calls']} ({s['failed_calls']}) calls"
                                 for s in summaries)]]
    for key, name, unit, spec in (("ttft_ms", "TTFT", "ms", ",.1f"),
                                  ("tpot_ms", "TPOT", "ms", ",.2f"),
                                  ("e2e_ms", "end-to-end", "ms", ",.1f"),
                                  ("session_s", "session wall", "s", ",.2f")):
        for q in PERCENTILES:
            rows.append([f"{name} p{q}", *(_fmt(s[key][f"p{q}"], unit, spec) for s in summaries)])
    rows += [
        ["request throughput", *(_fmt(s["request_throughput_rps"], "req/s", ",.2f")
                                 for s in summaries)],
        ["output throughput", *(_fmt(s["output_throughput_tps"], "tok/s") for s in summaries)],
        ["total wall time", *(_fmt(s["wall_s"], "s", ",.2f") for s in summaries)],
        ["prompt tokens", *(f"{s['prompt_tokens']:,} tok" for s in summaries)],
        ["completion tokens (asked)", *(f"{s['completion_tokens']:,} ({s['max_tokens']:,}) tok"
                                        for s in summaries)],
        ["served by exact prefix", *(_fmt(s["prefix_share"], "%") for s in summaries)],
        ["served by PIC", *(_fmt(s["pic_share"], "%") for s in summaries)],
        ["derived prefix (not exact)",
         *(_fmt(s["derived_prefix_share"], "%") for s in summaries)],
        ["computed", *(_fmt(s["computed_share"], "%") for s in summaries)],
    ]
    return rows


def render(reports: Sequence[dict]) -> str:
    """One table per workload (a column per mode), then live against off per workload."""
    parts, ratios = [], []
    for report in reports:
        modes = list(report["modes"])
        summaries = [report["modes"][m]["summary"] for m in modes]
        parts.append(table(f"bench serve: {report['workload']}, {report['sessions']} sessions, "
                           f"{report['calls']} calls, {report['load']}",
                           ["figure", *modes], _rows(summaries)))
        if report.get("live_vs_off"):
            r = report["live_vs_off"]
            ratios.append([report["workload"], *(_fmt(r[k], "×", ".2f") for k in (
                "session_p50_speedup", "request_throughput_ratio", "output_throughput_ratio",
                "ttft_p50_speedup", "live_ttft_p99_over_off_ttft_p50"))])
    if ratios:
        parts.append(table("live / off: session p50 speedup (off p50 / live p50), throughput "
                           "ratios (live / off), TTFT p50 speedup, live TTFT p99 / off TTFT p50",
                           ["workload", "session p50", "req/s", "tok/s", "TTFT p50",
                            "TTFT p99 live / p50 off"], ratios))
    return "\n\n".join(parts)
