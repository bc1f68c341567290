"""The ``irminsul`` command line: analyze request logs, build workloads, run the demo, and run a
model (the embedded default unless ``--model DIR``) over workloads or behind an HTTP API."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from . import __version__
from .analysis.analyze import analyze_log
from .analysis.report import render_reports
from .config import (
    MAX_DEFAULT_SLOTS,
    MODES,
    REPLAY_CAPACITY,
    ROUTING_POLICIES,
    CacheConfig,
    EngineConfig,
    GateConfig,
    ParallelConfig,
    RouterConfig,
    ServerConfig,
    StoreConfig,
)
from .traffic.logs import LogError, read_requests, sample_logs, write_requests
from .traffic.render import ChatRenderer
from .traffic.workloads import PATTERNS, TextPool, build_workload

# the defaults --help shows
ENGINE, SERVER, GATE, PARALLEL = EngineConfig(), ServerConfig(), GateConfig(), ParallelConfig()
ROUTER = RouterConfig()
DEMO_HEADERS = (50, 250, 1000, 2000)
# Without --workload, bench and consistency run on this pattern built from the shipped samples:
# the partition shift where position-independent reuse pays, sized to take about a minute on two
# CPU cores with the default model.
DEFAULT_WORKLOAD, DEFAULT_HEADER_TOKENS, DEFAULT_REQUESTS = "agent_meta", 250, 12


def _renderer(args: argparse.Namespace) -> ChatRenderer:
    return ChatRenderer.from_dir(args.tokenizer) if args.tokenizer else ChatRenderer.default()


def _capacity(text: str) -> int | None:
    return None if text == "none" else int(text)


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


def _write_json(path: str | None, reports: list[dict]) -> None:
    if path:
        payload = reports[0] if len(reports) == 1 else {"logs": reports}
        Path(path).write_text(json.dumps(payload, indent=1), encoding="utf-8")


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
    _write_json(args.json, reports)
    if args.html:
        from .analysis.html import render_html  # matplotlib: only when a page is asked for

        Path(args.html).write_text(render_html(reports), encoding="utf-8")


def _pool(renderer: ChatRenderer, sources: list[Path]) -> TextPool:
    texts = [m["content"] for src in sources for r in read_requests(src) for m in r.messages
             if isinstance(m.get("content"), str) and m["role"] in ("user", "tool")]
    return TextPool(texts, renderer)


def _write_workload(pattern: str, out: Path, source: Path, pool: TextPool, *, requests: int,
                    header_tokens: int, markers: bool = False, seed: int = 0) -> int:
    bodies = list(read_requests(source, strict=True))
    return write_requests(out, build_workload(pattern, bodies, pool, requests=requests,
                                              header_tokens=header_tokens, markers=markers,
                                              seed=seed))


def cmd_workload(args: argparse.Namespace) -> None:
    """Write one partition-shift workload log built from real agent text."""
    renderer = _renderer(args)
    sources = [Path(s) for s in args.source] if args.source else sample_logs()
    count = _write_workload(args.pattern, Path(args.out), sources[0], _pool(renderer, sources),
                            requests=args.requests, header_tokens=args.header_tokens,
                            markers=args.markers, seed=args.seed)
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
        tag = "+s2" if markers else ""
        shape = {"requests": args.requests, "markers": markers, "seed": args.seed}
        for pattern in ("agent_meta", "sysvar"):  # the paper's Figure 4 sweeps
            for header in DEMO_HEADERS:
                path = out / f"{pattern}-h{header}{tag}.jsonl"
                _write_workload(pattern, path, samples[0], pool, header_tokens=header, **shape)
                logs.append((f"{pattern} H={header}{tag}", path))
        for pattern in PATTERNS[2:]:
            path = out / f"{pattern}{tag}.jsonl"
            _write_workload(pattern, path, samples[0], pool, header_tokens=args.header_tokens,
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
    _write_json(args.json, reports)


def _model_dir(args: argparse.Namespace) -> Path:
    """--model (a directory or a Hub repo id), or the embedded default model."""
    # The model package (and torch with it) is imported only by the commands that run a model.
    from .model import default_model_dir
    from .model.hub import resolve_model

    model = getattr(args, "model", None)  # serve leaves it out of --help's defaults
    return resolve_model(model) if model else default_model_dir()


@contextlib.contextmanager
def _workloads(args: argparse.Namespace, renderer: ChatRenderer) -> Iterator[list[Path]]:
    """The --workload logs; without any, DEFAULT_WORKLOAD built from the shipped samples with the
    model's tokenizer (header lengths count its tokens) into a temporary file."""
    if args.workload:
        yield [Path(p) for p in args.workload]
        return
    samples = sample_logs()
    requests = args.requests or DEFAULT_REQUESTS
    with tempfile.TemporaryDirectory(prefix="irminsul-") as tmp:
        path = Path(tmp) / f"{DEFAULT_WORKLOAD}.jsonl"
        _write_workload(DEFAULT_WORKLOAD, path, samples[0], _pool(renderer, samples),
                        requests=requests, header_tokens=DEFAULT_HEADER_TOKENS)
        print(f"workload: {DEFAULT_WORKLOAD}, {requests} requests with {DEFAULT_HEADER_TOKENS}-token "
              f"headers, built from the shipped {samples[0].name.split('.')[0]} sample "
              "(--workload LOG to use another)")
        yield [path]


def cmd_consistency(args: argparse.Namespace) -> None:
    """Output consistency of PIC and naive reuse against full recomputation on a request log."""
    from itertools import islice

    # torch and the model runtime load only here, so the other commands start fast without them.
    import torch

    from .analysis.consistency import consistency, render_consistency
    from .engine import PoolExhausted
    from .model import load_model

    renderer = _model_renderer(args)
    model = load_model(_model_dir(args), dtype=getattr(torch, args.dtype), device=args.device)
    with _workloads(args, renderer) as (log,):
        requests = islice(read_requests(log), args.requests)
        try:
            report = consistency(model, renderer, requests, tokens=args.tokens,
                                 num_slots=args.slots, progress=not args.quiet)
        except PoolExhausted as err:
            raise ValueError(f"{err}; give the engines more --slots") from err
    print(render_consistency(report))
    _write_json(args.json, [report])


def cmd_study(args: argparse.Namespace) -> None:
    """Run one of the paper's studies; print its key figures, write <study>.json and .png."""
    import torch

    from .studies.run import run_study

    options = {"roc": {"blocks": args.blocks, "seed": args.seed},
               "sink": {"samples": args.samples, "reuse_samples": args.reuse_samples,
                        "seed": args.seed},
               "consistency": {"requests": args.requests, "tokens": args.tokens,
                               "seed": args.seed},
               "hijack": {"documents": args.documents, "tokens": args.tokens,
                          "seed": args.seed}}[args.study]
    out = Path(args.out)
    text, _ = run_study(args.study, _model_dir(args), out, options=options,
                        dtype=getattr(torch, args.dtype), device=args.device,
                        progress=not args.quiet)
    print(text)
    print(f"wrote {out / (args.study + '.json')} and {out / (args.study + '.png')}")


def cmd_gate(args: argparse.Namespace) -> int:
    """The PIC correctness gate on a checkpoint: exit status 0 if it passes, 1 if refused."""
    if args.tokenizer:
        # The gate measures the checkpoint on its own tokens, as the server renders them.
        raise ValueError("gate renders the probes with the model directory's tokenizer and chat "
                         "template; --tokenizer does not apply to it")
    import torch

    from .model import load_model
    from .quality import checkpoint_hash, run_gate
    from .quality.report import render_gate

    model_dir = _model_dir(args)
    renderer = _model_renderer(args)
    model = load_model(model_dir, dtype=getattr(torch, args.dtype), device=args.device)
    config = GateConfig(tokens=args.tokens, cache_dir=args.cache_dir)
    # Repair changes what is served, so the gate measures the engine as it would serve: the
    # measurement is cached per setting (the planner config is part of the key).
    engine = dataclasses.replace(ENGINE, cache=_repair_cache(args))
    result = run_gate(model, renderer, checkpoint_hash(model_dir), config, engine=engine,
                      fresh=args.fresh)
    print(render_gate(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=1), encoding="utf-8")
    return 0 if result.passed else 1


def _repair_options(parser: argparse.ArgumentParser) -> None:
    """--recompute-head and --recompute-share (CacheConfig's repair knobs), for serve and gate."""
    parser.add_argument("--recompute-head", type=int, default=ENGINE.cache.recompute_head,
                        metavar="K", help="live mode, repair: compute the first K tokens of "
                        "every reused run instead of reusing them (EPIC-style; docs/quality.md "
                        "measures each K; 0: none)")
    parser.add_argument("--recompute-share", type=float, default=ENGINE.cache.recompute_share,
                        metavar="R", help="live mode, repair: compute this share of each "
                        "prompt's reused tokens, those whose latent deviates most from a fresh "
                        "one at an early layer (CacheBlend-style; 0: none)")


def _repair_cache(args: argparse.Namespace) -> CacheConfig:
    """The default planner config with the repair knobs of :func:`_repair_options`."""
    return dataclasses.replace(ENGINE.cache, recompute_head=args.recompute_head,
                               recompute_share=args.recompute_share)


def _model_renderer(args: argparse.Namespace) -> ChatRenderer:
    """The model directory's tokenizer and chat template, unless another directory is named."""
    from .traffic.render import TemplateError

    try:
        return ChatRenderer.from_dir(args.tokenizer or _model_dir(args))
    except (FileNotFoundError, TemplateError) as err:
        raise ValueError(f"{err} (prompts are rendered with the model directory's "
                         "tokenizer.json and chat template; pass --tokenizer DIR to use "
                         "another)") from err


def cmd_bench(args: argparse.Namespace) -> None:
    """Replay workload logs against the engine in each cache mode."""
    import torch

    from .analysis.bench import bench
    from .analysis.report import table
    from .model import load_model
    from .traffic.prompt import render_prompt

    renderer = _model_renderer(args)
    model = load_model(_model_dir(args), dtype=getattr(torch, args.dtype), device=args.device)
    reports, rows, sizes = [], [], []
    with _workloads(args, renderer) as logs:
        prompts_per_log = [[render_prompt(renderer, r.messages, r.tools, session=r.session)
                            for r in read_requests(log)][: args.requests] for log in logs]
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
    _write_json(args.json, reports)


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
    from .loadgen import Load, ServerError, bench_serve, build_sessions, load_workload, render

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
    serve_args = None if args.url else _serve_args(args)
    # Reply lengths count the served model's tokens: its own tokenizer, or the embedded model's
    # (what --random-weights serves with, and what a --url server is taken to use).
    renderer = ChatRenderer.from_dir(args.tokenizer or _model_dir(args))
    load = Load(concurrency=args.concurrency if args.concurrency or args.session_rate else 4,
                rate=args.session_rate, seed=args.seed, warmup=args.warmup)
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


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the model over an OpenAI-compatible HTTP API until interrupted."""
    if args.tokenizer:
        # The server renders with the checkpoint's own tokenizer and template; taking the option
        # and ignoring it would serve different prompts from the ones asked for.
        raise ValueError("serve renders prompts with the model directory's tokenizer and chat "
                         "template; --tokenizer does not apply to it")
    from .server import serve  # torch, the model runtime and the web stack load only here

    # benchmark-only, and then only: the plain path calls serve as it always has
    random_weights = {"random_weights": args.random_weights} if "random_weights" in args else {}
    if random_weights and getattr(args, "model", None):
        raise ValueError("--random-weights serves random weights with the embedded model's "
                         "tokenizer; it does not take --model")
    audit = getattr(args, "pic_audit_rate", ENGINE.pic_audit_rate)
    engine = EngineConfig(mode=args.pic, slots=args.slots, kr_slots=args.kr_slots,
                          batch_tokens=args.batch_tokens, chunk_tokens=args.chunk_tokens,
                          max_running=args.max_running, await_shared=args.await_shared,
                          pic_audit_rate=audit,
                          graphs=False if args.no_graphs else ENGINE.graphs,
                          cache=_repair_cache(args))
    server = ServerConfig(host=args.host, port=args.port, model_name=args.served_model_name,
                          dtype=args.dtype, device=args.device, keep_fp8=args.keep_fp8,
                          engine=engine, max_request_bytes=args.max_request_bytes,
                          max_waiting=args.max_waiting, kv_memory=args.kv_memory,
                          gate=None if args.no_gate else SERVER.gate,
                          warmup=args.warmup,
                          store=StoreConfig(url=args.store,
                                            prefill_tokens_per_second=args.store_prefill_rate,
                                            model_id=args.store_model_id))
    parallel = ParallelConfig(world_size=args.tensor_parallel,
                              timeout_s=args.collective_timeout)
    return serve(_model_dir(args), server, parallel=parallel, **random_weights)


def _ranks(text: str) -> int:
    """--tensor-parallel: a whole number of ranks, at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of ranks, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (1: one process, no parallelism), got "
                                         f"{value}")
    return value


def cmd_router(args: argparse.Namespace) -> None:
    """Route OpenAI requests to the irminsul serve backend that holds most of their tokens."""
    if args.tokenizer:
        raise ValueError("the router renders prompts as the backends do, with the model "
                         "directory's tokenizer and chat template (--model); --tokenizer does "
                         "not apply to it")
    from .router.app import serve_router  # the web stack loads only here

    config = RouterConfig(backends=tuple(args.backend), host=args.host, port=args.port,
                          policy=args.policy, poll_interval_s=args.poll_interval,
                          queue_weight=args.queue_weight, kv_weight=args.kv_weight,
                          tie_margin=args.tie_margin)
    serve_router(config, _model_dir(args))


TOKENIZER_HELP = ("tokenizer directory: a local Hugging Face tokenizer.json with a chat template "
                  "(default: the model's own for bench and consistency, which run a model; else "
                  "the DeepSeek tokenizer with a DeepSeek-V3-style template). serve always uses "
                  "the model's own")


def _global_options(parser: argparse.ArgumentParser, *, top: bool, tokenizer: bool = True) -> None:
    """The options the commands share, taken before or after the command's name alike.

    The top-level parser holds the defaults; each command's parser adds the same options with
    ``SUPPRESS`` defaults, so an option given after the command overrides one given before it,
    and one not given after it leaves the top-level value in place.
    """
    def default(value: object) -> object:
        return value if top else argparse.SUPPRESS

    if tokenizer:
        parser.add_argument("--tokenizer", metavar="DIR", default=default(None),
                            help=TOKENIZER_HELP)
    parser.add_argument("-q", "--quiet", action="store_true", default=default(False),
                        help="no progress bars")


def _command(sub: argparse._SubParsersAction, name: str, summary: str, *, tokenizer: bool = True,
             **kwargs: object) -> argparse.ArgumentParser:
    """A command's parser with the global options (``tokenizer``: --tokenizer among them);
    ``summary`` is its line in --help."""
    parser = sub.add_parser(name, help=summary, description=summary, **kwargs)
    _global_options(parser, top=False, tokenizer=tokenizer)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The ``irminsul`` argument parser: global options and one subparser per command."""
    parser = argparse.ArgumentParser(prog="irminsul", description=__doc__)
    parser.add_argument("--version", action="version", version=f"irminsul {__version__}",
                        help="print the version and exit")
    _global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do; irminsul COMMAND --help for its options")

    analyze = _command(sub, "analyze", "how much of a request log each cache serves")
    analyze.add_argument("logs", nargs="+", metavar="LOG", help="JSON Lines request log(s)")
    analyze.add_argument("--json", metavar="OUT", help="write the full report as JSON")
    analyze.add_argument("--html", metavar="OUT",
                         help="write a self-contained page of charts and a summary per log")
    _capacity_option(analyze)
    analyze.add_argument("--strict", action="store_true", help="fail on the first malformed line")
    analyze.set_defaults(func=cmd_analyze)

    workload = _command(sub, "workload", "write a partition-shift workload log")
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

    demo = _command(sub, "demo", "build the workloads and analyze them with the samples")
    demo.add_argument("--out", metavar="DIR",
                      help="where to write the workloads (default: a new temporary directory)")
    demo.add_argument("--json", metavar="OUT", help="write all reports as JSON")
    _capacity_option(demo)
    _workload_options(demo)
    demo.set_defaults(func=cmd_demo)

    check = _command(sub, "consistency",
                     "KL, argmax-match and first divergence of PIC and naive reuse against full "
                     "recomputation")
    _model_workload_options(check, many=False)
    check.add_argument("--tokens", type=int, default=16,
                       help="continuation tokens per request (default 16)")
    check.set_defaults(func=cmd_consistency)

    gate = _command(sub, "gate", "the PIC correctness gate: KL and argmax of PIC and naive reuse "
                                 "against full recomputation on the shipped probes; exit 0 pass, "
                                 "1 refused", tokenizer=False)
    gate.add_argument("--json", metavar="OUT", help="write the result as JSON")
    gate.add_argument("--tokens", type=int, default=GATE.tokens,
                      help=f"continuation tokens per probe (default {GATE.tokens})")
    gate.add_argument("--fresh", action="store_true",
                      help="measure again even if the result cache holds this checkpoint")
    gate.add_argument("--cache-dir", metavar="DIR", default=GATE.cache_dir,
                      help="where results are cached per checkpoint hash (default "
                           "$XDG_CACHE_HOME/irminsul/gate, else ~/.cache/irminsul/gate)")
    _repair_options(gate)
    _run_model_options(gate)
    gate.set_defaults(func=cmd_gate)

    study = _command(sub, "study", "the paper's studies on a model: position-invariance AUC "
                                   "(roc), attention sink and carve-out (sink), output "
                                   "consistency over the five workloads (consistency), KV "
                                   "hijacking by a document registered behind an injection (hijack)")
    study.add_argument("study", choices=("roc", "sink", "consistency", "hijack"),
                       help="roc: AUC of c_KV, k_r and the row per layer (§5); sink: W and S "
                            "by chunk position and tail mass to [0, 32) under PIC, naive and "
                            "fresh (§7.1); consistency: Table 2 over the five workloads; "
                            "hijack: a clean prompt served a document registered behind an "
                            "adversarial preamble, with and without cache_salt and repair")
    study.add_argument("--out", default=".", metavar="DIR",
                       help="where to write <study>.json and <study>.png (default: .)")
    study.add_argument("--blocks", type=int, default=None,
                       help="roc: content blocks (default 32; the paper's is 500)")
    study.add_argument("--samples", type=int, default=None,
                       help="sink: chunks per position (default 4; the paper's is 20)")
    study.add_argument("--reuse-samples", type=int, default=None,
                       help="sink: target prompts of the carve-out measurement (default 8)")
    study.add_argument("--requests", type=int, default=None,
                       help="consistency: requests per workload (default 3)")
    study.add_argument("--tokens", type=int, default=None,
                       help="consistency, hijack: continuation tokens per request (default 8; "
                            "hijack 16)")
    study.add_argument("--documents", type=int, default=None,
                       help="hijack: documents, each behind one of three preambles (default 12)")
    study.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    _run_model_options(study)
    study.set_defaults(func=cmd_study)

    bench_p = _command(sub, "bench", "replay workloads against the engine per cache mode; "
                                     "bench serve: against a server over HTTP")
    _model_workload_options(bench_p, many=True)
    bench_p.set_defaults(func=cmd_bench)
    targets = bench_p.add_subparsers(dest="target", metavar="[serve]",
                                     help="serve: replay agent sessions against irminsul serve "
                                          "over HTTP (irminsul bench serve --help); without it, "
                                          "bench replays against the engine in-process")
    _bench_serve_options(_command(targets, "serve", "replay agent sessions over HTTP against "
                                  "irminsul serve per PIC mode (off, live) or a running server: "
                                  "TTFT, TPOT, latency, session time, throughput, cache shares"))

    _router_options(_command(sub, "router", "an OpenAI-compatible proxy that sends each "
                             "request to the irminsul serve backend holding most of its tokens",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter))

    serve = _command(sub, "serve", "serve a model over an OpenAI-compatible HTTP API",
                     tokenizer=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("--model", metavar="DIR|REPO", default=argparse.SUPPRESS,
                       help="Hugging Face checkpoint directory (config.json, safetensors, "
                            "tokenizer.json and a chat template) or Hub repo id[@revision], "
                            "fetched into the Hugging Face cache unless HF_HUB_OFFLINE is set "
                            "(default: the embedded default model)")
    serve.add_argument("--random-weights", metavar="CONFIG_JSON", default=argparse.SUPPRESS,
                       help="benchmark-only, instead of --model: random weights of this "
                            "config.json's shapes made on the device, with the embedded model's "
                            "tokenizer and chat template (its 8,192 ids must fit the config's "
                            "vocab_size); the output rows past them and of the stop tokens are "
                            "zero, so greedy replies are decodable noise that runs to "
                            "max_tokens; the timing is real")
    serve.add_argument("--host", default=SERVER.host, help="address to listen on")
    serve.add_argument("--port", type=int, default=SERVER.port, help="port to listen on")
    serve.add_argument("--pic", choices=MODES, default=ENGINE.mode,
                       help="position-independent caching: off (exact prefix only), observer "
                            "(record would-be hits), live (serve them)")
    serve.add_argument("--slots", type=int, default=ENGINE.slots,
                       help=f"KV pool size in tokens (default: on CUDA, --kv-memory of the "
                            f"GPU memory the weights leave; else 4x the context, at most "
                            f"{MAX_DEFAULT_SLOTS:,})")
    serve.add_argument("--kv-memory", type=float, default=SERVER.kv_memory, metavar="F",
                       help=f"share of the GPU memory left after the weights that the KV pool "
                            f"takes when --slots is not given (default {SERVER.kv_memory})")
    serve.add_argument("--kr-slots", type=int, default=ENGINE.kr_slots,
                       help="k_r slots (None: as many as --slots): sessions reusing shifted "
                            "content share c_KV rows but each hold their own k_r rows (1/9 of a "
                            "c_KV row's bytes), so more k_r slots hold more of them in the same "
                            "memory")
    serve.add_argument("--batch-tokens", type=int, default=ENGINE.batch_tokens,
                       help="tokens per forward: decode tokens first, then prefill spans")
    serve.add_argument("--chunk-tokens", type=int, default=ENGINE.chunk_tokens,
                       help="prompt tokens one request prefills per forward")
    serve.add_argument("--max-running", type=int, default=ENGINE.max_running,
                       help="requests admitted at once (None: no cap but the KV pool's room "
                            "and --batch-tokens)")
    serve.add_argument("--pic-audit-rate", type=float, default=argparse.SUPPRESS,
                       metavar="R", help=f"live mode: the share of PIC-served requests "
                       f"recomputed from scratch when the engine is idle, their first-token "
                       f"KL exported as irminsul:pic_audit_kl (0: none; default "
                       f"{ENGINE.pic_audit_rate})")
    _repair_options(serve)
    serve.add_argument("--await-shared", type=int, default=ENGINE.await_shared, metavar="N",
                       help="a request that would compute at least N tokens a prefill in flight "
                            "is computing waits for it to land, then reuses them (0: never)")
    serve.add_argument("--tensor-parallel", type=_ranks, default=1, metavar="N",
                       help="ranks: this process serves as rank 0 and starts N-1 more, one per "
                            "GPU (cuda:0 .. N-1 from --device's index; on a CPU, gloo), each "
                            "keeping 1/N of the attention heads, MLP widths and routed experts "
                            "(docs/multi-gpu.md); a rank that fails stops the server")
    serve.add_argument("--collective-timeout", type=float, default=PARALLEL.timeout_s,
                       metavar="S", help="--tensor-parallel: a collective (an all-reduce, the "
                       "leader's message) that waits longer than this for a peer rank fails, "
                       "and the server stops with an error naming the rank, instead of hanging")
    serve.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                       default=SERVER.dtype,
                       help="weights and KV (auto: bfloat16 on CUDA, else float32)")
    serve.add_argument("--device", default=SERVER.device,
                       help="torch device (None: cuda when available, else cpu)")
    serve.add_argument("--keep-fp8", action="store_true",
                       help="keep an FP8 checkpoint's weights float8 with their block scales "
                            "(linears and routed experts; half of bf16's memory) instead of "
                            "dequantizing them at load")
    serve.add_argument("--served-model-name", default=SERVER.model_name, metavar="NAME",
                       help="the model name clients send (None: the directory's name)")
    serve.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=SERVER.warmup,
                       help="before listening, run a few synthetic requests through the engine "
                            "(kernels compiled, attention planned for long prompts, PIC and "
                            "sampling), then empty its cache (None: on CUDA only)")
    serve.add_argument("--no-graphs", action="store_true",
                       help="run every forward eagerly (else on CUDA: replay CUDA graphs for "
                            "decode steps, short spans and prefill chunks of up to 2K tokens, "
                            "bfloat16 models)")
    serve.add_argument("--max-request-bytes", type=int, default=SERVER.max_request_bytes,
                       metavar="N", help="refuse larger request bodies (413) before reading "
                                         "them whole (None: 1 MiB + 32 bytes per token of "
                                         "context)")
    serve.add_argument("--max-waiting", type=int, default=SERVER.max_waiting, metavar="N",
                       help="requests waiting for their first token beyond --max-running; "
                            "more get 429 with Retry-After")
    serve.add_argument("--no-gate", action="store_true",
                       help="serve live PIC without the correctness gate (by default a live "
                            "server first runs irminsul gate on the checkpoint, cached per "
                            "checkpoint, and serves exact prefixes only if it refuses); logged "
                            "as a warning")
    serve.add_argument("--store", default=SERVER.store.url, metavar="URL",
                       help="a content store shared with other engines, redis://HOST:PORT "
                            "(Redis or Valkey): registered chunks are published to it, and "
                            "missed ones fetched from it when that beats prefilling them "
                            "(docs/scale-out.md)")
    serve.add_argument("--store-prefill-rate", type=float,
                       default=SERVER.store.prefill_tokens_per_second, metavar="TOKENS_PER_S",
                       help="the store's cost model: this engine's prefill rate, against which "
                            "a fetch's bytes over the measured link bandwidth are weighed")
    serve.add_argument("--store-model-id", default=SERVER.store.model_id, metavar="NAME",
                       help="the model's name in the store's keys: engines share values only "
                            "under the same one (default: a hash of the config, the KV dtype "
                            "and a sample of the weights this process holds, which under "
                            "--tensor-parallel is rank 0's share)")
    serve.set_defaults(func=cmd_serve)
    return parser


def _router_options(parser: argparse.ArgumentParser) -> None:
    """Options of irminsul router."""
    parser.add_argument("--backend", action="append", required=True, metavar="URL",
                        help="an irminsul serve backend, http://HOST:PORT; once per backend")
    parser.add_argument("--model", metavar="DIR|REPO", default=argparse.SUPPRESS,
                        help="the backends' checkpoint directory or Hub repo id, for its "
                             "tokenizer and chat template (default: the embedded default model)")
    parser.add_argument("--host", default=ROUTER.host, help="address to listen on")
    parser.add_argument("--port", type=int, default=ROUTER.port, help="port to listen on")
    parser.add_argument("--policy", choices=ROUTING_POLICIES, default=ROUTER.policy,
                        help="content: the exact prefix, then content-defined chunks; prefix: "
                             "the exact prefix only; round_robin: each backend in turn")
    parser.add_argument("--poll-interval", type=float, default=ROUTER.poll_interval_s,
                        metavar="S", help="seconds between polls of each backend's index")
    parser.add_argument("--queue-weight", type=float, default=ROUTER.queue_weight,
                        metavar="W", help="score: cost of each request in flight on a backend, "
                                          "in shares of the prompt served from cache")
    parser.add_argument("--kv-weight", type=float, default=ROUTER.kv_weight, metavar="W",
                        help="score: cost of a backend's full KV pool, in shares of the prompt")
    parser.add_argument("--tie-margin", type=float, default=ROUTER.tie_margin, metavar="M",
                        help="scores this close to the best tie (then the session's last "
                             "backend, else a hash of the session or prompt, wins)")
    parser.set_defaults(func=cmd_router)


def _run_model_options(parser: argparse.ArgumentParser) -> None:
    """The model a measuring command (gate, study) runs, and where."""
    parser.add_argument("--model", metavar="DIR|REPO",
                        help="Hugging Face checkpoint directory or Hub repo id[@revision] "
                             "(default: the embedded default model)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="torch device to run the model on (default cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights and KV (default float32)")


def _model_workload_options(parser: argparse.ArgumentParser, *, many: bool) -> None:
    """Options of the commands that run a model over a workload log."""
    parser.add_argument("--model", metavar="DIR|REPO",
                        help="Hugging Face checkpoint directory (config.json + safetensors) or "
                             "Hub repo id[@revision] (default: the embedded default model)")
    # nargs=1 for a single log keeps args.workload a list either way.
    parser.add_argument("--workload", nargs="+" if many else 1, metavar="LOG",
                        help="JSON Lines request log" + ("(s)" if many else "") +
                             f" (default: {DEFAULT_WORKLOAD} built from the shipped samples)")
    parser.add_argument("--json", metavar="OUT", help="write the report as JSON")
    parser.add_argument("--requests", type=int, default=None,
                        help="first N requests of the log (default: all; the default workload "
                             f"has {DEFAULT_REQUESTS})")
    parser.add_argument("--slots", type=int, default=None,
                        help="KV pool size per engine in tokens (default: the whole workload, "
                             "so nothing is evicted)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="torch device to run the model on (default cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights and KV (default float32)")


def _bench_serve_options(parser: argparse.ArgumentParser) -> None:
    """Options of bench serve."""
    from .traffic.workloads import PATTERNS

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


def _capacity_option(parser: argparse.ArgumentParser) -> None:
    """--capacity of the commands that replay logs through the cache."""
    parser.add_argument("--capacity", type=_capacity, default=REPLAY_CAPACITY, metavar="N|none",
                        help=f"replay cache budget in tokens per index, or 'none' "
                             f"(default {REPLAY_CAPACITY:,})")


def _workload_options(parser: argparse.ArgumentParser) -> None:
    """Options of the commands that build workloads."""
    parser.add_argument("--requests", type=int, default=80, help="requests to write (default 80)")
    parser.add_argument("--header-tokens", type=int, default=250,
                        help="agent_meta header length / sysvar variable depth in tokens "
                             "(default 250; demo sweeps 50, 250, 1000, 2000)")
    parser.add_argument("--markers", action="store_true", help="insert S2 boundary markers")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed of the workload's variations (default 0)")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for bad input, as argparse does)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)  # None, or a command's own status (gate: 1 when refused)
    except (LogError, FileNotFoundError, ValueError) as err:
        print(f"irminsul: error: {err}", file=sys.stderr)
        return 2
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
