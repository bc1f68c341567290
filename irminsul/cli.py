"""The ``irminsul`` command line: analyze request logs, build workloads, run the demo."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from .analysis.analyze import analyze_log
from .analysis.replay import DEFAULT_CAPACITY
from .analysis.report import render_reports
from .traffic.logs import LogError, read_requests, sample_logs, write_requests
from .traffic.render import ChatRenderer
from .traffic.workloads import PATTERNS, TextPool, build_workload

DEMO_HEADERS = (50, 250, 1000, 2000)


def _renderer(args: argparse.Namespace) -> ChatRenderer:
    return ChatRenderer.from_dir(args.tokenizer) if args.tokenizer else ChatRenderer.default()


def _capacity(text: str) -> int | None:
    return None if text == "none" else int(text)


def _write_json(path: str | None, reports: list[dict]) -> None:
    if path:
        payload = reports[0] if len(reports) == 1 else {"logs": reports}
        Path(path).write_text(json.dumps(payload, indent=1), encoding="utf-8")


def cmd_analyze(args: argparse.Namespace) -> None:
    renderer = _renderer(args)
    reports = [analyze_log(log, renderer, capacity=args.capacity, strict=args.strict,
                           progress=not args.quiet) for log in args.logs]
    print(render_reports(reports))
    _write_json(args.json, reports)


def _pool(renderer: ChatRenderer, sources: list[Path]) -> TextPool:
    texts = [m["content"] for src in sources for r in read_requests(src) for m in r.messages
             if isinstance(m.get("content"), str) and m["role"] in ("user", "tool")]
    return TextPool(texts, renderer)


def _write_workload(pattern: str, out: Path, source: Path, pool: TextPool,
                    args: argparse.Namespace, header_tokens: int) -> int:
    bodies = list(read_requests(source, strict=True))
    return write_requests(out, build_workload(pattern, bodies, pool, requests=args.requests,
                                              header_tokens=header_tokens, markers=args.markers,
                                              seed=args.seed))


def cmd_workload(args: argparse.Namespace) -> None:
    renderer = _renderer(args)
    sources = [Path(s) for s in args.source] if args.source else sample_logs()
    count = _write_workload(args.pattern, Path(args.out), sources[0], _pool(renderer, sources),
                            args, args.header_tokens)
    print(f"wrote {count} {args.pattern} requests to {args.out}")


def cmd_demo(args: argparse.Namespace) -> None:
    """Build the partition-shift workloads from the shipped samples and analyze them with them."""
    renderer = _renderer(args)
    samples = sample_logs()
    pool = _pool(renderer, samples)
    out = Path(args.out or tempfile.mkdtemp(prefix="irminsul-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    logs: list[tuple[str, Path]] = []
    for markers in (False, True):
        args.markers = markers
        tag = "+s2" if markers else ""
        for pattern in ("agent_meta", "sysvar"):  # the paper's Figure 4 sweeps
            for header in DEMO_HEADERS:
                path = out / f"{pattern}-h{header}{tag}.jsonl"
                _write_workload(pattern, path, samples[0], pool, args, header)
                logs.append((f"{pattern} H={header}{tag}", path))
        for pattern in PATTERNS[2:]:
            path = out / f"{pattern}{tag}.jsonl"
            _write_workload(pattern, path, samples[0], pool, args, args.header_tokens)
            logs.append((f"{pattern}{tag}", path))
    logs += [(p.name.split(".")[0] + " (real)", p) for p in samples]
    reports = []
    for name, path in logs:
        report = analyze_log(path, renderer, capacity=args.capacity, progress=not args.quiet)
        reports.append({"name": name, **report})
    print(render_reports(reports))
    print(f"\nworkloads written to {out}")
    _write_json(args.json, reports)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="irminsul", description=__doc__)
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="local Hugging Face tokenizer directory with a chat_template "
                             "(default: the DeepSeek tokenizer, DeepSeek-V3-style template)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    sub = parser.add_subparsers(dest="command", required=True)

    analyze = sub.add_parser("analyze", help="how much of a request log each cache serves")
    analyze.add_argument("logs", nargs="+", metavar="LOG", help="JSON Lines request log(s)")
    analyze.add_argument("--json", metavar="OUT", help="write the full report as JSON")
    analyze.add_argument("--capacity", type=_capacity, default=DEFAULT_CAPACITY,
                         help=f"replay cache budget in tokens per index, or 'none' "
                              f"(default {DEFAULT_CAPACITY:,})")
    analyze.add_argument("--strict", action="store_true", help="fail on the first malformed line")
    analyze.set_defaults(func=cmd_analyze)

    workload = sub.add_parser("workload", help="write a partition-shift workload log")
    workload.add_argument("pattern", choices=PATTERNS)
    workload.add_argument("--out", required=True, metavar="LOG", help=".jsonl[.gz|.xz] to write")
    workload.add_argument("--source", action="append", metavar="LOG",
                          help="real log to take bodies from (first) and text from (all); "
                               "default: the shipped samples")
    _workload_options(workload)
    workload.set_defaults(func=cmd_workload)

    demo = sub.add_parser("demo", help="build the workloads and analyze them with the samples")
    demo.add_argument("--out", metavar="DIR", help="where to write the workloads")
    demo.add_argument("--json", metavar="OUT", help="write all reports as JSON")
    demo.add_argument("--capacity", type=_capacity, default=DEFAULT_CAPACITY)
    _workload_options(demo)
    demo.set_defaults(func=cmd_demo)
    return parser


def _workload_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=80, help="requests to write (default 80)")
    parser.add_argument("--header-tokens", type=int, default=250,
                        help="agent_meta header length / sysvar variable depth in tokens "
                             "(default 250; demo sweeps 50, 250, 1000, 2000)")
    parser.add_argument("--markers", action="store_true", help="insert S2 boundary markers")
    parser.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (LogError, FileNotFoundError, ValueError) as err:
        print(f"irminsul: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
