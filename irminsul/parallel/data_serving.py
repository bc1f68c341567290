"""``irminsul serve --data-parallel N``: a server per rank behind the content router.

Under data-parallel attention each rank serves its own requests with a whole engine (its own
scheduler, chunk registry and KV pool: PIC unchanged), every rank holding all attention heads
and dense layers and 1/N of the routed experts, the ranks' MoE layers in lockstep
(:mod:`.lockstep`). This process starts the N rank servers (:mod:`.rank_server`, one per GPU,
each on a loopback port of its own), waits until every one answers ``/health``, then serves the
router (:mod:`irminsul.router`) on the server's address: each request goes to the rank whose
cache holds most of its tokens, balanced by load, so an agent's documents stay with the rank
that computed them.

A rank that ends (a crash, the OOM killer, a failed step, which fails its peers' next
collective too) stops the server: this process logs one error naming the rank and what it
reported, stops the router, kills the ranks left and exits with status 1. A normal stop (SIGINT,
SIGTERM) stops the router, then the ranks (SIGINT each: they agree on the stop in one turn), and
exits 0 once they have.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from pathlib import Path

import httpx

from ..config import ParallelConfig, RouterConfig, ServerConfig
from ..model import load_config
from .follower import STARTUP_TIMEOUT_S, FollowerSpec
from .ranks import Followers, free_address
from .serving import POLL_S, STOP_TIMEOUT_S, _random_weights_ids, rank_devices
from .shard import check_divisible

log = logging.getLogger(__name__)


def _free_port() -> int:
    return int(free_address().rsplit(":", 1)[1])


class Ranks:
    """The rank servers of one data-parallel server, watched from this process."""

    def __init__(self, world: int) -> None:
        self.processes = Followers(module="irminsul.parallel.rank_server")
        self.world = world
        self.urls: list[str] = []
        self.failure: str | None = None
        self.closing = False

    def start(self, specs: list[FollowerSpec]) -> None:
        for spec in specs:
            self.processes.start(spec)
            self.urls.append(f"http://{spec.config.host}:{spec.config.port}")

    def wait_ready(self, timeout_s: float) -> None:
        """Until every rank answers ``/health`` (each has loaded, run the gate in step with the
        others and started its HTTP server); RuntimeError naming the rank if one ends first."""
        deadline, waiting = time.monotonic() + timeout_s, set(range(self.world))
        while waiting:
            if self.processes.exited():
                raise RuntimeError(self.describe())
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks {sorted(waiting)} did not start within "
                                   f"{timeout_s:.0f} s")
            for rank in sorted(waiting):
                try:
                    if httpx.get(f"{self.urls[rank]}/health", timeout=2).status_code == 200:
                        waiting.discard(rank)
                except httpx.TransportError:
                    pass
            time.sleep(POLL_S)

    def describe(self) -> str:
        exited = self.processes.exited()
        return ("data parallel: " + "; ".join(str(rank) for rank in exited)
                + f" (ranks {self.processes.running()} still running). Stopping the server")

    def watch(self, on_failure: threading.Event) -> None:
        """(A thread.) Set ``on_failure`` once a rank ends while the server is not stopping."""
        while not self.closing:
            time.sleep(POLL_S)
            if not self.closing and self.processes.exited():
                self.failure = self.describe()
                log.error("%s", self.failure)
                on_failure.set()
                return

    def stop(self) -> bool:
        """The normal stop: SIGINT to every rank, then wait; whether all ended with status 0."""
        self.closing = True
        for process in self.processes.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        stopped = self.processes.wait(STOP_TIMEOUT_S)
        clean = stopped and not any(rank.status for rank in self.processes.exited())
        if not clean:
            log.error("data parallel: the ranks did not stop cleanly: %s",
                      "; ".join(str(rank) for rank in self.processes.exited()) or "timed out")
        self.processes.kill()
        self.processes.close()
        return clean

    def kill(self) -> None:
        self.closing = True
        self.processes.kill()
        self.processes.close()


def front_router(config: ServerConfig, urls: list[str]) -> RouterConfig:
    """The router in front of the ranks, on the server's address. It reads every body before
    a rank does, so it holds them to the server's limits: ``--max-request-bytes`` (unset: the
    router's own default; each rank still applies the context-sized one) and
    ``--body-timeout``. Each rank serves its index only to ``--index-token``'s bearer: the
    router sends it (without it every poll gets 401 and every rank is taken as down)."""
    limit = config.max_request_bytes
    return RouterConfig(backends=tuple(urls), host=config.host, port=config.port,
                        body_timeout_s=config.body_timeout_s, index_token=config.index_token,
                        **({} if limit is None else {"max_request_bytes": limit}))


def serve_data_parallel(model_dir: str | os.PathLike, config: ServerConfig,
                        parallel: ParallelConfig, *,
                        random_weights: str | os.PathLike | None = None) -> int:
    """Serve ``model_dir`` on ``parallel.world_size`` rank servers behind the router until
    interrupted (module docstring); 0 after a normal stop, 1 after a failure. ValueError, before
    any rank starts, where the routed experts do not split evenly over the ranks, or a shared
    store is given without its model id."""
    import uvicorn

    from ..router.app import build_router
    from ..server.launch import resolve_device

    world = parallel.world_size
    if config.store.url is not None and config.store.model_id is None:
        # The identity samples the weights, and each rank holds other experts.
        raise ValueError("--store under --data-parallel needs --store-model-id: each rank holds "
                         "other experts, so the model identity the store keys carry cannot be "
                         "computed from a rank's weights")
    path = Path(model_dir)
    checkpoint = random_weights if random_weights is not None else path
    try:
        check_divisible(load_config(checkpoint), world, "data")
    except ValueError as err:
        raise ValueError(f"--data-parallel {world} does not fit {checkpoint}: {err}") from None
    device, _ = resolve_device(config)
    devices = rank_devices(device, world, "--data-parallel")
    vocab, never = _random_weights_ids(path) if random_weights is not None else (0, ())
    threads = max(1, (os.cpu_count() or 1) // world)
    address = free_address()
    ranks = Ranks(world)
    specs = [FollowerSpec(rank, parallel, address, str(path),
                          dataclasses.replace(config, device=devices[rank], host="127.0.0.1",
                                              port=_free_port()),
                          threads, ranks.processes.report_path(rank),
                          None if random_weights is None else str(random_weights), vocab, never)
             for rank in range(world)]
    failed = threading.Event()
    try:
        ranks.start(specs)
        ranks.wait_ready(STARTUP_TIMEOUT_S)
    except BaseException as err:
        log.error("data parallel: the ranks did not start: %s", err)
        ranks.kill()
        return 1
    router = front_router(config, ranks.urls)
    server = uvicorn.Server(uvicorn.Config(build_router(router, path), host=config.host,
                                           port=config.port, log_level="info"))

    def stop_on_failure() -> None:
        failed.wait()
        server.should_exit = True

    threading.Thread(target=ranks.watch, args=(failed,), name="irminsul-ranks",
                     daemon=True).start()
    threading.Thread(target=stop_on_failure, name="irminsul-stop", daemon=True).start()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # as under tensor parallel
    log.info("data parallel: %d rank servers over %s (%s: %s) behind the router on %s:%d",
             world, parallel.backend or ("nccl" if devices[0].startswith("cuda") else "gloo"),
             ", ".join(devices), ", ".join(ranks.urls), config.host, config.port)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal it stopped on: a normal stop
        pass
    except BaseException:  # the router did not start (its port taken: SystemExit) or crashed
        ranks.kill()
        raise
    if failed.is_set():
        ranks.kill()
        return 1
    return 0 if ranks.stop() else 1

