"""One rank of ``irminsul serve --data-parallel N``: a whole server of its own (HTTP, scheduler, cache,
PIC) over its data-parallel share of the model, its model calls in lockstep with the other
ranks' (:mod:`.lockstep`). Started by :mod:`.data_serving` as ``python -m
irminsul.parallel.rank_server`` with its :class:`~.follower.FollowerSpec` on its stdin (the
spec's server config names this rank's device, host and port).

As a tensor-parallel follower does, it exits when the process that started it ends (its stdin
closes), and on any failure writes one line — what it was doing, the error — to its report file
and exits with status 1: a step that failed leaves the ranks out of step, and the others' next
collective fails too, so the whole server stops. A normal stop (SIGINT or SIGTERM to any rank)
is announced to every rank in one turn (:meth:`~.lockstep.LockstepRunner.idle`); each rank's
engine then stops, and its HTTP server with it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

from ..config import EngineConfig
from ..engine import Engine
from ..engine.model_runner import ModelRunner
from ..model import MLAModel
from .follower import Follower, started

log = logging.getLogger("irminsul.parallel.rank_server")

WATCH_S = 0.1  # how often the HTTP server looks whether its engine has stopped


class RankServer(Follower):
    """One rank's server; :attr:`doing` says what it is doing, for its failure report."""

    def run(self) -> int:
        """Join, load, serve until stopped; returns 0. Raises what failed."""
        import uvicorn

        from ..server.launch import build_server
        from . import shard_model
        from .follower import STARTUP_TIMEOUT_S
        from .lockstep import lockstep_engine, rendezvous

        spec = self.spec
        group, device = self._join()
        self.doing = "loading the checkpoint"
        met = False  # the ranks met before this rank's first engine (their loads done)

        def load(path: Path, *, dtype: torch.dtype, device: str) -> MLAModel:
            return self._load(device)  # this rank's share alone

        def engine(model: MLAModel, config: EngineConfig, *,
                   runner: type[ModelRunner] = ModelRunner) -> Engine:
            self.doing = "running the PIC gate and starting the server (in step with the others)"
            shard_model(model, group, "data")  # joins the MoE layers (a share stays as it is)
            nonlocal met
            if not met:  # the others may still be loading: a step would wait only timeout_s
                rendezvous(group, STARTUP_TIMEOUT_S)
                met = True
            # A failed step leaves the ranks out of step: this rank ends (Follower.fail).
            return lockstep_engine(model, config, group, runner=runner,
                                   on_failure=lambda _, err: self.fail(err))

        app, async_engine = build_server(
            spec.model_dir, spec.config, make_engine=engine, load=load,
            random_weights=spec.random_weights,
            random_share=(spec.rank, spec.parallel.world_size), attention="data")
        server = uvicorn.Server(uvicorn.Config(app, host=spec.config.host, port=spec.config.port,
                                               log_level="warning"))

        def watch() -> None:  # another rank's stop stops this rank's engine: then its server
            while not server.should_exit:
                time.sleep(WATCH_S)
                if server.started and not async_engine.alive:
                    self.stopping = True
                    server.should_exit = True

        threading.Thread(target=watch, name="irminsul-rank-watch", daemon=True).start()
        self.doing = "serving"
        log.info("rank %d of %d serving on %s:%d (%s)", spec.rank, spec.parallel.world_size,
                 spec.config.host, spec.config.port, device)
        try:
            server.run()
        except KeyboardInterrupt:  # uvicorn re-raises the signal it stopped on: a normal stop
            pass
        self.stopping = True
        return 0


def main() -> None:
    """The process: read the spec from stdin, then serve until stopped."""
    rank = started(RankServer)
    spec = rank.spec
    try:
        rank.run()
    except BaseException as err:  # every failure is reported, then the process ends
        rank.fail(err)
    log.info("rank %d stopped", spec.rank)
    try:
        Path(spec.report).unlink(missing_ok=True)
    except OSError:
        pass
    # Not an interpreter exit: the thread reading the parent's pipe would block it, and the
    # group cannot be torn down once a peer has gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
