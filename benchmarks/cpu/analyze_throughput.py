"""Time `irminsul analyze` on a whole request log (default: the shared mini-swe-agent log).

Target: the full mini-swe-agent log, 20,163 requests / ~3e8 prompt tokens, in <= 90 s on the
2-core CI machine (run it under ``taskset -c 0,1`` elsewhere). Prints requests, prompt tokens,
wall time, tokens/s, the CPU time of the analysing process and of its children (render workers,
the replay process), the peak RSS of the analysing process and of the largest child, and the
machine's load average before and after (the wall time means little on a loaded machine).

``--expect REPORT.json`` compares the report with one saved earlier (``--json``), all but its
``seconds``, and exits with status 1 naming every field that differs: a speed change must not
change a figure.

    python benchmarks/cpu/analyze_throughput.py [LOG] [--json OUT] [--expect REPORT.json]
                                                [--workers N] [--out RESULT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from irminsul.analysis.analyze import analyze_log
from irminsul.traffic.render import ChatRenderer

# The shared traces lie beside the repository, whatever directory the script is run from.
DEFAULT_LOG = str(Path(__file__).resolve().parents[3] / "shared" / "traces"
                  / "mini-swe-agent-gemini3pro.requests.jsonl.xz")


def differences(expected: object, got: object, path: str = "") -> list[str]:
    """Every field path where two JSON values differ (a list's length counts as one field)."""
    if type(expected) is not type(got):
        return [f"{path or '.'}: {expected!r} != {got!r}"]
    if isinstance(expected, dict):
        out = []
        for key in sorted(set(expected) | set(got)):
            if key not in expected or key not in got:
                out.append(f"{path}.{key}: only in {'got' if key in got else 'expected'}")
            else:
                out += differences(expected[key], got[key], f"{path}.{key}")
        return out
    if isinstance(expected, list):
        if len(expected) != len(got):
            return [f"{path}: {len(expected)} items != {len(got)}"]
        return [d for i, (a, b) in enumerate(zip(expected, got))
                for d in differences(a, b, f"{path}[{i}]")]
    return [] if expected == got else [f"{path}: {expected!r} != {got!r}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", nargs="?", default=DEFAULT_LOG)
    parser.add_argument("--json", help="also write the analyze report here")
    parser.add_argument("--expect", help="a report saved earlier: exit 1 if this one differs")
    parser.add_argument("--workers", type=int, help="render processes (default: one per core)")
    parser.add_argument("--out", help="also write the figures printed here as JSON")
    args = parser.parse_args()
    load_before = os.getloadavg()
    started = time.perf_counter()
    report = analyze_log(args.log, ChatRenderer.default(), workers=args.workers, progress=False)
    seconds = time.perf_counter() - started
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                         resource.RUSAGE_CHILDREN))
    figures = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "taskset -c 0,1 python benchmarks/cpu/analyze_throughput.py --out F.json",
        "log": Path(args.log).name,
        "requests": report["requests"],
        "prompt_tokens": report["prompt_tokens"],
        "cores": len(os.sched_getaffinity(0)),
        "wall_s": round(seconds, 1),
        "cpu_s": round(own.ru_utime + own.ru_stime, 1),
        "children_cpu_s": round(children.ru_utime + children.ru_stime, 1),
        "peak_rss_gb": round(own.ru_maxrss / 2**20, 2),
        "child_peak_rss_gb": round(children.ru_maxrss / 2**20, 2),
        "load_before": round(load_before[0], 2),
        "load_after": round(os.getloadavg()[0], 2),
    }
    print(f"log            {args.log}")
    print(f"requests       {figures['requests']:,}")
    print(f"prompt tokens  {figures['prompt_tokens']:,}")
    print(f"wall time      {seconds:.1f} s on {figures['cores']} cores  (target <= 90 s on 2)")
    print(f"throughput     {report['prompt_tokens'] / seconds / 1e6:.2f} M prompt tokens/s")
    print(f"CPU time       {figures['cpu_s']:.1f} s (analysis), {figures['children_cpu_s']:.1f} s "
          "(render workers and the replay process)")
    print(f"peak RSS       {figures['peak_rss_gb']:.2f} GB (analysis), "
          f"{figures['child_peak_rss_gb']:.2f} GB (largest child)")
    print(f"load average   {figures['load_before']:.2f} before, {figures['load_after']:.2f} after")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=1)
    if args.expect:
        with open(args.expect, encoding="utf-8") as f:
            expected = json.load(f)
        written = json.loads(json.dumps(report))  # as --json writes it: numpy floats as floats
        found = differences({k: v for k, v in expected.items() if k != "seconds"},
                            {k: v for k, v in written.items() if k != "seconds"})
        print(f"report         {'identical to' if not found else 'DIFFERS from'} {args.expect}")
        for line in found[:50]:
            print(f"  {line}")
        if found:
            sys.exit(1)


if __name__ == "__main__":
    main()
