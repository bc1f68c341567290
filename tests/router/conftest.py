"""The router tests' fixtures: three servers of the embedded default model (router_servers.py
starts them), one torch thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from router_servers import backend


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every module here on one torch thread (the shared fixture)."""


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[str]]:
    with backend() as a, backend() as b, backend() as c:
        yield [a, b, c]
