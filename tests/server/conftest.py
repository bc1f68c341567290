"""The server tests' fixtures: the tiny model directory and one server per module
(fixtures/openai_server.py has the server itself)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.openai_server import Server, config, running
from fixtures.tiny_server_model import build


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("tiny-server-model"))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Server]:
    with running(model_dir, config()) as served:
        yield served
