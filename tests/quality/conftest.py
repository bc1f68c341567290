"""The gate's tests share one result cache and two measurements: the embedded default model's
and an unsafe checkpoint's (gate_checkpoints.py), each measured once per session (a measurement
takes seconds to a minute on two loaded CPU cores), then read from the cache."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gate_checkpoints import copy_default, gate_of, make_unsafe

from irminsul.config import GateConfig
from irminsul.model.default import default_model_dir
from irminsul.quality import GateResult
from irminsul.quality import gate as gate_module


@pytest.fixture(scope="session")
def gate_config(tmp_path_factory: pytest.TempPathFactory) -> GateConfig:
    """The default thresholds, with a result cache of the session's own."""
    return GateConfig(cache_dir=str(tmp_path_factory.mktemp("gate-cache")))


@pytest.fixture(scope="session")
def default_result(gate_config: GateConfig) -> GateResult:
    return gate_of(default_model_dir(), gate_config)


@pytest.fixture(scope="session")
def unsafe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = copy_default(tmp_path_factory.mktemp("unsafe") / "unsafe_model")
    make_unsafe(directory)
    return directory


@pytest.fixture
def measurements(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], int]]:
    """Counts the gate's measurements from here on (its calls of ``measure``): a cached result
    is one read without any."""
    calls = []
    measure = gate_module.measure

    def counted(*args: object, **kwargs: object):
        calls.append(1)
        return measure(*args, **kwargs)

    monkeypatch.setattr(gate_module, "measure", counted)
    yield lambda: len(calls)


@pytest.fixture
def forwards(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Counts model forwards from here on (whole-prompt and paged alike, on every model)."""
    from irminsul.model import MLAModel

    calls = []
    for name in ("forward_batch", "hidden_paged"):
        method = getattr(MLAModel, name)

        def counted(self, *args, _method=method, **kwargs):
            calls.append(1)
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(MLAModel, name, counted)
    return lambda: len(calls)
