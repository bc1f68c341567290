"""Replicas behind the router against one engine: prompt tokens served from cache, and TTFT.

For each workload (``irminsul bench serve``'s sessions, replayed by its load generator) this
starts, one setup after another and each from empty caches:

    one engine        one ``irminsul serve`` (all the machine's threads): the reference
    content + store   N replicas sharing a Redis store, behind ``irminsul router`` (content)
    content           N replicas, no store, the router routing by content
    prefix-only       N replicas, no store, the router scoring by exact prefix only
    round-robin       N replicas, no store, the router sending each request to the next one
    round-robin + store

and reports the share of prompt tokens served from cache (exact prefix, PIC, and of PIC what
replicas fetched from the store), that share against the one engine's, and TTFT p50/p99. Each
replica runs one torch thread. ``--out`` writes every figure as JSON (docs/results/
cpu-replicas.json; benchmarks/report.py renders it into docs/performance.md).

    python benchmarks/cpu/replicas.py --out docs/results/cpu-replicas.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path

import httpx

from irminsul import __version__
from irminsul.analysis.report import table
from irminsul.loadgen import Load, build_sessions, load_workload
from irminsul.loadgen.bench import replay_mode
from irminsul.loadgen.server import free_port, spawn_server
from irminsul.model.default import default_model_dir
from irminsul.traffic.render import ChatRenderer

SETUPS = {  # name: (router policy or None for one engine, shared store)
    "one engine": (None, False),
    "content + store": ("content", True),
    "content": ("content", False),
    "prefix-only": ("prefix", False),
    "round-robin": ("round_robin", False),
    "round-robin + store": ("round_robin", True),
}
SERVE = ["--pic", "live", "--no-gate", "--dtype", "float32", "--device", "cpu"]


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """A redis-server on a free loopback port, capped, without persistence."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--maxmemory", "2gb", "--maxmemory-policy",
                                "allkeys-lru", "--dir", str(workdir)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(lambda: _redis_up(port), process, "redis-server")
        yield f"redis://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


def _redis_up(port: int) -> bool:
    import redis

    try:
        return bool(redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping())
    except redis.ConnectionError:
        return False


def _wait(ready, process: subprocess.Popen, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start")
        time.sleep(0.1)


@contextlib.contextmanager
def router(backends: Sequence[str], policy: str, log: Path) -> Iterator[str]:
    """``irminsul router`` as a subprocess over ``backends``."""
    port = free_port()
    args = [sys.executable, "-m", "irminsul.cli", "router", "--port", str(port), "--policy",
            policy]
    for url in backends:
        args += ["--backend", url]
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)

    def healthy() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        return False

    try:
        _wait(healthy, process, "irminsul router")
        yield url
    finally:
        process.terminate()
        process.wait(30)


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def run_setup(name: str, sessions: list, load: Load, replicas: int, tmp: Path) -> dict:
    """One setup's replay: its summary, and the tokens replicas fetched from the store."""
    policy, shared = SETUPS[name]
    count = 1 if policy is None else replicas
    threads = str(os.cpu_count() or 1) if policy is None else "1"
    os.environ["OMP_NUM_THREADS"] = threads  # inherited by the servers spawned below
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(redis_server(tmp)) if shared else None
        urls = [stack.enter_context(spawn_server(
            SERVE + (["--store", store] if store else []), tmp / f"serve-{i}.log")).url
            for i in range(count)]
        url = urls[0] if policy is None else stack.enter_context(
            router(urls, policy, tmp / "router.log"))
        report = replay_mode(sessions, load, label=name, url=url)
        store_hits = sum(_metric(u, "irminsul:store_hit_tokens_total") for u in urls)
    s = report["summary"]
    prompt = s["prompt_tokens"]
    return {"setup": name, "replicas": count, "policy": policy, "store": shared,
            "torch_threads": int(threads), "calls": s["calls"],
            "failed_calls": s["failed_calls"], "prompt_tokens": prompt,
            "prefix_tokens": s["prefix_cached_tokens"], "pic_tokens": s["pic_cached_tokens"],
            "store_tokens": int(store_hits), "cached_tokens": s["cached_tokens"],
            "cached_share": s["cached_tokens"] / prompt if prompt else None,
            "ttft_ms": s["ttft_ms"], "wall_s": s["wall_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["agent_meta", "rerank", "append_only"])
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--max-reply-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    if "one engine" not in args.setups:
        args.setups.insert(0, "one engine")  # the reference every share is measured against
    renderer = ChatRenderer.from_dir(default_model_dir())
    load = Load(concurrency=args.concurrency, warmup=2)
    results = []
    for workload in args.workloads:
        sessions = build_sessions(load_workload(workload, renderer, sessions=args.sessions),
                                  renderer, sessions=args.sessions, calls=args.calls,
                                  max_reply=args.max_reply_tokens)
        rows = []
        for name in args.setups:
            with tempfile.TemporaryDirectory(prefix="irminsul-replicas-") as tmp:
                row = {"workload": workload, **run_setup(name, sessions, load, args.replicas,
                                                         Path(tmp))}
            rows.append(row)
            print(f"{workload} {name}: {row['cached_share']:.1%} from cache, TTFT p50 "
                  f"{row['ttft_ms']['p50']:.0f} ms", file=sys.stderr)
        reference = rows[0]["cached_tokens"]
        for row in rows:
            row["vs_one_engine"] = row["cached_tokens"] / reference if reference else None
        results += rows
    header = ["workload", "setup", "replicas", "prompt tok", "prefix", "PIC", "of it store",
              "from cache", "vs one engine", "TTFT p50 ms", "TTFT p99 ms", "failed"]
    print(table("Prompt tokens served from cache and TTFT: replicas behind the router against "
                "one engine", header,
                [[r["workload"], r["setup"], r["replicas"], f"{r['prompt_tokens']:,}",
                  f"{r['prefix_tokens'] / r['prompt_tokens']:.1%}",
                  f"{r['pic_tokens'] / r['prompt_tokens']:.1%}",
                  f"{r['store_tokens'] / r['prompt_tokens']:.1%}",
                  f"{r['cached_share']:.1%}", f"{r['vs_one_engine']:.1%}",
                  f"{r['ttft_ms']['p50']:.0f}", f"{r['ttft_ms']['p99']:.0f}",
                  r["failed_calls"]] for r in results]))
    if args.out:
        import torch

        meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "device": "cpu", "torch": torch.__version__, "irminsul": __version__,
                "python": platform.python_version(),
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                "command": "python benchmarks/cpu/replicas.py " + " ".join(sys.argv[1:])}
        payload = {"meta": meta, "replicas": args.replicas, "sessions": args.sessions,
                   "calls": args.calls, "concurrency": args.concurrency,
                   "max_reply_tokens": args.max_reply_tokens, "rows": results}
        args.out.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
