"""``irminsul serve --tensor-parallel N``: the server process is rank 0, the leader; it starts N-1
follower processes (:mod:`.ranks`, :mod:`.follower`), builds the server exactly as one process
does (:func:`~irminsul.server.launch.build_server`) with the leader's engine over its shard, and
serves until interrupted.

A follower that fails stops the server: its process ending (watched every 0.1 s, idle or not), a
collective that fails (a closed connection at once, a hung rank after ``timeout_s``), or an error
inside a step. The leader logs one error naming the rank and what it was doing, fails the requests
in flight (each gets an error response: nothing waits for a rank that is gone), stops the HTTP
server (``/health`` answers 503 meanwhile), kills the followers left and exits with status 1. A
normal stop (SIGINT, SIGTERM) releases the followers and waits for them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch

from ..config import EngineConfig, ParallelConfig, ServerConfig
from ..engine.model_runner import ModelRunner
from ..model import MLAModel, load_config
from .follower import STARTUP_TIMEOUT_S, FollowerSpec
from .group import ParallelGroup, RankFailure, abort, init, shutdown
from .leader import LeaderRunner, check_repair, leader_engine
from .load import load_shard
from .ranks import Exited, Followers, free_address
from .shard import check_divisible, shard_model

if TYPE_CHECKING:
    from ..engine import Engine
    from ..server.async_engine import AsyncEngine

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often the leader looks at its followers' processes
GRACE_S = 5.0  # the HTTP server's graceful stop after a failure (in-flight requests have failed)
BACKSTOP_S = 30.0  # after a failure, the process ends by this time whatever still runs
STOP_TIMEOUT_S = 30.0  # a normal stop: the followers' time to leave the group


def leader_load(world: int, *, keep_fp8: bool = False) -> Callable[..., MLAModel]:
    """How rank 0 reads the checkpoint (``build_server``'s ``load``): its share alone
    (:func:`~.load.load_shard`), as every rank does; what runs the model before serving (the
    PIC gate) runs it through the ranks' engines (:meth:`Leader.engine`)."""

    def share(path: Path, *, dtype: torch.dtype, device: str) -> MLAModel:
        return load_shard(path, 0, world, dtype=dtype, device=device, keep_fp8=keep_fp8)

    return share


def rank_devices(device: str, world: int, flag: str = "--tensor-parallel") -> list[str]:
    """Each rank's device: on CUDA one GPU per rank, from ``device``'s index on (``cuda``:
    0 .. world-1, LOCAL_RANK-style); on the CPU, the CPU for all. ``flag``: the option that
    asked for the ranks, named in the errors."""
    where = torch.device(device)
    if where.type == "cpu":
        return ["cpu"] * world
    if where.type != "cuda":
        raise ValueError(f"{flag} runs on cuda or cpu, not {device}")
    first, count = where.index or 0, torch.cuda.device_count()
    if first + world > count:
        raise ValueError(f"{flag} {world} from {device} needs GPUs {first} .. "
                         f"{first + world - 1}; {count} are visible")
    return [f"cuda:{first + rank}" for rank in range(world)]


class Leader:
    """Rank 0 of a tensor-parallel server: its group, its followers, and what happens when one
    fails. Its :meth:`engine` is the ``make_engine`` hook of ``build_server``."""

    def __init__(self, parallel: ParallelConfig, followers: Followers) -> None:
        self.parallel = parallel
        self.followers = followers
        self.group: ParallelGroup | None = None
        # The last engine opened (the serving one, once serving), weakly: a gate engine's pool
        # must be freed before the serving pool is sized from the memory left.
        self._runner: Callable[[], LeaderRunner | None] = lambda: None
        self._opened = False
        self.doing = "starting the follower ranks"
        self._lock = threading.Lock()
        self._cause: str | None = None  # why the leader's own side failed (a collective, a step)
        self._failed_step: str | None = None  # the runner's step that failed, if one did
        self._failure: str | None = None  # the message logged when the server began to stop
        self._closing = False  # a normal stop: followers ending is expected
        self._wake = threading.Event()
        self._serving: tuple[AsyncEngine, Callable[[], None]] | None = None
        self._watcher = threading.Thread(target=self._watch, name="irminsul-ranks", daemon=True)

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def start(self, specs: list[FollowerSpec], address: str, device: str) -> None:
        """Start the followers, watch them, and join the group as rank 0."""
        for spec in specs:
            self.followers.start(spec)
        self._watcher.start()
        self.doing = "joining the process group"
        self.group = init(0, self.parallel, address, device=device)
        self.doing = "loading the checkpoint"

    def engine(self, model: MLAModel, config: EngineConfig, *,
               runner: type[ModelRunner] = ModelRunner) -> Engine:
        """An engine of the leader's over its shard of ``model``, opened on every rank (the
        followers get ``config`` — the pool's size is decided here — and build theirs): the PIC
        gate's engines, then the serving one, the last opened."""
        assert self.group is not None, "start() first"
        self.doing = "sharding the model"
        shard_model(model, self.group)  # random weights are whole until here; a share stays
        first = not self._opened
        self.doing = ("opening an engine on the ranks" if not first else
                      "opening an engine on the ranks (the followers may still be loading)")
        # Only the first engine waits for the followers' loads; later ones, the group timeout.
        engine = leader_engine(model, config, self.group, runner=runner,
                               on_failure=self._step_failed,
                               timeout_s=STARTUP_TIMEOUT_S if first else None)
        self._opened = True
        self._runner = weakref.ref(engine.runner)
        self.doing = "running the PIC gate or starting the HTTP server"
        return engine

    def serving(self, engine: AsyncEngine, stop_server: Callable[[], None]) -> None:
        """From now on a failure stops ``engine`` (failing its requests) and the HTTP server."""
        self._serving = (engine, stop_server)
        self.doing = "serving"

    def fail(self, cause: str) -> None:
        """The leader's side failed (``cause``): stop as for a follower's failure."""
        with self._lock:
            if self._cause is None:
                self._cause = cause
        self._wake.set()

    def _step_failed(self, step: str, err: BaseException) -> None:
        """The runners' ``on_failure``, on the engine thread: ``step`` failed."""
        self._failed_step = step
        self.fail(str(err) if isinstance(err, RankFailure) else
                  f"rank 0 failed in {step}: {type(err).__name__}: {err}")

    # -- the watcher thread ------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._closing:
            self._wake.wait(POLL_S)
            if self._closing:
                return
            exited, cause = self.followers.exited(), self._cause
            if not exited and cause is None:
                continue
            if cause is not None:  # a collective failed: a dead follower may not be reaped yet
                deadline = time.monotonic() + 1.0
                while not exited and time.monotonic() < deadline:
                    time.sleep(0.05)
                    exited = self.followers.exited()
            self._stop(self._message(exited, cause))
            return

    def _message(self, exited: list[Exited], cause: str | None) -> str:
        parts = []
        for rank in exited:
            if rank.report:
                parts.append(str(rank))
            elif self._serving is not None:
                runner = self._runner()
                step = self._failed_step or (runner.doing if runner else None)
                parts.append(f"{rank} while " + (f"running {step} with the leader" if step else
                                                 "waiting for the leader's next step (idle)"))
            else:
                parts.append(f"{rank} while the leader was {self.doing}")
        if cause is not None:
            parts.append(cause if exited else
                         f"{cause} (ranks {self.followers.running()} are still running)")
        return f"tensor parallel: {'; '.join(parts)}. Stopping the server"

    def _stop(self, message: str) -> None:
        """(The watcher thread.) Record ``message``; fail the requests in flight and stop the
        HTTP server (before serving: end the process); the process ends by BACKSTOP_S whatever
        still runs."""
        if not self._record(message):
            return
        if self._serving is None:  # still starting: nothing to answer, nobody to tell
            self._end()
        engine, stop_server = self._serving
        engine.shutdown(timeout=GRACE_S)  # every request in flight gets an EngineError
        stop_server()
        time.sleep(BACKSTOP_S)
        log.error("tensor parallel: the server did not stop within %.0f s; ending it",
                  BACKSTOP_S)
        self._end()

    def _record(self, message: str) -> bool:
        """Log the failure's one message; False if one was logged already."""
        with self._lock:
            if self._failure is not None:
                return False
            self._failure = message
        log.error("%s", message)
        return True

    def _end(self) -> NoReturn:
        """After a failure: kill the followers left and end this process with status 1 (the
        group cannot be torn down: that waits for the failed peer)."""
        self.followers.kill()
        self.followers.close()
        abort(1)

    # -- the main thread, once the HTTP server has returned ----------------------------------------

    def close(self) -> int:
        """Stop the ranks once the HTTP server has stopped: release the followers and leave
        the group (returns 0); after a failure, end the process with status 1."""
        if self._failure is None and self._cause is None and not self.followers.exited():
            status = self._release()
            if status is not None:
                return status
        if self._failure is None:  # let the watcher name what failed, if it is about to
            self._wake.set()
            self._watcher.join(1.5)
        self._record(self._message(self.followers.exited(),
                                   self._cause or f"rank 0 stopped while {self.doing}"))
        self._end()

    def _release(self) -> int | None:
        """The normal stop; None where it fails (the caller then ends as after a failure)."""
        # Not AsyncEngine.alive: that is False once shutdown() was called, while the engine
        # thread may still be inside a step (shutdown's join gives up after 10 s), whose
        # collectives a STOP broadcast now would cross.
        if self._serving is not None and not self._serving[0].join(STOP_TIMEOUT_S):
            self._cause = "the engine thread did not stop (a step may still be running)"
            return None
        self._closing = True
        self._wake.set()
        try:
            runner = self._runner()
            if runner is not None:
                runner.stop()
        except RankFailure as err:
            self._cause = str(err)
            return None
        stopped = self.followers.wait(STOP_TIMEOUT_S)
        if not stopped or any(rank.status for rank in self.followers.exited()):
            self._cause = (f"the follower ranks did not stop within {STOP_TIMEOUT_S:.0f} s"
                           if not stopped else "a follower rank did not stop cleanly")
            return None
        self.followers.close()
        shutdown()
        return 0


def serve_tensor_parallel(model_dir: str | os.PathLike, config: ServerConfig,
                          parallel: ParallelConfig, *,
                          random_weights: str | os.PathLike | None = None) -> int:
    """Serve ``model_dir`` on ``parallel.world_size`` ranks until interrupted (see the module
    docstring); returns 0 after a normal stop, and ends the process with status 1 after a
    failure. ValueError, before any rank starts, for a model whose heads, experts or MLP
    widths do not split evenly, or repair that does not run sharded."""
    import uvicorn

    from ..server.launch import build_server, resolve_device

    world = parallel.world_size
    path = Path(model_dir)
    checkpoint = random_weights if random_weights is not None else path
    try:
        check_divisible(load_config(checkpoint), world)
    except ValueError as err:
        raise ValueError(f"--tensor-parallel {world} does not fit {checkpoint}: {err}") from None
    check_repair(config.engine.cache, world)
    device, _ = resolve_device(config)
    devices = rank_devices(device, world)
    vocab, never = _random_weights_ids(path) if random_weights is not None else (0, ())
    threads = max(1, (os.cpu_count() or 1) // world)  # the host's cores, shared by the ranks
    torch.set_num_threads(threads)
    if devices[0].startswith("cuda"):
        torch.cuda.set_device(torch.device(devices[0]))
    address = free_address()
    followers = Followers()
    leader = Leader(parallel, followers)
    specs = [FollowerSpec(rank, parallel, address, str(path),
                          dataclasses.replace(config, device=devices[rank]), threads,
                          followers.report_path(rank),
                          None if random_weights is None else str(random_weights), vocab, never)
             for rank in range(1, world)]
    try:
        leader.start(specs, address, devices[0])
        app, engine = build_server(path, dataclasses.replace(config, device=devices[0]),
                                   random_weights=random_weights, make_engine=leader.engine,
                                   load=leader_load(world, keep_fp8=config.keep_fp8),
                                   random_share=(0, world))
        server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                               log_level="info",
                                               timeout_graceful_shutdown=int(GRACE_S)))

        def stop_server() -> None:
            server.should_exit = True

        leader.serving(engine, stop_server)
        if threading.current_thread() is threading.main_thread():
            # uvicorn stops on SIGTERM, then raises it again once it has restored this handler:
            # a KeyboardInterrupt here, so the followers are released rather than orphaned.
            signal.signal(signal.SIGTERM, signal.default_int_handler)
        log.info("tensor parallel: %d ranks over %s (%s); rank 0 serves HTTP", world,
                 parallel.backend or ("nccl" if devices[0].startswith("cuda") else "gloo"),
                 ", ".join(devices))
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal it stopped on: a normal stop
        if leader.doing != "serving":
            leader.fail(f"rank 0 was interrupted while {leader.doing}")
    except BaseException as err:
        if not isinstance(err, (ValueError, OSError, RankFailure)):  # a bug: its traceback helps
            log.error("tensor parallel: rank 0 failed while %s", leader.doing, exc_info=True)
        leader.fail(f"rank 0 failed while {leader.doing}: {type(err).__name__}: {err}")
    return leader.close()


def _random_weights_ids(path: Path) -> tuple[int, tuple[int, ...]]:
    """Random weights: the tokenizer's ids and the stop tokens (the rows the model zeroes)."""
    from ..server.prompts import stop_token_ids
    from ..traffic.render import ChatRenderer

    renderer = ChatRenderer.from_dir(path)
    return renderer.tokenizer.get_vocab_size(True), tuple(stop_token_ids(path, renderer))
