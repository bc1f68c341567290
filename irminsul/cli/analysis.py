"""The commands on request logs, no model run: analyze, workload and demo."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from ..analysis.analyze import analyze_log
from ..analysis.report import render_reports
from ..config import REPLAY_CAPACITY
from ..traffic.logs import sample_logs
from ..traffic.render import ChatRenderer
from ..traffic.workloads import PATTERNS
from .common import add_command, positive, text_pool, write_json, write_workload

DEMO_HEADERS = (50, 250, 1000, 2000)


def _renderer(args: argparse.Namespace) -> ChatRenderer:
    return ChatRenderer.from_dir(args.tokenizer) if args.tokenizer else ChatRenderer.default()


def _capacity(text: str) -> int | None:
    return None if text == "none" else int(text)


def _warn_malformed(report: dict) -> None:
    """Say on stderr how many lines of a log were skipped and where the first was, so that a
    damaged log is noticed without --json (whose report lists every one)."""
    skipped = report["malformed_lines"]
    if skipped:
        print(f"irminsul: warning: {report['log']}: skipped {len(skipped)} malformed "
              f"line{'s' if len(skipped) > 1 else ''}; first: {skipped[0]} "
              "(--json lists all, --strict stops at the first)", file=sys.stderr)


def cmd_analyze(args: argparse.Namespace) -> None:
    """Characterise, measure the recoverability of and replay each request log."""
    renderer = _renderer(args)
    reports = []
    for log in args.logs:
        reports.append(analyze_log(log, renderer, capacity=args.capacity, strict=args.strict,
                                   progress=not args.quiet))
        _warn_malformed(reports[-1])
    print(render_reports(reports))
    write_json(args.json, reports)
    if args.html:
        from ..analysis.html import render_html  # matplotlib: only when a page is asked for

        Path(args.html).write_text(render_html(reports), encoding="utf-8")


def cmd_workload(args: argparse.Namespace) -> None:
    """Write one partition-shift workload log built from real agent text."""
    renderer = _renderer(args)
    sources = [Path(s) for s in args.source] if args.source else sample_logs()
    count = write_workload(args.pattern, Path(args.out), sources[0], text_pool(renderer, sources),
                            requests=args.requests, header_tokens=args.header_tokens,
                            markers=args.markers, seed=args.seed)
    print(f"wrote {count} {args.pattern} requests to {args.out}")


def cmd_demo(args: argparse.Namespace) -> None:
    """Build the partition-shift workloads from the shipped samples and analyze them with them."""
    renderer = _renderer(args)
    samples = sample_logs()
    pool = text_pool(renderer, samples)
    out = Path(args.out or tempfile.mkdtemp(prefix="irminsul-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    logs: list[tuple[str, Path]] = []
    for markers in (False, True):
        tag = "+s2" if markers else ""
        shape = {"requests": args.requests, "markers": markers, "seed": args.seed}
        for pattern in ("agent_meta", "sysvar"):  # the paper's Figure 4 sweeps
            for header in DEMO_HEADERS:
                path = out / f"{pattern}-h{header}{tag}.jsonl"
                write_workload(pattern, path, samples[0], pool, header_tokens=header, **shape)
                logs.append((f"{pattern} H={header}{tag}", path))
        for pattern in PATTERNS[2:]:
            path = out / f"{pattern}{tag}.jsonl"
            write_workload(pattern, path, samples[0], pool, header_tokens=args.header_tokens,
                            **shape)
            logs.append((f"{pattern}{tag}", path))
    logs += [(p.name.split(".")[0] + " (real)", p) for p in samples]
    reports = []
    for name, path in logs:
        report = analyze_log(path, renderer, capacity=args.capacity, progress=not args.quiet)
        _warn_malformed(report)
        reports.append({"name": name, **report})
    print(render_reports(reports))
    print(f"\nworkloads written to {out}")
    write_json(args.json, reports)


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add analyze, workload and demo to the ``irminsul`` subparsers ``sub``."""
    analyze = add_command(sub, "analyze", "how much of a request log each cache serves")
    analyze.add_argument("logs", nargs="+", metavar="LOG", help="JSON Lines request log(s)")
    analyze.add_argument("--json", metavar="OUT", help="write the full report as JSON")
    analyze.add_argument("--html", metavar="OUT",
                         help="write a self-contained page of charts and a summary per log")
    _capacity_option(analyze)
    analyze.add_argument("--strict", action="store_true", help="fail on the first malformed line")
    analyze.set_defaults(func=cmd_analyze)

    workload = add_command(sub, "workload", "write a partition-shift workload log")
    workload.add_argument("pattern", choices=PATTERNS,
                          help="what changes between requests: a per-agent header "
                               "(agent_meta), a variable in the system prompt (sysvar), compacted "
                               "tool results (compact), re-ranked documents (rerank), the tool "
                               "set (tool_variants)")
    workload.add_argument("--out", required=True, metavar="LOG", help=".jsonl[.gz|.xz] to write")
    workload.add_argument("--source", action="append", metavar="LOG",
                          help="real log to take bodies from (first) and text from (all); "
                               "default: the shipped samples")
    _workload_options(workload)
    workload.set_defaults(func=cmd_workload)

    demo = add_command(sub, "demo", "build the workloads and analyze them with the samples")
    demo.add_argument("--out", metavar="DIR",
                      help="where to write the workloads (default: a new temporary directory)")
    demo.add_argument("--json", metavar="OUT", help="write all reports as JSON")
    _capacity_option(demo)
    _workload_options(demo)
    demo.set_defaults(func=cmd_demo)


def _capacity_option(parser: argparse.ArgumentParser) -> None:
    """--capacity of the commands that replay logs through the cache."""
    parser.add_argument("--capacity", type=_capacity, default=REPLAY_CAPACITY, metavar="N|none",
                        help=f"replay cache budget in tokens per index, or 'none' "
                             f"(default {REPLAY_CAPACITY:,})")


def _workload_options(parser: argparse.ArgumentParser) -> None:
    """Options of the commands that build workloads."""
    parser.add_argument("--requests", type=positive, default=80, help="requests to write (default 80)")
    parser.add_argument("--header-tokens", type=int, default=250,
                        help="agent_meta header length / sysvar variable depth in tokens "
                             "(default 250; demo sweeps 50, 250, 1000, 2000)")
    parser.add_argument("--markers", action="store_true", help="insert S2 boundary markers")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed of the workload's variations (default 0)")
