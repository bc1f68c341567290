"""Recall and host time of the planner's probing options, side by side, on real logs and workloads.

Each option is a :class:`~irminsul.config.CacheConfig`; each log is replayed in order through one
:class:`~irminsul.cache.planner.Planner` per option (analyze's replay capacity, message-aligned
resets). Per log and option it prints

    pic        prompt tokens served by PIC (hits past the exact prefix), share of all prompt tokens
    recall     pic / shifted, shifted being analyze's characterisation (64-token windows seen
               before, past the exact prefix): how much of the findable content the option finds
    plan, commit, total   host time per prompt in ms, median over the log's prompts (and the
               mean of total: a few long prompts dominate it): the planner's CPU time (the
               thread's, so that other jobs on a shared machine do not count; on an idle
               machine it is the wall time of this single-threaded code)

Logs: the shared traces (when present beside the repository) and the partition-shift workloads
built from the shipped samples, as ``irminsul demo`` builds them.

    python benchmarks/cpu/planner_options.py [LOG...] [--options NAME...] [--requests N]
                                             [--out docs/results/cpu-planner-options.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from irminsul.analysis.characterize import Characterisation
from irminsul.cache.planner import Planner
from irminsul.config import ALGORITHM1, REPLAY_CAPACITY, CacheConfig
from irminsul.traffic.logs import read_requests, sample_logs, write_requests
from irminsul.traffic.prompt import Prompt, render_prompt
from irminsul.traffic.render import ChatRenderer
from irminsul.traffic.workloads import PATTERNS, TextPool, build_workload

SHARED = Path(__file__).resolve().parents[3] / "shared" / "traces"
# The engine's configuration before this option sweep: head probe, regions, S1 at 128.
BEFORE = replace(CacheConfig(), s1_window=128, s1_extend=False)
OPTIONS: dict[str, CacheConfig] = {
    "algorithm1": ALGORITHM1,
    "before": BEFORE,
    "s1_64": replace(BEFORE, s1_window=64),
    "s1_32": replace(BEFORE, s1_window=32),
    "extend_128": replace(BEFORE, s1_extend=True),
    "extend_64": replace(BEFORE, s1_window=64, s1_extend=True),
    "extend_32": replace(BEFORE, s1_window=32, s1_extend=True),  # the engine's default now
}
assert OPTIONS["extend_32"] == CacheConfig(), "extend_32 must stay the engine's default"


def workload_logs(renderer: ChatRenderer, out: Path, requests: int) -> list[Path]:
    """The five partition-shift workloads over the first shipped sample (agent_meta at H=250)."""
    samples = sample_logs()
    texts = [m["content"] for src in samples for r in read_requests(src) for m in r.messages
             if isinstance(m.get("content"), str) and m["role"] in ("user", "tool")]
    pool, bodies = TextPool(texts, renderer), list(read_requests(samples[0], strict=True))
    paths = []
    for pattern in PATTERNS:
        path = out / f"{pattern}.jsonl"
        write_requests(path, build_workload(pattern, bodies, pool, requests=requests,
                                            header_tokens=250))
        paths.append(path)
    return paths


def render_log(renderer: ChatRenderer, path: Path) -> list[Prompt]:
    return [render_prompt(renderer, r.messages, r.tools, session=r.session)
            for r in read_requests(path)]


def shifted_share(prompts: list[Prompt]) -> float:
    char = Characterisation()
    for prompt in prompts:
        char.add(prompt)
    return char.result()["shifted"]


def replay(prompts: list[Prompt], options: list[str]) -> dict[str, dict]:
    """PIC-served tokens, hits and per-prompt host times of one planner per option over the
    prompts in order; the options take turns on each prompt, so they see the same machine."""
    planners = {o: Planner(replace(OPTIONS[o], capacity=REPLAY_CAPACITY)) for o in options}
    times = {o: ([], []) for o in options}  # plan ms, commit ms per prompt
    pic, hits = dict.fromkeys(options, 0), dict.fromkeys(options, 0)
    total = handle = 0
    for prompt in prompts:
        handles = np.arange(handle, handle + prompt.size, dtype=np.int64)
        handle += prompt.size
        total += prompt.size
        for option, planner in planners.items():
            t0 = time.thread_time()
            plan = planner.plan(prompt.tokens, prompt.resets)
            t1 = time.thread_time()
            planner.commit(plan, handles)
            t2 = time.thread_time()
            times[option][0].append(1e3 * (t1 - t0))
            times[option][1].append(1e3 * (t2 - t1))
            pic[option] += plan.tokens_of("hit")
            hits[option] += len(plan.hits)
    out = {}
    for option, (plan_ms, commit_ms) in times.items():
        totals = [a + b for a, b in zip(plan_ms, commit_ms)]
        out[option] = {"pic": pic[option] / max(total, 1),
                       "hits_per_prompt": hits[option] / max(len(prompts), 1),
                       "tokens_per_hit": pic[option] / max(hits[option], 1),
                       "plan_ms_p50": statistics.median(plan_ms),
                       "commit_ms_p50": statistics.median(commit_ms),
                       "total_ms_p50": statistics.median(totals),
                       "total_ms_mean": statistics.fmean(totals)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="*", help="default: the shared traces and the workloads")
    parser.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    parser.add_argument("--requests", type=int, default=200, help="requests per workload")
    parser.add_argument("--out", help="also write the figures as JSON")
    args = parser.parse_args()
    renderer = ChatRenderer.default()
    logs = [Path(p) for p in args.logs]
    if not logs:
        logs = sorted(SHARED.glob("*.jsonl*"))
        logs += workload_logs(renderer, Path(tempfile.mkdtemp(prefix="irminsul-options-")),
                              args.requests)
    rows = []
    print(f"{'log':<28} {'shifted':>7} {'option':<11} {'pic':>7} {'recall':>7} {'tok/hit':>7} "
          f"{'plan':>7} {'commit':>7} {'total':>7} {'mean':>7}")
    for path in logs:
        prompts = render_log(renderer, path)
        shifted = shifted_share(prompts)
        name = path.name.split(".")[0]
        results = replay(prompts, args.options)
        for option, r in results.items():
            recall = r["pic"] / shifted if shifted else float("nan")
            rows.append({"log": name, "requests": len(prompts), "shifted": shifted,
                         "option": option, "recall": recall, **r})
            print(f"{name:<28} {100 * shifted:6.2f}% {option:<11} {100 * r['pic']:6.2f}% "
                  f"{100 * recall:6.1f}% {r['tokens_per_hit']:7.0f} {r['plan_ms_p50']:7.3f} "
                  f"{r['commit_ms_p50']:7.3f} {r['total_ms_p50']:7.3f} "
                  f"{r['total_ms_mean']:7.3f}", flush=True)
        del prompts
    if args.out:
        configs = {k: {f: getattr(v, f) for f in ("s1_window", "s1_extend", "head_probe",
                                                   "regions")} for k, v in OPTIONS.items()}
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "clock": "the planner thread's CPU time", "capacity": REPLAY_CAPACITY,
                       "options": configs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
