"""The embedded default model and live engines attached to the store (the Redis server per test
is tests/conftest.py's ``redis_server``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from irminsul.config import EngineConfig, StoreConfig
from irminsul.engine import Engine
from irminsul.model import MLAModel, load_model
from irminsul.model.default import default_model_dir
from irminsul.store import SharedStore, attach

SLOTS = 3000


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
