"""Fetching a document's KV rows from the shared store against prefilling them, on this CPU.

Two engines of the embedded default model (float32) and a redis-server on a free loopback port
(started here, stopped at the end). Engine A serves a source prompt (a 40-token header, then a
document of N tokens) and publishes its chunks; engine B serves a target prompt holding the same
document behind a 75-token header, once from the store and once on an engine without a store
(it prefills the document). Per document size it prints the median over repeats of

    fetch      the store's round trip (one MGET of every missed chunk's value)
    fetched    the whole store path: round trip, checksums, token checks, rows into the pool
    prefill    B's whole prompt computed (no store)
    served     B's whole prompt with the document from the store (the header still computed)
    MB         bytes fetched

    python benchmarks/cpu/store_fetch.py [--tokens 256 1024 4096] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

import numpy as np
import redis
import torch

from irminsul.config import EngineConfig, StoreConfig
from irminsul.engine import Engine
from irminsul.model import load_model
from irminsul.model.default import default_model_dir
from irminsul.store import attach


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    port = free_port()
    server = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port),
                              "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                              "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru",
                              "--dir", tempfile.gettempdir()], stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        run(args, f"redis://127.0.0.1:{port}")
    finally:
        server.kill()
        server.wait()


def run(args: argparse.Namespace, url: str) -> None:
    model = load_model(default_model_dir())
    config = StoreConfig(url=url, timeout_s=5.0)
    rng = np.random.default_rng(0)
    warm = Engine(model, EngineConfig(slots=8192))
    warm.prefill(rng.integers(10, 8192, 512))  # first-forward costs out of the figures
    print(f"{'tokens':>7} {'fetch ms':>9} {'fetched ms':>11} {'prefill ms':>11} "
          f"{'served ms':>10} {'MB':>6}")
    for n in args.tokens:
        rows: dict[str, list[float]] = {k: [] for k in ("fetch", "fetched", "prefill", "served")}
        megabytes = 0.0
        for _ in range(args.repeats):
            doc = rng.integers(10, 8192, n)
            h1, h2 = rng.integers(10, 8192, 40), rng.integers(10, 8192, 75)
            source, target = np.concatenate([h1, doc]), np.concatenate([h2, doc])
            a, b = (Engine(model, EngineConfig(slots=2 * n + 1024)) for _ in range(2))
            sa, sb = attach(a, config), attach(b, config)
            a.prefill(source, [40])
            sa.flush()
            plain = Engine(model, EngineConfig(slots=2 * n + 1024))
            start = time.perf_counter()
            plain.prefill(target, [75])
            rows["prefill"].append(time.perf_counter() - start)
            plan = b.cache.planner.plan(target, [75])
            start = time.perf_counter()
            found = sb.fetch(plan)
            handles = b.pool.alloc(sum(f.tokens.size for f in found))
            sb.write(b.pool, handles, found)
            rows["fetched"].append(time.perf_counter() - start)
            rows["fetch"].append(sb.stats.fetch_sum)
            megabytes = sb.stats.fetched_bytes / 1e6
            b.pool.release(handles)
            b.cache.store = None
            c = Engine(model, EngineConfig(slots=2 * n + 1024))
            sc = attach(c, config)
            start = time.perf_counter()
            seq, _ = c.prefill(target, [75])
            rows["served"].append(time.perf_counter() - start)
            assert seq.stats.pic_tokens >= 0.9 * n, seq.stats
            for store in (sa, sb, sc):
                store.close()
        med = {k: 1e3 * statistics.median(v) for k, v in rows.items()}
        print(f"{n:>7} {med['fetch']:>9.1f} {med['fetched']:>11.1f} {med['prefill']:>11.1f} "
              f"{med['served']:>10.1f} {megabytes:>6.1f}")


if __name__ == "__main__":
    main()
