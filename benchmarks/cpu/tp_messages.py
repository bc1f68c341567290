"""The leader's per-step message under tensor parallel: a decode step's ForwardBatch sent whole
against the same step with the key handles mirrored on the followers (irminsul/parallel/keys.py).

For B requests decoding at a context of C tokens: the pickled bytes of one step's message, and the
median over --steps decode steps of (a) the leader's host time to build it (encode + pickle), (b)
a follower's to read it (unpickle + decode), (c) the broadcast itself between two gloo processes
on this host (irminsul.parallel.group.broadcast, the path the server uses).

    python benchmarks/cpu/tp_messages.py [--batch 64] [--context 16384] [--steps 20] [--out F]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import statistics
import time
from datetime import datetime, timezone

import numpy as np

from irminsul.engine.batch import ForwardBatch
from irminsul.parallel.keys import KeyMirror
from irminsul.parallel.ranks import free_address


def steps(batch: int, context: int, count: int) -> list[ForwardBatch]:
    """``count`` consecutive decode steps of ``batch`` requests (distinct handles, as a pool
    gives them), the first at ``context`` tokens."""
    rng = np.random.default_rng(0)
    keys = [rng.permutation(batch * (context + count))[i::batch][:context].astype(np.int64)
            for i in range(batch)]
    fresh = iter(range(10 ** 9, 2 * 10 ** 9))
    out = []
    for _ in range(count):
        new = np.array([next(fresh) for _ in range(batch)], dtype=np.int64)
        keys = [np.append(k, n) for k, n in zip(keys, new)]
        out.append(ForwardBatch(np.zeros(batch, dtype=np.int64),
                                [np.array([len(k) - 1]) for k in keys], keys, new))
    return out


def host_times(batches: list[ForwardBatch], mirrored: bool) -> dict:
    leader, follower = KeyMirror(), KeyMirror()
    build, read, sizes = [], [], []
    for b in batches:
        start = time.perf_counter()
        data = pickle.dumps(leader.encode(b) if mirrored else b)
        built = time.perf_counter()
        message = pickle.loads(data)
        if mirrored:
            follower.decode(message)
        read.append(time.perf_counter() - built)
        build.append(built - start)
        sizes.append(len(data))
    # The first step sends every array whole: the steady state is the rest.
    return dict(first_bytes=sizes[0], bytes=int(statistics.median(sizes[1:])),
                leader_ms=1e3 * statistics.median(build[1:]),
                follower_ms=1e3 * statistics.median(read[1:]))


def _rank(rank: int, address: str, messages: list, results: mp.Queue) -> None:
    import torch

    from irminsul.config import ParallelConfig
    from irminsul.parallel.group import broadcast, init, shutdown

    torch.set_num_threads(1)
    group = init(rank, ParallelConfig(world_size=2, backend="gloo"), address)
    times = []
    for message in messages:
        broadcast(group, None)  # line the ranks up
        start = time.perf_counter()
        broadcast(group, message if rank == 0 else None)
        times.append(time.perf_counter() - start)
    if rank == 1:
        results.put(times)
    shutdown()


def broadcast_ms(messages: list) -> float:
    """Median seconds (as ms) a follower waits for each message, gloo over loopback."""
    address = free_address()
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_rank, args=(r, address, messages, results))
             for r in range(2)]
    for p in procs:
        p.start()
    times = results.get(timeout=600)
    for p in procs:
        p.join(60)
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    batches = steps(args.batch, args.context, args.steps)
    rows = {}
    for name, mirrored in (("whole", False), ("mirrored", True)):
        rows[name] = host_times(batches, mirrored)
        mirror = KeyMirror()
        messages = [mirror.encode(b) if mirrored else b for b in batches]
        rows[name]["broadcast_ms"] = broadcast_ms(messages)
    print(f"decode step of {args.batch} requests at {args.context} tokens, medians of "
          f"{args.steps - 1} steps")
    print(f"{'message':<10}{'bytes':>12}{'leader ms':>11}{'follower ms':>13}{'broadcast ms':>14}")
    for name, row in rows.items():
        print(f"{name:<10}{row['bytes']:>12,}{row['leader_ms']:>11.3f}{row['follower_ms']:>13.3f}"
              f"{row['broadcast_ms']:>14.3f}")
    if args.out:
        import torch

        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           device="cpu", torch=torch.__version__, cores=os.cpu_count(),
                           load=os.getloadavg()[0], batch=args.batch, context=args.context,
                           steps=args.steps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
