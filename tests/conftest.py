"""Shared pytest setup: GPU tests run only where CUDA is available; Triton kernel tests run on
CUDA, or on a CPU under Triton's interpreter, which this file switches on when there is no CUDA
(it must be set before the kernels are defined, i.e. before ``irminsul.kernels`` is imported)."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from fixtures.redis_server import RedisServer

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Caches the code keeps between runs (the PIC gate's verdicts) go to a directory of this test
# session, shared by its tests and the servers they start, not to the user's home.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="irminsul-tests-cache-")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = torch.cuda.is_available()
    has_triton = importlib.util.find_spec("triton") is not None
    interpreted = has_triton and os.environ.get("TRITON_INTERPRET") == "1"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    skip_triton = pytest.mark.skip(reason="needs triton with CUDA, or TRITON_INTERPRET=1")
    for item in items:
        if "triton" in item.keywords:
            if not ((has_cuda and has_triton) or interpreted):
                item.add_marker(skip_triton)
        elif "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Torch on one intra-op thread for a module: small models gain nothing from more, and
    spinning threads make tests many times slower when other processes share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test on a free loopback port, killed after it (the shared-store
    tests); skipped where Debian's redis-server is not installed."""
    # Imported here: this file must set TRITON_INTERPRET before anything imports irminsul.
    from fixtures.redis_server import REDIS_SERVER, RedisServer

    from irminsul.loadgen.server import free_port

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
