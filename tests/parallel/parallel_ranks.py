"""Run a function on W ranks, each its own process, and collect what each returned or raised.

Each rank joins a group at a port the OS just gave out (gloo on CPUs; on CUDA, rank r on GPU r
over NCCL), runs ``fn(group, *args)`` on one torch thread, and puts its result (or its error's
type and message) on a queue. The whole run has a deadline: a rank still running past it is
killed and the run fails, so a hang fails a test instead of blocking CI.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from irminsul.config import ParallelConfig
from irminsul.parallel import ParallelGroup, RankFailure, abort, init, shutdown


@dataclass
class Outcome:
    """One rank's end: its return value, or the type and message of what it raised."""

    rank: int
    value: Any = None
    error: str | None = None  # "TypeName: message"
    exitcode: int | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable, rank: int, config: ParallelConfig, address: str, args: tuple,
               results: mp.Queue, device: str) -> None:
    torch.set_num_threads(1)  # the test machine's cores are shared: one thread per rank
    try:
        if device == "cuda":
            device = f"cuda:{rank}"
            torch.cuda.set_device(device)
        group = init(rank, config, address, device=device)
        value = fn(group, *args)
    except RankFailure as err:  # the group is broken: report, then end as a server would
        results.put((rank, None, f"{type(err).__name__}: {err}"))
        traceback.print_exc()
        results.close()
        results.join_thread()  # the report is sent before the process ends
        abort(1)
    except BaseException as err:  # reported, not raised: the parent checks every rank
        results.put((rank, None, f"{type(err).__name__}: {err}"))
        traceback.print_exc()
    else:
        # Pickled here, by value: the queue's own pickler sends a tensor as a handle to this
        # process's shared memory, which is gone if the parent reads it after this ends.
        results.put((rank, pickle.dumps(value), None))
    shutdown()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 120.0,
              collective_timeout_s: float = 30.0,
              wait_for: Collection[int] | None = None, device: str = "cpu") -> list[Outcome]:
    """``fn(group, *args)`` on ``world`` ranks; each rank's :class:`Outcome`, by rank. ``fn``
    must be importable by name (a module-level function). Fails if a rank of ``wait_for``
    (default: all) is still running after ``timeout_s``; the others are killed once those
    have reported. ``device``: ``cpu`` (gloo) or ``cuda`` (rank r on GPU r, NCCL; the rank's
    current device is set, so ``fn`` places its tensors with ``device="cuda"``)."""
    wait_for = set(range(world) if wait_for is None else wait_for)
    context = mp.get_context("spawn")
    results = context.Queue()
    config = ParallelConfig(world_size=world, backend="gloo" if device == "cpu" else None,
                            timeout_s=collective_timeout_s)
    address = f"tcp://127.0.0.1:{free_port()}"
    procs = [context.Process(target=_rank_main,
                             args=(fn, r, config, address, args, results, device), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    outcomes = {r: Outcome(r) for r in range(world)}
    reported: set[int] = set()
    try:
        while not wait_for <= reported:
            alive = any(p.is_alive() for p in procs)
            try:
                rank, value, error = results.get(timeout=0.2)
            except queue.Empty:
                if not alive:  # every process ended; those that did not report died
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(wait_for - reported)} of "
                                       f"{world} still running after {timeout_s:g} s") from None
                continue
            outcomes[rank].value = None if value is None else pickle.loads(value)
            outcomes[rank].error = error
            reported.add(rank)
        for r, p in enumerate(procs):
            if r in wait_for:
                p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # only the processes this call started
                p.join()
    for r, p in enumerate(procs):
        outcomes[r].exitcode = p.exitcode
    return [outcomes[r] for r in range(world)]


def values(outcomes: list[Outcome]) -> list[Any]:
    """Every rank's return value; fails naming the ranks that raised or died."""
    bad = [o for o in outcomes if o.error is not None or o.exitcode != 0]
    assert not bad, [(o.rank, o.error, o.exitcode) for o in bad]
    return [o.value for o in outcomes]


__all__ = ["Outcome", "ParallelGroup", "free_port", "run_ranks", "values"]
