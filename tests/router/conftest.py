"""The router tests' fixtures: three servers of the embedded default model (router_servers.py
starts them), one torch thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from router_servers import backend


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """A small model gains nothing from intra-op threads; spinning ones slow shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[str]]:
    with backend() as a, backend() as b, backend() as c:
        yield [a, b, c]
