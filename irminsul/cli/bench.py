"""The benchmarks: bench (workload logs replayed against the engine in-process per cache mode)
and bench serve (agent sessions replayed over HTTP against irminsul serve)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import MODES
from ..traffic.logs import read_requests
from ..traffic.render import ChatRenderer
from .common import (
    add_command,
    built_workloads,
    model_dir_of,
    model_renderer,
    model_workload_options,
    write_json,
)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _count(text: str) -> int | None:
    """A positive count, or ``all`` (None)."""
    if text == "all":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1 or 'all', got {text}")
    return value


def cmd_bench(args: argparse.Namespace) -> None:
    """Replay workload logs against the engine in each cache mode."""
    import torch

    from ..analysis.bench import bench
    from ..analysis.report import table
    from ..model import load_model
    from ..traffic.prompt import render_prompt

    renderer = model_renderer(args)
    model = load_model(model_dir_of(args), dtype=getattr(torch, args.dtype), device=args.device)
    reports, rows, sizes = [], [], []
    with built_workloads(args, renderer) as logs:
        prompts_per_log = [[render_prompt(renderer, r.messages, r.tools, session=r.session)
                            for r in read_requests(log)][: args.requests] for log in logs]
    for log, prompts in zip(logs, prompts_per_log):
        if not prompts:  # before any replay: a damaged log is not found after an hour's run
            raise ValueError(f"{log}: no requests to replay")
    for log, prompts in zip(logs, prompts_per_log):
        slots = args.slots or sum(p.size for p in prompts) + 1
        report = {"log": str(log), **bench(model, prompts, num_slots=slots,
                                           progress=not args.quiet)}
        reports.append(report)
        sizes.append(f"{Path(log).name}: {report['requests']} requests, "
                     f"{report['prompt_tokens']:,} prompt tokens; KV pool {slots:,} tokens "
                     "per engine")
        for mode in ("off", "observer", "live"):
            r = report[mode]
            rows.append([Path(log).name, mode, f"{100 * r['exact_prefix']:.1f}%",
                         f"{100 * r['pic_unique']:.1f}%", f"{100 * r['total']:.1f}%",
                         f"{r['ttft_p50_ms']:.1f}", f"{r['ttft_p95_ms']:.1f}",
                         f"{r['kl_first_token']:.2e}"])
    print("\n".join(sizes))
    # Every figure names its unit: % of the prompt tokens, ms, nats (KL uses natural logs).
    print(table("Engine replay per cache mode: % of prompt tokens served by the exact prefix and "
                "by PIC (observer: would-be PIC, served by prefill), time to first token, KL of "
                "the first-token distribution from full recomputation",
                ["workload", "mode", "exact-prefix", "PIC", "total", "TTFT p50 (ms)",
                 "TTFT p95 (ms)", "KL vs full (nats)"], rows))
    write_json(args.json, reports)


SERVER_START_OPTIONS = ("model", "random_weights", "device", "dtype", "slots", "server_args")


def _serve_args(args: argparse.Namespace) -> list[str]:
    """The irminsul serve options of the servers bench serve starts (it adds --pic, --host and
    --port itself)."""
    import shlex

    if args.model and args.random_weights:
        raise ValueError("--random-weights serves the embedded model's tokenizer; it does not "
                         "take --model")
    serve_args = (["--model", args.model] if args.model else
                  ["--random-weights", args.random_weights] if args.random_weights else [])
    for name in ("device", "dtype", "slots"):
        if getattr(args, name) is not None:
            serve_args += [f"--{name}", str(getattr(args, name))]
    extra = shlex.split(args.server_args or "")
    taken = sorted({a.split("=")[0] for a in extra} & {"--pic", "--host", "--port"})
    if taken:
        raise ValueError(f"--server-args: bench serve sets {', '.join(taken)} itself")
    return serve_args + extra


def _warn_failed_calls(report: dict) -> None:
    """Say on stderr how many calls of each replay failed and why the first did; a replay
    where none succeeded is an error."""
    for mode, run in report["modes"].items():
        failed = [c for c in run["calls"] if c["error"]]
        if len(failed) == len(run["calls"]):
            raise ValueError(f"{report['workload']}, {mode}: every call failed; the first: "
                             f"{failed[0]['error']}")
        if failed:
            print(f"irminsul: warning: {report['workload']}, {mode}: "
                  f"{_plural(len(failed), 'call')} failed (counted in no figure but "
                  f"'calls (failed)'); the first: {failed[0]['error']}", file=sys.stderr)


def cmd_bench_serve(args: argparse.Namespace) -> None:
    """Replay agent sessions over HTTP against irminsul serve per PIC mode, or a running server."""
    from ..loadgen import Load, ServerError, bench_serve, build_sessions, load_workload, render

    if args.url:
        given = [f"--{name.replace('_', '-')}" for name in SERVER_START_OPTIONS
                 if getattr(args, name)]
        if given:
            raise ValueError(f"--url replays against a running server; {', '.join(given)} "
                             "start one (leave out --url for that)")
    if args.reply_tokens < 1 or (args.max_reply_tokens or 1) < 1 or (args.warmup or 0) < 0:
        raise ValueError("--reply-tokens and --max-reply-tokens must be >= 1, --warmup >= 0")
    if args.system_tokens < 0:
        raise ValueError("--system-tokens must be >= 0")
    # Checked here, before a server starts: the runner would refuse them only after each
    # server's start and warm-up, and a concurrency of 0 would become the default 4 unsaid.
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.session_rate is not None and not args.session_rate > 0:
        raise ValueError(f"--session-rate must be > 0, got {args.session_rate}")
    if not args.think_time >= 0:
        raise ValueError(f"--think-time must be >= 0, got {args.think_time}")
    serve_args = None if args.url else _serve_args(args)
    # Reply lengths count the served model's tokens: its own tokenizer, or the embedded model's
    # (what --random-weights serves with, and what a --url server is taken to use).
    renderer = ChatRenderer.from_dir(args.tokenizer or model_dir_of(args))
    load = Load(concurrency=args.concurrency if args.concurrency or args.session_rate else 4,
                rate=args.session_rate, seed=args.seed, warmup=args.warmup,
                think_s=args.think_time)
    reports = []
    for name in args.workload:
        sessions = build_sessions(load_workload(name, renderer, sessions=args.sessions,
                                                system_tokens=args.system_tokens,
                                                seed=args.seed),
                                  renderer, sessions=args.sessions, calls=args.calls,
                                  default_reply=args.reply_tokens,
                                  max_reply=args.max_reply_tokens)
        calls = [c for s in sessions for c in s.calls]
        where = (f"against {args.url}" if args.url else
                 f"a fresh irminsul serve per mode ({', '.join(args.modes)})")
        print(f"{name}: {_plural(len(sessions), 'session')}, {_plural(len(calls), 'call')} "
              f"({sum(c.logged_reply for c in calls)} with the logged reply's length, "
              f"{sum(c.max_tokens for c in calls):,} tokens asked for in all), "
              f"{load.describe()}, {where}")
        try:
            report = bench_serve(name, sessions, load, modes=args.modes, serve_args=serve_args,
                                 url=args.url, progress=not args.quiet)
        except ServerError as err:
            raise ValueError(str(err)) from err
        _warn_failed_calls(report)
        report["replay"] = {"sessions": args.sessions, "calls": args.calls,
                            "system_tokens": args.system_tokens,
                            "reply_tokens": args.reply_tokens,
                            "max_reply_tokens": args.max_reply_tokens,
                            "tokenizer": renderer.name}
        reports.append(report)
    print(render(reports))
    if args.json:
        payload = reports[0] if len(reports) == 1 else {"workloads": reports}
        Path(args.json).write_text(json.dumps(payload, indent=1), encoding="utf-8")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add bench, with bench serve under it, to the ``irminsul`` subparsers ``sub``."""
    bench_p = add_command(sub, "bench", "replay workloads against the engine per cache mode; "
                                     "bench serve: against a server over HTTP")
    model_workload_options(bench_p, many=True)
    bench_p.set_defaults(func=cmd_bench)
    targets = bench_p.add_subparsers(dest="target", metavar="[serve]",
                                     help="serve: replay agent sessions against irminsul serve "
                                          "over HTTP (irminsul bench serve --help); without it, "
                                          "bench replays against the engine in-process")
    _bench_serve_options(add_command(targets, "serve", "replay agent sessions over HTTP against "
                                  "irminsul serve per PIC mode (off, live) or a running server: "
                                  "TTFT, TPOT, latency, session time, throughput, cache shares"))


def _bench_serve_options(parser: argparse.ArgumentParser) -> None:
    """Options of bench serve."""
    from ..traffic.workloads import PATTERNS

    parser.add_argument("--url", metavar="URL",
                        help="replay against this running server (its one mode; what it has "
                             "cached is not reused: the run sends its own cache_salt) instead "
                             "of starting irminsul serve per mode")
    parser.add_argument("--model", metavar="DIR|REPO",
                        help="checkpoint directory or Hub repo id the started servers serve "
                             "(default: the embedded default model)")
    parser.add_argument("--random-weights", metavar="CONFIG_JSON",
                        help="the started servers serve random weights of this config.json's "
                             "shapes (benchmark-only; see irminsul serve --help)")
    parser.add_argument("--workload", nargs="+", default=["agent_meta"], metavar="NAME|LOG",
                        help=f"what to replay, one or more: {', '.join(PATTERNS)} (built from "
                             "the shipped tau-bench sample), append_only (the shipped "
                             "mini-swe-agent sample: PIC has nothing to add), or a JSON Lines "
                             "log (default: agent_meta)")
    parser.add_argument("--sessions", type=_count, default=4, metavar="N|all",
                        help="first N sessions of each workload (default 4)")
    parser.add_argument("--system-tokens", type=int, default=0, metavar="N",
                        help="a built workload's system prompt also carries a shared reference "
                             "block of N tokens of sample text, for agent-sized contexts "
                             "(default 0: none)")
    parser.add_argument("--calls", type=_count, default=4, metavar="N|all",
                        help="first N calls of each session (default 4: a quick run on a CPU)")
    parser.add_argument("--reply-tokens", type=int, default=256, metavar="N",
                        help="max_tokens of a call the log has no reply for (default 256); "
                             "the others ask for the logged reply's length")
    parser.add_argument("--max-reply-tokens", type=int, default=None, metavar="N",
                        help="cap every call's max_tokens (default: no cap)")
    parser.add_argument("--concurrency", type=int, default=None, metavar="N",
                        help="sessions at once (default 4; with --session-rate: a cap, none "
                             "by default)")
    parser.add_argument("--session-rate", type=float, default=None, metavar="R",
                        help="sessions arrive as a Poisson process of R per second instead")
    parser.add_argument("--think-time", type=float, default=0.0, metavar="S",
                        help="seconds a session waits between a reply and its next call, as an "
                             "agent runs its tools (default 0: back to back)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the arrivals and the workload's variations (default 0)")
    parser.add_argument("--warmup", type=int, default=None, metavar="N",
                        help="unmeasured first calls of N sessions, sent at once before each "
                             "replay under a cache salt of their own (default: the concurrency, "
                             "else 4)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["off", "live"],
                        help="PIC modes to start a server in, one after another "
                             "(default: off live)")
    parser.add_argument("--device", default=None,
                        help="the started servers' torch device (default: cuda when "
                             "available, else cpu)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                        default=None, help="the started servers' weights and KV (default auto)")
    parser.add_argument("--slots", type=int, default=None,
                        help="the started servers' KV pool in tokens (default: serve's)")
    parser.add_argument("--server-args", metavar="ARGS",
                        help="more irminsul serve options for the started servers, one string "
                             "(e.g. '--max-running 8 --no-graphs')")
    parser.add_argument("--json", metavar="OUT",
                        help="write every figure and every call's record as JSON")
    parser.set_defaults(func=cmd_bench_serve)
