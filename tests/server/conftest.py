"""The server under test: the tiny model directory, served in-process by uvicorn on a thread (so
tests can reach the engine thread to verify slot accounting with ``Scheduler.check``)."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fixtures.served_app import served
from fixtures.tiny_server_model import build
from openai import OpenAI

from irminsul.config import EngineConfig, ServerConfig
from irminsul.server import AsyncEngine, build_server

SLOTS = 2048


@dataclass
class Server:
    url: str
    engine: AsyncEngine
    client: OpenAI
    model: str
    model_dir: Path
    app: FastAPI

    def check(self, timeout: float = 10.0) -> None:
        """Wait until the engine is idle, then verify its slot accounting (on its thread)."""
        deadline = time.monotonic() + timeout
        while self.engine.run_in_engine_thread(lambda s: s.has_work()).result(5):
            assert time.monotonic() < deadline, "engine still busy"
            time.sleep(0.01)
        self.engine.run_in_engine_thread(lambda s: s.check()).result(5)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    def errors(self, status: int, code: str | None = None) -> float:
        """irminsul:request_errors_total summed over the series with this status (and code)."""
        text = httpx.get(f"{self.url}/metrics").text
        total = 0.0
        for labels, value in re.findall(r"^irminsul:request_errors_total\{(.*)\} (\S+)$", text,
                                        re.MULTILINE):
            if f'status="{status}"' in labels and (code is None or f'code="{code}"' in labels):
                total += float(value)
        return total


@contextlib.contextmanager
def running(model_dir: Path, config: ServerConfig) -> Iterator[Server]:
    """Serve ``model_dir`` on a free loopback port until the block ends."""
    app, engine = build_server(model_dir, config)
    with served(app) as url:
        yield Server(url, engine, OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0),
                     config.model_name or model_dir.name, model_dir, app)
    assert not engine.alive  # the lifespan shut the engine thread down


def config(**server: object) -> ServerConfig:
    """The tests' server: the tiny model in float32 on the CPU, live PIC, SLOTS slots, and no
    PIC gate at start (the tiny model's weights are random: the gate's KL would be noise;
    tests/quality tests the gate)."""
    engine = server.pop("engine", None) or EngineConfig(mode="live", slots=SLOTS)
    server.setdefault("gate", None)
    return ServerConfig(model_name="tiny", dtype="float32", device="cpu", engine=engine,
                        **server)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("tiny-server-model"))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Server]:
    with running(model_dir, config()) as served:
        yield served
