"""A real Redis server on a free loopback port per test (Debian's ``redis-server``; .ci/run
installs it), the embedded default model, and the prompts the store tests serve."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from irminsul.config import EngineConfig, StoreConfig
from irminsul.engine import Engine
from irminsul.loadgen.server import free_port
from irminsul.model import MLAModel, load_model
from irminsul.model.default import default_model_dir
from irminsul.store import SharedStore, attach

REDIS_SERVER = shutil.which("redis-server")
SLOTS = 3000


class RedisServer:
    """A redis-server process on ``port``, capped at 64 MB with LRU eviction, no persistence
    (a restart empties it, as a store restarted without its disk would be)."""

    def __init__(self, port: int, workdir: Path) -> None:
        self.port, self.workdir = port, workdir
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> None:
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru",
             "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return
            except redis.ConnectionError:
                assert self.process.poll() is None, "redis-server exited"
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: no goodbye to the clients."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel, nothing is answered (a slow store)."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run "
                    "installs it)")
    server = RedisServer(free_port(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        if server.process is not None and server.process.poll() is None:
            server.resume()  # a paused one would not die of SIGKILL any sooner, but be sure
            server.kill()


@pytest.fixture(scope="session")
def model() -> MLAModel:
    return load_model(default_model_dir())


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every module here on one torch thread (the shared fixture)."""


@pytest.fixture
def engines(model: MLAModel) -> Iterator[Callable[..., Engine]]:
    """``make(url=None, **store)``: a live engine of the embedded model, attached to the store
    at ``url`` (StoreConfig fields in ``store``); every store is closed after the test."""
    stores: list[SharedStore] = []

    def make(url: str | None = None, **store: object) -> Engine:
        engine = Engine(model, EngineConfig(slots=SLOTS, mode="live"))
        if url is not None:
            stores.append(attach(engine, StoreConfig(url=url, **store)))
        return engine

    yield make
    for store in stores:
        store.close()
