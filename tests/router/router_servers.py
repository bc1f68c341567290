"""Servers of the embedded default model on loopback, and routers in front of them, all in this
process (uvicorn on threads), so a test can stop a backend and start it again."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
from fixtures.served_app import served

from irminsul.config import EngineConfig, RouterConfig, ServerConfig
from irminsul.model.default import default_model_dir
from irminsul.router.app import build_router
from irminsul.server import build_server

MODEL = "default_model"


@contextlib.contextmanager
def backend(port: int | None = None) -> Iterator[str]:
    """A live server of the embedded model (float32, CPU, no gate: the router is under test)."""
    config = ServerConfig(model_name=MODEL, dtype="float32", device="cpu", gate=None,
                          engine=EngineConfig(mode="live", slots=4096))
    app, _ = build_server(default_model_dir(), config)
    with served(app, port) as url:
        yield url


@dataclass
class Router:
    url: str

    def backends(self) -> list[dict]:
        return httpx.get(f"{self.url}/irminsul/backends").json()["backends"]

    def wait(self, ready: Callable[[list[dict]], bool], timeout: float = 10.0) -> None:
        """Until ``ready`` holds of the backends' states."""
        deadline = time.monotonic() + timeout
        while not ready(self.backends()):
            assert time.monotonic() < deadline, f"router never ready: {self.backends()}"
            time.sleep(0.02)


@contextlib.contextmanager
def router(backends: list[str], **fields: object) -> Iterator[Router]:
    fields.setdefault("poll_interval_s", 0.05)
    config = RouterConfig(backends=tuple(backends), **fields)
    with served(build_router(config, default_model_dir())) as url:
        yield Router(url)
